"""Calibration data: text from anywhere, cut into blocks of token ids.

Accepted: None / "default" (the diverse set shipped with fastawq: Brown-corpus English across
twelve genres plus about 15 % Python code, see fastawq.data), "pileval" (AutoAWQ's hub default,
served by that offline set with a log line), "stdlib" (the earlier default: the standard
library's docstrings), a list of strings, a list of token-id
lists, an [n, seq_len] id tensor, a local .txt (paragraphs) or .jsonl (one object per line,
`text_column`) file, or a `datasets` Dataset / a dataset name when that package is installed.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

CalibData = Any  # see the module docstring


def _texts_from_file(path: Path, text_column: str) -> list[str]:
    if path.suffix == ".jsonl":
        texts = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
                if text_column not in obj:
                    raise KeyError(f"{path}:{i}: no field {text_column!r} (has {sorted(obj)})")
                texts.append(str(obj[text_column]))
        return texts
    text = path.read_text(encoding="utf-8", errors="replace")
    return [p for p in text.split("\n\n") if p.strip()]


def _texts_or_ids(data: CalibData, split: str, text_column: str, n_samples: int, seq_len: int):
    """-> ("text", list[str]) or ("ids", list[list[int]])."""
    if data is None or (isinstance(data, str) and data in ("default", "pileval", "stdlib")):
        from fastawq.data import default_calib_texts, stdlib_texts

        if data == "pileval":
            log.info("calibration 'pileval' needs the hub; using fastawq's offline default text instead")
        # ~4 characters per token, with headroom.
        if data == "stdlib":
            return "text", stdlib_texts("calib", max_chars=6 * n_samples * seq_len)
        return "text", default_calib_texts(max_chars=6 * n_samples * seq_len)
    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.exists():
            return "text", _texts_from_file(path, text_column)
        try:
            import datasets
        except ImportError:
            raise FileNotFoundError(
                f"calibration data {str(data)!r} is not a file, and the `datasets` package is not installed"
            ) from None
        ds = datasets.load_dataset(str(data), split=split)
        return "text", [str(t) for t in ds[text_column]]
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.is_floating_point():
            raise ValueError(f"a calibration tensor must be [n, seq_len] token ids, got {data.dtype} {tuple(data.shape)}")
        return "ids", data.tolist()
    if hasattr(data, "column_names"):  # a datasets.Dataset
        if text_column not in data.column_names:
            raise KeyError(f"dataset has no column {text_column!r} (has {data.column_names})")
        return "text", [str(t) for t in data[text_column]]
    if isinstance(data, Sequence) and len(data) > 0:
        if all(isinstance(t, str) for t in data):
            return "text", list(data)
        if all(isinstance(t, Sequence) and all(isinstance(i, int) for i in t) for t in data):
            return "ids", [list(t) for t in data]
    raise TypeError(
        f"unsupported calibration data {type(data).__name__}: pass None, a list of strings, a list of "
        f"token-id lists, an id tensor, a .txt/.jsonl path, or a datasets.Dataset"
    )


def get_calib_dataset(
    data: CalibData = None,
    tokenizer: Any = None,
    n_samples: int = 128,
    max_seq_len: int = 512,
    split: str = "train",
    text_column: str = "text",
) -> torch.Tensor:
    """Token blocks [n, max_seq_len] (n <= n_samples) from concatenated calibration samples."""
    if n_samples <= 0 or max_seq_len <= 0:
        raise ValueError(f"n_samples and max_seq_len must be positive, got {n_samples}, {max_seq_len}")
    kind, items = _texts_or_ids(data, split, text_column, n_samples, max_seq_len)
    need = n_samples * max_seq_len
    ids: list[int] = []
    if kind == "ids":
        for seq in items:
            ids.extend(seq)
            if len(ids) >= need:
                break
    else:
        if tokenizer is None:
            raise ValueError("text calibration data needs a tokenizer")
        sep = tokenizer.eos_token_id
        for text in items:
            text = text.strip()
            if not text:
                continue
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if sep is not None:
                ids.append(sep)
            if len(ids) >= need:
                break
    n = min(n_samples, len(ids) // max_seq_len)
    if n == 0:
        raise ValueError(
            f"calibration data has {len(ids)} tokens, fewer than one block of max_calib_seq_len={max_seq_len}"
        )
    if n < n_samples:
        log.warning("calibration data gives %d blocks of %d tokens (asked for %d)", n, max_seq_len, n_samples)
    return torch.tensor(ids[: n * max_seq_len], dtype=torch.long).view(n, max_seq_len)
