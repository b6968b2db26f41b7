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


def test_bos_token_is_context_not_scored():
    """With bos_token_id every disjoint window is fed after that token, which is never scored: one
    pass over [bos] + window per window, scoring the window's tokens after its first."""
    model = tiny_model("llama")
    ids = calib_ids(1, 64)[0]
    got = perplexity(model, None, ids, seq_len=32, progress=False, bos_token_id=1)
    nll = 0.0
    for w in ids.split(32):
        with torch.no_grad():
            logits = model(torch.cat([torch.tensor([1]), w]).unsqueeze(0)).logits[0, 1:-1]
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
    want = math.exp(nll / (ids.numel() - 2))
    assert abs(got - want) < 1e-4 * want
    assert abs(got - perplexity(model, None, ids, seq_len=32, progress=False)) > 1e-6 * want  # the bos is seen
