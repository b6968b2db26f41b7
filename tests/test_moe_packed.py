"""The routed experts in the packed layout (WQExperts.set_layout, ops.moe_w4_packed): the layout is
exact both ways and never reaches a state dict, and every backend that reads it (torch on the
unpacked copies, Triton's grouped GEMM, the compiled moe_gemv_packed_w4 / moe_mma_packed_w4) matches
reference.moe_w4 on the AWQ tensors."""
from __future__ import annotations

import pytest
import torch

from fastawq import _ext, backend, reference
from fastawq.modules.moe import WQExperts
from fastawq.ops import moe as ops_moe
from fastawq.ops import repack

from conftest import HAS_CUDA
from test_moe_op import TRITON_OK, check, moe_case, poisoned_empty  # noqa: F401 (a fixture)

needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
HAS_GEMV = HAS_CUDA and _ext.has_op("moe_gemv_packed_w4") and _ext.has_op("moe_mma_packed_w4")
requires_gemv = pytest.mark.skipif(not HAS_GEMV, reason="needs CUDA and fastawq._C with moe_gemv_packed_w4")

# (E, H, I, G, k, T, load): I = 96 / 160 leave part tiles of the 64-column w13 tiles, H = 96 / 288 of
# the 128-column w2 tiles; H = 4096 splits w13's K (h_part), I = 4096 w2's.
CASES = [
    (4, 64, 64, 32, 2, 1, "random"),
    (8, 96, 160, 32, 2, 3, "random"),
    (8, 288, 96, 32, 1, 4, "random"),
    (16, 4096, 96, 32, 4, 1, "random"),
    (16, 4096, 96, 32, 4, 2, "random"),
    (4, 64, 4096, -1, 2, 5, "random"),
    (8, 128, 192, 64, 3, 7, "few_experts"),
    (128, 2048, 768, 128, 8, 1, "random"),  # Qwen3-30B-A3B's experts at decode
    (8, 4096, 1024, 128, 2, 1, "random"),
]
TRITON_CASES = [
    (4, 64, 64, 32, 2, 1, "random"),
    (8, 96, 160, 32, 2, 5, "random"),
    (8, 64, 96, 32, 2, 33, "one_expert"),
    (6, 128, 64, 64, 2, 5, "few_experts"),
    (8, 64, 96, -1, 3, 17, "few_experts"),
]
ids_of = lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c)  # noqa: E731


def _experts(weights, h: int, i: int, g: int) -> WQExperts:
    mod = WQExperts(weights[0].shape[0], h, i, g, dtype=weights[1].dtype, device=weights[0].device)
    with torch.no_grad():
        for buf, t in zip(("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"), weights):
            getattr(mod, buf).copy_(t)
    return mod


@pytest.mark.parametrize("g", [32, -1])
def test_set_layout_is_exact_and_state_dict_stays_awq(g):
    e, h, i = 3, 64, 96
    weights, x, ids, w = moe_case(e, h, i, g, 2, 5, seed=3)
    mod = _experts(weights, h, i, g)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.set_layout("packed")
    assert mod.layout == "packed" and "w13_wpacked" in dict(mod.named_buffers())
    assert "w13_qweight" not in dict(mod.named_buffers())
    with pytest.raises(AttributeError, match="packed layout"):
        mod.w13_qweight
    after = mod.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k].contiguous(), before[k].contiguous()) for k in before)
    # A load into the packed module lands in the packed layout, exactly.
    fresh = _experts(tuple(torch.zeros_like(t) for t in weights), h, i, g)
    fresh.set_layout("packed")
    fresh.load_state_dict(before)
    assert fresh.layout == "packed"
    for a, b in zip(fresh._layout_buffers(), mod._layout_buffers()):
        assert torch.equal(a, b)
    assert torch.equal(mod(x, ids, w), _experts(weights, h, i, g)(x, ids, w))
    mod.set_layout("awq")
    for a, b in zip(mod._layout_buffers(), weights):
        assert torch.equal(a, b)


