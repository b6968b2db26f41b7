"""Perplexity: each token scored exactly once, whatever the stride."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastawq.eval import format_table, perplexity
from test_models import calib_ids, tiny_model


def _manual(model, ids):
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0, :-1]
    return math.exp(F.cross_entropy(logits, ids[1:]).item())


def test_single_window_matches_cross_entropy():
    model = tiny_model("llama")
    ids = calib_ids(1, 40)[0]
    assert abs(perplexity(model, None, ids, seq_len=64, progress=False) - _manual(model, ids)) < 1e-3


def test_strided_windows_score_every_token_once():
    model = tiny_model("llama")
    ids = calib_ids(1, 100)[0]
    # Full context for every token when the window covers everything: same as one pass.
    a = perplexity(model, None, ids, seq_len=128, stride=16, progress=False)
    assert abs(a - _manual(model, ids)) < 1e-3
    b = perplexity(model, None, ids, seq_len=32, stride=8, progress=False)
    c = perplexity(model, None, ids, seq_len=32, progress=False)
    assert b > 1 and c > 1 and math.isfinite(b) and math.isfinite(c)


def test_table():
    t = format_table(["a", "b"], [["x", 1.5]])
    assert "1.500" in t and t.count("\n") == 4
