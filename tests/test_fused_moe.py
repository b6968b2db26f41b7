"""The fused engine on mixture-of-experts models (qwen3_moe, qwen2_moe, mixtral): prefill and
decode logits equal the unfused W4 model's (same packed weights), with the experts given either
as WQExperts or as per-expert WQLinear; CUDA-graph decode on a GPU. Families the engine does not
serve are refused with their record's reason."""
import copy
import os
import re

import pytest
import torch
import transformers

from fastawq.generate import HFStepper
from fastawq.models import architecture_of
from fastawq.models.moe import moe_spec_of, router_names, unfuse_model, use_fast_experts
from fastawq.modules.fused import FusedMLP, FusedMoE, fuse_model
from fastawq.modules.qlinear import set_layout
from fastawq.quantize import QuantConfig, pack_model

from conftest import spy_fp32_first_argument
from test_moe_models import tiny_moe

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

VOCAB = 160
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)
CONFIGS = {
    # Layer 1 keeps a dense MLP (mlp_only_layers): dense and MoE layers in one fused model.
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    # A shared expert behind a sigmoid gate; top-k weights not renormalised.
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, intermediate_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
}
FUSED = list(CONFIGS)


def tiny_w4_moe(arch: str, experts: str = "grouped", seed: int = 0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model of `arch` with RTN-packed W4 (g32) decoder linears and experts, served by
    WQExperts ("grouped") or by per-expert WQLinear ("list")."""
    model = tiny_moe(arch, seed, CONFIGS)
    arch_rec, spec = architecture_of(model), moe_spec_of(model)
    unfuse_model(model, arch_rec.layers_path, spec)
    keep = router_names(model, arch_rec.layers_path, spec)  # routers and shared-expert gates
    pack_model(model, QuantConfig(w_bit=4, q_group_size=32, modules_to_not_convert=keep))
    if experts == "grouped":
        assert use_fast_experts(model, arch_rec.layers_path, moe_spec_of(model)) > 0
    return model.to(device=device, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _match_over_decode(arch: str, experts: str, backend: str | None, steps: int, device: str = "cpu",
                       dtype: torch.dtype = torch.float32, graphs: bool = False, tol: float = 1e-4,
                       batch: int = 2, layout: str | None = None) -> None:
    ref = tiny_w4_moe(arch, experts, device=device, dtype=dtype)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=64, batch_size=batch, backend=backend, use_cuda_graphs=graphs)
    if layout is not None:
        set_layout(fused, layout)  # after fusing, which concatenates AWQ tensors
    layers = fused.fastawq_runtime.layers
    assert any(isinstance(f.mlp, FusedMoE) for f in layers)
    if arch == "qwen3_moe":
        assert isinstance(layers[1].mlp, FusedMLP) and isinstance(layers[0].mlp, FusedMoE)
    ids = torch.randint(0, VOCAB, (batch, 11), generator=torch.Generator().manual_seed(1)).to(device)
    rt = fused.fastawq_runtime
    hf = HFStepper(ref)
    lf, lr = rt.prefill(ids)[:, -1], hf.prefill(ids)
    assert _rel(lf, lr) < tol, _rel(lf, lr)
    for _ in range(steps):
        tok = lr.argmax(-1)  # teacher-force both on the reference's choice
        lf, lr = rt.decode(tok), hf.decode(tok)
        assert torch.isfinite(lf).all()
        assert _rel(lf, lr) < tol, _rel(lf, lr)
    assert rt.length == 11 + steps


@pytest.mark.parametrize("experts", ["grouped", "list"])
@pytest.mark.parametrize("arch", FUSED)
def test_fused_moe_matches_unfused_cpu(arch, experts):
    # fp32 on the CPU: the same packed weights, fp32 math on both sides, so only summation orders
    # differ (a wrong router, shared-expert gate or cache slot is an O(1) error). One exception:
    # without fastawq._C, an unfused per-expert WQLinear runs torch's int4 CPU kernel, which
    # computes in bf16, while the fused engine stacks the experts into WQExperts (fp32 reference
    # math): then the experts differ by bf16 rounding (~7e-3 seen).
    from fastawq import cpu

    bf16_experts = experts == "list" and cpu.fast_kernel_available() is not None
    _match_over_decode(arch, experts, None, 6, tol=3e-2 if bf16_experts else 1e-4)


@pytest.mark.parametrize("arch", FUSED)
def test_fused_moe_full_logits_forward(arch):
    ref = tiny_w4_moe(arch, seed=3)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, prefill_chunk=5)
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert _rel(fused(ids).logits, ref(ids).logits) < 1e-4


def test_fused_moe_generate_equals_unfused():
    ref = tiny_w4_moe("qwen2_moe", seed=4)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    want = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    got = fused.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got.cpu(), want.cpu())


def test_fusing_needs_packed_experts():
    cls_name, kwargs = CONFIGS["mixtral"]
    float_model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs))
    model = tiny_w4_moe("mixtral")
    # Float experts (3-D parameters) in an otherwise packed model.
    model.model.layers[0].mlp.experts = float_model.model.layers[0].mlp.experts
    with pytest.raises(TypeError, match=re.escape("model.layers.0.mlp.experts is MixtralExperts")):
        fuse_model(model, 16, 1)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "llama4_text"])
def test_unfused_moe_families_are_refused_with_the_reason(arch):
    model = tiny_moe(arch)
    spec = architecture_of(model)
    assert spec.fused_blocker
    with pytest.raises(NotImplementedError, match=re.escape(spec.fused_blocker)):
        fuse_model(model, 16, 1)


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_fused_moe_triton_kernels():
    # Every Triton kernel of an MoE layer (router top-k, grouped W4 experts, norms, rope, attention).
    _match_over_decode("qwen2_moe", "grouped", "triton", 8 if CUDA else 2, device="cuda" if CUDA else "cpu",
                       dtype=torch.float16, tol=1e-2)


@needs_cuda
@pytest.mark.parametrize("experts", ["grouped", "list"])
@pytest.mark.parametrize("arch", FUSED)
def test_fused_moe_cuda_graph_decode_matches_unfused(arch, experts):
    # fp16 on the GPU: the fused engine's fp32 norms and rope round differently from
    # transformers' fp16 ones (the dense tests see ~2.5e-3).
    _match_over_decode(arch, experts, None, 24, device="cuda", dtype=torch.float16, graphs=True, tol=1e-2)


@needs_cuda
@pytest.mark.parametrize("arch", FUSED)
def test_fused_moe_sums_handed_to_the_next_norm(monkeypatch, arch):
    # FASTAWQ_MOE_SUMS=1 (read at each call): at one token an MoE block without a shared expert ends
    # with the experts' fp32 sums (moe_gemv_w4_sums), which the next add_rms_norm rounds as it reads
    # them: decode with CUDA graphs still matches transformers, and the sums path ran (Qwen2-MoE's
    # shared expert keeps the usual one).
    from fastawq.ops import moe as ops_moe

    monkeypatch.setenv("FASTAWQ_MOE_SUMS", "1")
    calls = []
    real = ops_moe.moe_w4_sums

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.dtype)
        return out

    monkeypatch.setattr(ops_moe, "moe_w4_sums", spy)
    _match_over_decode(arch, "grouped", None, 12, device="cuda", dtype=torch.float16, graphs=True, tol=1e-2, batch=1)
    if arch == "qwen2_moe":
        assert not calls
    else:
        assert calls and set(calls) == {torch.float32}


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_moe_o_proj_sums_into_the_router(monkeypatch, arch):
    # FASTAWQ_MOE_O_SUMS=1 (read at each call): an MoE layer's o_proj adds into fp32 sums that the
    # input norm zeroes and the compiled router's norm reads (moe_route on fp32 x); decode with CUDA
    # graphs still matches transformers. The tiny configs' 8 experts take the compiled router only
    # once ROUTE_CUDA_EXPERTS admits them (the automatic choice, measured, starts at 16); its
    # cluster form, which alone reads fp32 x, needs sm_90.
    from fastawq import _ext
    from fastawq import backend as backend_mod

    monkeypatch.setenv("FASTAWQ_MOE_O_SUMS", "1")
    monkeypatch.setattr(backend_mod, "ROUTE_CUDA_EXPERTS", (1, 1 << 30))
    f32 = spy_fp32_first_argument(monkeypatch, "moe_route")
    _match_over_decode(arch, "grouped", None, 12, device="cuda", dtype=torch.float16, graphs=True, tol=1e-2, batch=1,
                       layout="packed")
    if _ext.has_op("awq_gemv_packed_sums") and backend_mod.is_sm90(torch.device("cuda")):
        assert any(f32)


@needs_cuda
def test_fused_moe_graph_replays_follow_the_routing():
    """A captured decode step routes each replay's tokens afresh (no routing baked into the graph):
    two batches with different tokens give the eager step's logits."""
    ref = tiny_w4_moe("qwen3_moe", device="cuda", dtype=torch.float16)
    graphs = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=2, use_cuda_graphs=True)
    eager = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=2, use_cuda_graphs=False)
    ids = torch.randint(0, VOCAB, (2, 5), device="cuda")
    for rt in (graphs.fastawq_runtime, eager.fastawq_runtime):
        rt.prefill(ids)
    for step in range(6):
        tok = torch.randint(0, VOCAB, (2,), device="cuda")
        a, b = graphs.fastawq_runtime.decode(tok), eager.fastawq_runtime.decode(tok)
        assert _rel(a, b) < 1e-3, (step, _rel(a, b))