def test_unpack_to_places_packed_experts_awq_tensors():
    from fastawq.modules.qlinear import unpack_to

    weights, *_ = moe_case(3, 64, 96, 32, 2, 1, seed=5)
    mod = _experts(tuple(t.cpu() for t in weights), 64, 96, 32)
    want = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.set_layout("packed")
    with unpack_to("meta"):  # "meta" stands in for the CPU of a model on the GPU
        sd = mod.state_dict()
    assert sd.keys() == want.keys() and all(v.device.type == "meta" and v.shape == want[k].shape for k, v in sd.items())
    sd = mod.state_dict()
    assert all(torch.equal(sd[k].contiguous(), want[k].contiguous()) for k in want)


def test_experts_layout_rule(monkeypatch):
    # Packed with the model on a GPU that has the kernels, a fused engine of any batch included;
    # FASTAWQ_MOE_LAYOUT overrides either way; never on a CPU or without the compiled kernels.
    cuda = torch.device("cuda")
    monkeypatch.delenv("FASTAWQ_MOE_LAYOUT", raising=False)
    monkeypatch.setattr(backend._ext, "has_op", lambda name: True)
    assert backend.experts_layout("packed", cuda) == "packed"
    assert backend.experts_layout("awq", cuda) == "awq"
    assert backend.experts_layout("packed", torch.device("cpu")) == "awq"
    monkeypatch.setenv("FASTAWQ_MOE_LAYOUT", "awq")
    assert backend.experts_layout("packed", cuda) == "awq"
    monkeypatch.delenv("FASTAWQ_MOE_LAYOUT")
    monkeypatch.setattr(backend._ext, "has_op", lambda name: name != "moe_gemv_packed_w4")
    assert backend.experts_layout("packed", cuda) == "awq"


def test_set_layout_on_a_model_keeps_cpu_experts_awq():
    from fastawq.modules.qlinear import set_layout

    weights, *_ = moe_case(2, 64, 64, 32, 2, 1, seed=4)
    mod = torch.nn.Sequential(_experts(tuple(t.cpu() for t in weights), 64, 64, 32))
    set_layout(mod, "packed")
    assert mod[0].layout == "awq"  # backend.experts_layout: packed experts on GPUs only
    assert backend.experts_layout("awq", torch.device("cuda")) == "awq"


@pytest.mark.parametrize("case", TRITON_CASES[:2], ids=ids_of)
def test_torch_backend_on_packed_experts(case, poisoned_empty):
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=11, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    check(ops_moe.moe_w4_packed(x, ids, w, *packed, g, backend="torch"), x, ids, w, weights, g)
    with pytest.raises(ValueError, match=r"w13_szpacked should be"):
        ops_moe.moe_w4_packed(x, ids, w, packed[0], packed[1][:, :, :-2], packed[2], packed[3], g)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", TRITON_CASES, ids=ids_of)
def test_triton_grouped_gemm_on_packed_experts(case, dtype, poisoned_empty):
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=13 * t + k, dtype=dtype, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    check(ops_moe.moe_w4_packed(x, ids, w, *packed, g, backend="triton"), x, ids, w, weights, g)


@needs_triton
def test_triton_split_k_configs_on_packed_experts(poisoned_empty):
    # Both K splits (w13's gate/up sums and w2's output added atomically), sorted blocks of 16 rows.
    from fastawq.triton_kernels import moe as tmoe

    e, h, i, g, k, t = 8, 128, 64, 32, 2, 9
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=17)
    packed = repack.awq_experts_repack(*weights, g)
    kc = tmoe.KernelConfig(32, 32, 4, 1, 2)
    cfg = tmoe.MoeConfig(16, False, kc, kc)
    from fastawq.ops._common import triton_module

    out = triton_module().moe_w4_packed(x, ids, w, *packed, g, "silu", config=cfg)
    check(out, x, ids, w, weights, g)


