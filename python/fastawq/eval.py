"""Perplexity on held-out text, sliding-window style (each token scored once, with up to
seq_len - stride tokens of left context)."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@torch.no_grad()
def perplexity(
    model: Any,
    tokenizer: Any,
    text: str | torch.Tensor,
    seq_len: int = 512,
    stride: int | None = None,
    *,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    bos_token_id: int | None = None,
) -> float:
    """exp(mean negative log-likelihood) of `text` (or a 1-D id tensor) under `model`.

    Windows of `seq_len` tokens advance by `stride` (default seq_len: disjoint windows); only the
    tokens a window adds are scored, so every token counts once. With `bos_token_id`, every window
    is fed after that token (not scored itself): models such as Gemma expect one.
    """
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise ValueError(f"need 0 < stride <= seq_len, got stride={stride}, seq_len={seq_len}")
    if isinstance(text, torch.Tensor):
        ids = text.reshape(-1).long()
    else:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens of text, got {ids.numel()}")
    if device is None:
        p = next(iter(model.parameters()), None)
        b = next(iter(model.buffers()), None)
        device = (p if p is not None else b).device
    nll, count, prev_end = 0.0, 0, 0
    starts = list(range(0, ids.numel() - 1, stride))
    for begin in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        end = min(begin + seq_len, ids.numel())
        new = end - max(prev_end, begin + 1)  # tokens this window scores (the first has no context)
        if new <= 0:
            break
        window = ids[begin:end].unsqueeze(0).to(device)
        inp = window if bos_token_id is None else F.pad(window, (1, 0), value=bos_token_id)
        logits = model(inp).logits[0, -new - 1 : -1].float()
        nll += F.cross_entropy(logits, window[0, -new:], reduction="sum").item()
        count += new
        prev_end = end
        if end == ids.numel():
            break
    ppl = math.exp(nll / count)
    log.info("perplexity %.3f over %d tokens (seq_len %d, stride %d)", ppl, count, seq_len, stride)
    return ppl


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table (for the CLI; the library logs)."""
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
    fmt = lambda r: "| " + " | ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) + " |"
    return "\n".join([line, fmt(cells[0]), line, *map(fmt, cells[1:]), line])
