"""The MoE search's per-expert input Grams built a chunk of experts at a time (quantize/moe.py):
the same Grams as the one-pass hooks, and the same quantized model, on tiny CPU configs."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from fastawq.models.moe import moe_spec_of
from fastawq.quantize import AwqQuantizer, QuantConfig, quantize
from fastawq.quantize.moe import GRAM_BUDGET_ENV, MoELayerSearch

from test_moe_models import ids_, tiny_moe

# The first MoE layer of each tiny config; llama4_text's experts take dense pre-scaled rows.
MOE_LAYER = {"qwen3_moe": 0, "mixtral": 0, "deepseek_v2_q_lora": 1, "deepseek_v3": 1, "llama4_text": 1}


@pytest.mark.parametrize("arch", list(MOE_LAYER))
def test_rebuilt_input_grams_equal_the_hooks(arch):
    """Grams rebuilt from the recorded calls (rows gathered by the routing, chunk by chunk) are
    bit-identical to those the per-expert hooks accumulate, over several calls of unequal size."""
    model = tiny_moe(arch, seed=11)
    spec = moe_spec_of(model)
    layer = model.model.layers[MOE_LAYER[arch]]
    one_pass = MoELayerSearch(None, layer, "layer", spec)
    rebuilt = MoELayerSearch(None, layer, "layer", spec)
    rebuilt.gram_chunk = 3
    handles = one_pass.hooks(layer) + rebuilt.hooks(layer)
    gen = torch.Generator().manual_seed(12)
    block = spec.block_of(layer)
    try:
        with torch.no_grad():
            for t in (37, 64, 5):
                block(torch.randn(1, t, model.config.hidden_size, generator=gen))
    finally:
        for h in handles:
            h.remove()
    ref = one_pass.st["gram_in"]
    e_all = ref.shape[0]
    assert len(rebuilt.calls) == 3 and "gram_in" not in rebuilt.st
    assert torch.equal(rebuilt.st["n_in"], one_pass.st["n_in"]) and (one_pass.st["n_in"] > 0).sum() >= 2
    got = torch.cat([rebuilt._gram_in_of(e0, min(e_all, e0 + 3), ref.device) for e0 in range(0, e_all, 3)])
    assert got.abs().sum() > 0
    assert torch.equal(got, ref)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "llama4_text"])
def test_chunked_grams_quantize_to_the_same_model(arch, device, monkeypatch, caplog):
    """A Gram budget of 3 experts forces the chunked path (chunks of 3 experts, the last one
    short): the quantized weights equal those of the one-pass search bit for bit."""
    model = tiny_moe(arch, seed=13)
    chunked = copy.deepcopy(model)
    h = model.config.hidden_size
    # One (expert, candidate) loss batch per expert, so 3 experts are a whole number of batches.
    fused = moe_spec_of(model).block_of(model.model.layers[MOE_LAYER[arch]]).experts
    i_dim = fused.down_proj.shape[-1 if arch != "llama4_text" else 1]
    for budget in ("cpu_batch_elems", "gpu_batch_elems"):
        monkeypatch.setattr(AwqQuantizer, budget, 2 * i_dim * h * (AwqQuantizer.n_grid + 1))
    monkeypatch.delenv(GRAM_BUDGET_ENV, raising=False)

    def run(m):
        quantize(m, None, QuantConfig(w_bit=4, q_group_size=32), calib=ids_(4, 32, 1), max_calib_samples=4,
                 max_calib_seq_len=32, export_compatible=True, device=device)

    run(model)
    monkeypatch.setattr(MoELayerSearch, "gram_budget", 3 * h * h * 4)
    calls = []
    orig = MoELayerSearch._gram_in_of
    monkeypatch.setattr(MoELayerSearch, "_gram_in_of", lambda self, e0, e1, d: calls.append((e0, e1)) or orig(self, e0, e1, d))
    with caplog.at_level(logging.INFO, logger="fastawq.quantize.moe"):
        run(chunked)
    e_all = fused.down_proj.shape[0]
    assert calls[: (e_all + 2) // 3] == [(e0, min(e_all, e0 + 3)) for e0 in range(0, e_all, 3)], calls
    assert any("3 experts at a time" in r.getMessage() for r in caplog.records)
    sa, sb = model.state_dict(), chunked.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_gram_budget_env_overrides_the_default(monkeypatch):
    """FASTAWQ_MOE_GRAM_BUDGET_GB picks the chunk: here one expert's Gram at a time."""
    model = tiny_moe("qwen3_moe", seed=14)
    h = model.config.hidden_size
    q = AwqQuantizer(model, QuantConfig(w_bit=4, q_group_size=32), ids_(1, 8, 1), device="cpu")
    monkeypatch.setattr(AwqQuantizer, "cpu_batch_elems", 1)
    monkeypatch.setenv(GRAM_BUDGET_ENV, str(1.5 * h * h * 4 / 2**30))
    mx = MoELayerSearch(q, model.model.layers[0], "model.layers.0", moe_spec_of(model))
    assert mx.gram_chunk == 1
    monkeypatch.setenv(GRAM_BUDGET_ENV, "1")
    assert MoELayerSearch(q, model.model.layers[1], "model.layers.1", moe_spec_of(model)).gram_chunk is None