@requires_gemv
@pytest.mark.parametrize("h2", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=ids_of)
def test_compiled_gemv_on_packed_experts(case, dtype, h2, monkeypatch, poisoned_empty):
    monkeypatch.setenv("FASTAWQ_MOE_PACKED_H2", h2)
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=7 * t + k, dtype=dtype, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    for _ in range(2):  # the second call finds the workspace and counters the first left zeroed
        out = torch.ops.fastawq.moe_gemv_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu")
        check(out, x, ids, w, weights, g)
    if t == 1:
        sums = torch.ops.fastawq.moe_gemv_packed_w4_sums(x, ids, w.float().contiguous(), *packed, g, "silu")
        assert sums.dtype == torch.float32
        check(sums.to(dtype), x, ids, w, weights, g)


@requires_gemv
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("h", [128, 4096])  # without and with w13's K split (h_part)
def test_compiled_gemv_other_activations_and_bad_ids(act, h):
    e, i, g = 8, 96, 32
    weights, x, ids, w = moe_case(e, h, i, g, 2, 2, seed=19)
    packed = repack.awq_experts_repack(*weights, g)
    out = torch.ops.fastawq.moe_gemv_packed_w4(x, ids.to(torch.int32), w.float().contiguous(), *packed, g, act)
    check(out, x, ids, w, weights, g, act)
    # An id outside [0, E) adds nothing: as if its weight were zero.
    bad = ids.clone()
    bad[0, 1] = e + 3
    w0 = w.clone()
    w0[0, 1] = 0.0
    out = torch.ops.fastawq.moe_gemv_packed_w4(x, bad, w.float().contiguous(), *packed, g, "silu")
    check(out, x, ids, w0, weights, g)


@requires_gemv
def test_plan_dispatch_and_graph_replay_on_packed_experts():
    # The plan takes the compiled GEMV at loads up to MOE_GEMV_MAX_LOAD, moe_mma_packed_w4 where
    # backend.moe_kernel says "mma", Triton above MOE_MMA_MAX_LOAD; all replay in a CUDA graph.
    e, h, i, g, k = 16, 256, 128, 64, 4
    weights, *_ = moe_case(e, h, i, g, k, 1, seed=23)
    mod = _experts(weights, h, i, g)
    mod.set_layout("packed")
    for t in (1, 3, 64, 400):
        _, x, ids, w = moe_case(e, h, i, g, k, t, seed=29 + t)
        check(mod(x, ids, w), x, ids, w, weights, g)
        static = [x.clone(), ids.clone(), w.clone()]
        mod(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(*static)
        for seed in (1, 2):
            _, x2, ids2, w2 = moe_case(e, h, i, g, k, t, seed=seed * 101 + t)
            static[0].copy_(x2), static[1].copy_(ids2), static[2].copy_(w2)
            graph.replay()
            check(out, x2, ids2, w2, weights, g)
    _, x, ids, w = moe_case(e, h, i, g, k, 1, seed=31)
    sums = mod.sums(x, ids, w)
    assert sums is not None and sums.dtype == torch.float32
    check(sums.to(x.dtype), x, ids, w, weights, g)


@requires_gemv
def test_compiled_packed_ops_opcheck_and_errors():
    weights, x, ids, w = moe_case(8, 128, 96, 32, 2, 3, seed=37)
    packed = repack.awq_experts_repack(*weights, 32)
    args = (x, ids, w.float().contiguous(), *packed, 32, "silu")
    torch.library.opcheck(torch.ops.fastawq.moe_gemv_packed_w4.default, args)
    torch.library.opcheck(torch.ops.fastawq.moe_gemv_packed_w4_sums.default,
                          (x[:1].contiguous(), ids[:1].contiguous(), w[:1].float().contiguous(), *args[3:]))
    with pytest.raises(RuntimeError, match=r"moe_gemv_packed_w4: inconsistent.*w13_wpacked"):
        torch.ops.fastawq.moe_gemv_packed_w4(x, ids, w.float(), packed[0][:, :, :-8].contiguous(), *packed[1:], 32,
                                             "silu")
    wide = torch.empty(3, 136, dtype=x.dtype, device=x.device)[:, 1:129]
    with pytest.raises(RuntimeError, match=r"16-byte aligned"):
        torch.ops.fastawq.moe_gemv_packed_w4(wide, ids, w.float().contiguous(), *packed, 32, "silu")
