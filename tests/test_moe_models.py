"""Mixture-of-experts families on tiny random configs (CPU, float32): unfusing, exact scale folding,
quantize -> save -> load -> generate, cold experts, checkpoint names."""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn
import transformers
from safetensors import safe_open

from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.models import MOE_SPECS, architecture_of
from fastawq.models.moe import ExpertList, experts_of, moe_spec_of, unfuse_model
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig, pack_model, pseudo_quantize_model, quantize
from fastawq.quantize.moe import MoELayerSearch
from fastawq.quantize.scale import apply_scale

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)
# MLA expands kv_b_proj to every head, so num_key_value_heads = num_attention_heads as in the real
# configs (fewer breaks transformers' eager attention on the head count).
_DS2 = dict(_COMMON, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, intermediate_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    # First layer dense, then MLA + sigmoid group-limited routing + a shared expert.
    "deepseek_v3": ("DeepseekV3Config", dict(_COMMON, intermediate_size=64, moe_intermediate_size=32,
                                             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                             n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                                             kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V2-Lite's form: no q latent (a plain q_proj), greedy softmax top-k, two shared experts.
    "deepseek_v2": ("DeepseekV2Config", dict(_DS2, n_shared_experts=2, q_lora_rank=None)),
    # DeepSeek-V2's form: a q latent, scaled routing weights and group-limited softmax top-k (both picks
    # from the one best of two groups, so most tokens route otherwise than greedy top-k would).
    "deepseek_v2_q_lora": ("DeepseekV2Config", dict(_DS2, n_shared_experts=1, q_lora_rank=32, n_group=2, topk_group=1,
                                                    topk_method="group_limited_greedy", routed_scaling_factor=2.0)),
    # Dense layer 0, MoE layer 1 (interleaved), top-1 sigmoid routing, a shared expert.
    "llama4_text": ("Llama4TextConfig", dict(_COMMON, head_dim=16, intermediate_size=32, intermediate_size_mlp=64,
                                             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)),
}
ARCHS = list(CONFIGS)


def tiny_moe(arch: str, seed: int = 0, configs: dict | None = None) -> torch.nn.Module:
    """A float32 model of CONFIGS[arch] (or configs[arch]) with random norms, experts and routers."""
    cls_name, kwargs = (configs or CONFIGS)[arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms start at 1: perturb them so folding a scale is tested
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 3 or name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.2)  # transformers leaves fused experts and routers near zero
    return model


def ids_(n: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def unfuse_all(model) -> None:
    assert unfuse_model(model, architecture_of(model).layers_path, moe_spec_of(model)) > 0


def test_moe_families_registered():
    # llama4: the vision-language wrapper around llama4_text (models/multimodal.py).
    assert set(MOE_SPECS) == {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "llama4_text", "llama4"}


@pytest.mark.parametrize("arch", ARCHS)
def test_unfused_experts_compute_the_fused_block(arch):
    """The per-expert form (nn.Linear per expert) computes what transformers' fused 3-D form does."""
    model = tiny_moe(arch)
    ids = ids_(2, 12, 3)
    with torch.no_grad():
        ref = model(ids).logits
        unfuse_all(model)
        out = model(ids).logits
    assert any(isinstance(m, ExpertList) for m in model.modules())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_scale_folding_is_exact(arch):
    """Any positive scales folded into every group, the shared MoE input (router included) and
    every expert's up -> down leave the float model's function unchanged."""
    model = tiny_moe(arch)
    ids = ids_(2, 12, 4)
    gen = torch.Generator().manual_seed(5)
    spec, a = moe_spec_of(model), architecture_of(model)
    with torch.no_grad():
        ref = model(ids).logits
        for i, layer in enumerate(model.get_submodule(a.layers_path)):
            for g in a.groups(layer, model.config):
                k = layer.get_submodule(g.linears[0]).in_features
                apply_scale(layer, g, torch.rand(k, generator=gen) * 1.5 + 0.25)
            if spec.block_of(layer) is None:
                continue
            mx = MoELayerSearch(None, layer, f"{a.layers_path}.{i}", spec)
            e, i_dim = mx.num_experts, mx.expert(0).linears()[0].out_features
            mx.fold_input_scale(torch.rand(model.config.hidden_size, generator=gen) * 1.5 + 0.25)
            mx.fold_down_scales(torch.rand(e, i_dim, generator=gen) * 1.5 + 0.25)
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _quantize_pseudo_pack(model, qc, n_calib=4):
    quantize(model, None, qc, calib=ids_(n_calib, 32, 1), max_calib_samples=n_calib, max_calib_seq_len=32,
             export_compatible=True)
    pseudo = pseudo_quantize_model(copy.deepcopy(model), qc)
    pack_model(model, qc)
    return pseudo


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_quantize_save_load_generate(arch, tmp_path):
    """quantize -> save -> load -> generate: the loaded packed model computes what the
    pseudo-quantized float model computes; per-expert checkpoint names; routers stay float."""
    model = tiny_moe(arch)
    ids = ids_(2, 12, 7)
    with torch.no_grad():
        fp = model(ids).logits
    qc = QuantConfig(w_bit=4, q_group_size=32)
    pseudo = _quantize_pseudo_pack(model, qc)
    with torch.no_grad():
        packed = model(ids).logits
    AWQModel(model, qc).save_quantized(tmp_path / "q")

    spec = moe_spec_of(model)
    ck_block = spec.checkpoint_block or spec.block
    moe_layer = next(i for i, layer in enumerate(model.model.layers) if spec.block_of(layer) is not None)
    gate, up, down = spec.proj_names
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    p = f"model.layers.{moe_layer}.{ck_block}"
    for n in (gate, up, down):
        assert f"{p}.experts.0.{n}.qweight" in keys and f"{p}.experts.0.{n}.scales" in keys
    assert not any(".gate_up_proj" in k for k in keys)
    assert f"{p}.{spec.router}.weight" in keys and f"{p}.{spec.router}.qweight" not in keys
    skipped = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert f"{p}.{spec.router}" in skipped
    assert not any(s.endswith(("gate_proj", "up_proj", "down_proj")) for s in skipped)

    loaded = AutoAWQForCausalLM.from_quantized(tmp_path / "q", device_map="cpu")
    packed_experts = [m for n, m in loaded.named_modules() if ".experts." in n and isinstance(m, WQLinear)]
    assert packed_experts or any(type(m).__name__ == "WQExperts" for m in loaded.modules())
    with torch.no_grad():
        ref = pseudo(ids).logits
        out = loaded(ids).logits
    assert torch.isfinite(out).all()
    quant_err = (ref - fp).abs().max().item()

    def share_close(a, b, tol):
        # Rounding differences can tip a router's near-tie to another expert: a discrete jump at a
        # few positions. Every other position must agree to far better than quantization moved it.
        return ((a - b).abs().amax(-1) <= tol * quant_err + 1e-5).float().mean().item()

    # The checkpoint round trip is exact up to the kernel that serves the loaded experts (the
    # per-expert loop, or WQExperts' grouped kernel with its own rounding order).
    assert share_close(out, packed, 0.05) >= 0.75
    # Packed scales are fp16: the loaded model differs from the fp32 pseudo-quantized one by that
    # rounding only.
    assert share_close(out, ref, 0.2) >= 0.75
    gen = loaded.generate(ids[:1, :6], max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 9)


def test_fused_and_per_expert_forms_quantize_alike():
    """A model whose experts are already per-expert linears quantizes to the same model as the
    fused 3-D form."""
    fused = tiny_moe("mixtral", seed=2)
    per_expert = copy.deepcopy(fused)
    unfuse_all(per_expert)
    _assert_quantize_alike(fused, per_expert)


def _assert_quantize_alike(model_a, model_b) -> None:
    """Both forms, AWQ-quantized on the same calibration, give bit-identical pseudo-quantized logits."""
    a = _quantize_pseudo_pack(model_a, QuantConfig(w_bit=4, q_group_size=32))
    b = _quantize_pseudo_pack(model_b, QuantConfig(w_bit=4, q_group_size=32))
    ids = ids_(1, 10, 8)
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)


def test_module_list_of_expert_mlps_quantizes_like_the_fused_form():
    """transformers 4.x (and remote code) keep experts as an nn.ModuleList of MLPs with their own
    gate/up/down linears: that form quantizes to the same model as transformers 5.x's fused one."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    fused = tiny_moe("qwen3_moe", seed=7)
    listed = copy.deepcopy(fused)
    cfg = listed.config
    with torch.no_grad():
        for layer in listed.model.layers:
            f = layer.mlp.experts
            mlps = nn.ModuleList(Qwen3MoeMLP(cfg, intermediate_size=cfg.moe_intermediate_size) for _ in range(f.num_experts))
            i = cfg.moe_intermediate_size
            for e, m in enumerate(mlps):
                m.gate_proj.weight.copy_(f.gate_up_proj[e, :i])
                m.up_proj.weight.copy_(f.gate_up_proj[e, i:])
                m.down_proj.weight.copy_(f.down_proj[e])
            layer.mlp.experts = mlps
    _assert_quantize_alike(fused, listed)


def test_expert_without_calibration_tokens_is_quantized(caplog):
    """An expert the router never picks (DeepSeek's score-correction bias pushes it out) is still
    searched from every calibration token run through it, packed, and counted in the log."""
    model = tiny_moe("deepseek_v3", seed=3)
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias[5] = -100.0
    fp_w = model.model.layers[1].mlp.experts.gate_up_proj[5].clone()
    qc = QuantConfig(w_bit=4, q_group_size=32)
    with caplog.at_level(logging.INFO, logger="fastawq.quantize.moe"):
        quantize(model, None, qc, calib=ids_(4, 32, 1), max_calib_samples=4, max_calib_seq_len=32,
                 export_compatible=True)
    msgs = [r.getMessage() for r in caplog.records if "calibration tokens" in r.getMessage()]
    assert len(msgs) == 1 and "(1 got none)" in msgs[0] and "model.layers.1" in msgs[0], msgs
    ex = experts_of(model.model.layers[1], moe_spec_of(model))
    # gate rows take only the shared input scale (up rows also take the down scale).
    w, fp_w = ex[5].gate_proj.weight, fp_w[: ex[5].gate_proj.out_features]
    # Undoing the input scale leaves at most the clipping of a few outliers.
    s = (w / fp_w).median(dim=0).values
    assert torch.isfinite(w).all() and ((w / s - fp_w).abs().mean() < 0.1 * fp_w.abs().mean())
    pack_model(model, qc)
    assert isinstance(ex[5].gate_proj, WQLinear) and isinstance(ex[5].down_proj, WQLinear)


def test_round_to_nearest_reaches_fused_experts():
    """pseudo_quantize_model / pack_model on a model fresh from transformers (fused experts)
    quantize the experts too instead of leaving them in full precision."""
    model = tiny_moe("qwen3_moe")
    pseudo_quantize_model(model, QuantConfig(w_bit=4, q_group_size=32))
    ex = experts_of(model.model.layers[0], moe_spec_of(model))
    w = ex[3].up_proj.weight.view(-1, 32)
    # 4-bit asymmetric rounding leaves at most 16 distinct values per group.
    assert max(len(torch.unique(row)) for row in w) <= 16


@pytest.mark.parametrize("quantized", [True, False])
def test_random_moe_shape_builds_packed_experts(monkeypatch, quantized):
    """`fastawq bench --shape qwen3-30b-a3b` builds this, scaled down: packed per-expert W4 (or
    fused fp16) experts and initialised routers, finite logits."""
    from fastawq import shapes

    cls_name, kw, g = shapes.SHAPES["qwen3-30b-a3b"]
    small = dict(kw, vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8)
    monkeypatch.setitem(shapes.SHAPES, "moe-small", (cls_name, small, 64))
    model = shapes.build_random_model("moe-small", quantized=quantized, dtype=torch.float32)
    ex = model.model.layers[1].mlp.experts
    if quantized:
        assert type(ex).__name__ == "WQExperts" or isinstance(ex[7].down_proj, WQLinear)
    else:
        assert ex.gate_up_proj.std() > 0
    assert model.model.layers[1].mlp.gate.weight.std() > 0
    with torch.inference_mode():
        logits = model(torch.randint(0, 256, (1, 10))).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_moe_awq_beats_round_to_nearest_on_outlier_channels():
    """A few input channels 20x larger than the rest: the searched MoE model (shared expert input
    scale, per-expert down scales, clipping) is closer to full precision than round-to-nearest."""
    model = tiny_moe("qwen2_moe", seed=5)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :4] *= 20.0
    ids = ids_(4, 32, 9)
    with torch.no_grad():
        fp = model(ids).logits
    qc = QuantConfig(q_group_size=32)
    rtn = pseudo_quantize_model(copy.deepcopy(model), qc)
    quantize(model, None, qc, calib=ids_(8, 32, 2), max_calib_samples=8, max_calib_seq_len=32)
    with torch.no_grad():
        e_rtn = (rtn(ids).logits - fp).pow(2).mean()
        e_awq = (model(ids).logits - fp).pow(2).mean()
    assert e_awq < e_rtn, (e_awq, e_rtn)


def test_few_calibration_tokens_leave_every_expert_cold(caplog, monkeypatch):
    """E=8, top-1 and 8 calibration tokens: no expert reaches the threshold, several see none;
    all are quantized from dense statistics and the model stays close to full precision."""
    cls_name, kw = CONFIGS["qwen3_moe"]
    monkeypatch.setitem(CONFIGS, "qwen3_moe_top1", (cls_name, dict(kw, num_experts_per_tok=1)))
    model = tiny_moe("qwen3_moe_top1", seed=4)
    ids = ids_(2, 12, 5)
    with torch.no_grad():
        fp = model(ids).logits
    qc = QuantConfig(w_bit=4, q_group_size=32)
    rtn = pseudo_quantize_model(copy.deepcopy(model), qc)
    with caplog.at_level(logging.INFO, logger="fastawq.quantize.moe"):
        quantize(model, None, qc, calib=ids_(1, 8, 6), max_calib_samples=1, max_calib_seq_len=8)
    msgs = [r.getMessage() for r in caplog.records if "calibration tokens" in r.getMessage()]
    assert len(msgs) == 2 and all("8 of 8 experts" in m for m in msgs), msgs
    assert sum(int(m.split("(")[1].split()[0]) for m in msgs) >= 2  # experts that saw no token at all
    assert all(isinstance(ex.up_proj, WQLinear) for ex in experts_of(model.model.layers[0], moe_spec_of(model)))
    with torch.no_grad():
        out = model(ids).logits
        e_rtn = (rtn(ids).logits - fp).pow(2).mean()
    # Eight tokens are too few for AWQ to gain anything, and top-1 routing flips dominate this
    # error; the bound only catches a broken cold path (degenerate scales blow far past it).
    assert torch.isfinite(out).all() and (out - fp).pow(2).mean() < 3 * e_rtn, ((out - fp).pow(2).mean(), e_rtn)


def test_batched_expert_packing_equals_per_linear_packing():
    """quantize() packs all experts of a layer in one pass; pack_model after export_compatible
    packs them one WQLinear.from_linear at a time: the same words, scales and zeros."""
    a = tiny_moe("mixtral", seed=6)
    b = copy.deepcopy(a)
    quantize(a, None, QuantConfig(w_bit=4, q_group_size=32), calib=ids_(2, 16, 1), max_calib_samples=2,
             max_calib_seq_len=16)
    qc = QuantConfig(w_bit=4, q_group_size=32)
    quantize(b, None, qc, calib=ids_(2, 16, 1), max_calib_samples=2, max_calib_seq_len=16, export_compatible=True)
    pack_model(b, qc)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(".experts.3.w2.qweight" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_fp32_router_keeps_its_precision_through_a_half_precision_search():
    """DeepSeek keeps its router weight and score-correction bias in fp32: after quantizing an
    fp16/bf16 model they are still fp32, and the weight is the original times the folded scale."""
    model = tiny_moe("deepseek_v3", seed=8).to(torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight.data = router.weight.data.float()
        router.e_score_correction_bias.data = torch.randn(8) * 1e-3
        norm_before = model.model.layers[1].post_attention_layernorm.weight.float().clone()
    w0, b0 = router.weight.detach().clone(), router.e_score_correction_bias.detach().clone()
    quantize(model, None, QuantConfig(w_bit=4, q_group_size=32), calib=ids_(2, 16, 1), max_calib_samples=2,
             max_calib_seq_len=16)
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, b0)
    s = norm_before / model.model.layers[1].post_attention_layernorm.weight.float()  # the folded scale
    torch.testing.assert_close(router.weight, w0 * s, rtol=2e-2, atol=0)  # s itself read back through bf16
