"""The W4 MoE op against reference.moe_w4: both backends, ragged expert loads, tile edges."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from fastawq import _ext, reference
from fastawq.ops import moe as ops_moe
from fastawq.backend import BackendUnavailableError

from conftest import HAS_CUDA, random_awq, random_input, requires_cuda

DEVICE = "cuda" if HAS_CUDA else "cpu"
TRITON_OK = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
COMPILED_OK = HAS_CUDA and _ext.has_op("moe_gemv_w4")
needs_compiled = pytest.mark.skipif(not COMPILED_OK, reason="the compiled MoE kernel needs CUDA and fastawq._C")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton), pytest.param("cuda", marks=needs_compiled)]


def random_moe(e: int, h: int, i: int, g: int, dtype=torch.float16, device=DEVICE, seed: int = 0):
    """Stacked random experts: (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros)."""
    w13 = [random_awq(h, 2 * i, g, device, dtype, seed=seed + j) for j in range(e)]
    w2 = [random_awq(i, h, g, device, dtype, seed=seed + 1000 + j) for j in range(e)]
    return tuple(torch.stack([w[p] for w in ws]) for ws in (w13, w2) for p in range(3))


def routing(kind: str, t: int, e: int, k: int, device=DEVICE, seed: int = 0):
    """topk_ids [T, k], topk_weights [T, k] fp32 for a load pattern."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        weights, ids = reference.topk_route(torch.randn(t, e, generator=gen), k)
    else:
        if kind == "one_expert":  # every token's first choice is expert 0, the rest share expert 1..k-1
            ids = torch.arange(k).repeat(t, 1)
        elif kind == "few_experts":  # only experts 1 and e-1 get tokens (twice per token when k > 2)
            ids = torch.tensor([1, e - 1] * k)[:k].repeat(t, 1)
            ids[::2] = ids[::2].flip(1)
        else:
            raise ValueError(kind)
        weights = torch.rand(t, k, generator=gen).softmax(dim=-1)
    return ids.to(device), weights.to(device)


def moe_case(e: int, h: int, i: int, g: int, k: int, t: int, seed: int, dtype=torch.float16, load: str = "random"):
    """Random stacked experts, input x [T, H] and a routing: (weights, x, topk_ids, topk_weights)."""
    weights = random_moe(e, h, i, g, dtype, seed=seed)
    x = random_input((t, h), DEVICE, dtype, seed=seed + 1)
    ids, w = routing(load, t, e, k, seed=seed + 2)
    return weights, x, ids, w


def torch_same_dtype_error(x, ids, w, weights, g, act) -> float:
    ref = reference.moe_w4(x, ids, w, *weights, g, act).float()
    return (reference.moe_w4(x, ids, w, *weights, g, act, dtype=x.dtype).float() - ref).abs().max().item()


def check(out, x, ids, w, weights, g, act="silu", factor=4.0):
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "output has NaN/inf (a row or buffer left unwritten?)"
    ref = reference.moe_w4(x, ids, w, *weights, g, act).float()
    err = (out.float() - ref).abs().max().item()
    eps = 2**-10 if x.dtype == torch.float16 else 2**-7
    budget = factor * torch_same_dtype_error(x, ids, w, weights, g, act) + eps * ref.abs().max().item()
    assert err <= budget, f"max error {err:.4g} > budget {budget:.4g} (ref max {ref.abs().max().item():.4g})"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN floats and out-of-range ints, so an unwritten element shows."""
    real = torch.empty

    def empty(*size, **kw):
        t = real(*size, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-(2**30))
        return t

    monkeypatch.setattr(torch, "empty", empty)


# (E, H, I, G, k, T, load): H and I straddle the 32..128 column tiles (I = 96 leaves a part tile).
CASES = [
    (4, 64, 64, 32, 2, 1, "random"),
    (8, 128, 96, 32, 2, 5, "random"),
    (8, 128, 96, 32, 2, 33, "random"),
    (8, 64, 96, 32, 2, 33, "one_expert"),
    (6, 128, 64, 64, 2, 5, "few_experts"),
    (8, 64, 96, -1, 3, 17, "few_experts"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_moe_matches_reference(case, backend, poisoned_empty):
    e, h, i, g, k, t, load = case
    weights = random_moe(e, h, i, g, seed=t)
    x = random_input((t, h), DEVICE, torch.float16, seed=t + 1)
    ids, w = routing(load, t, e, k, seed=t)
    out = ops_moe.moe_w4(x, ids, w, *weights, g, backend=backend)
    check(out, x, ids, w, weights, g)


@needs_triton
@pytest.mark.parametrize("t", [1, 33])
def test_moe_bf16_and_int32_ids(t, poisoned_empty):
    e, h, i, g, k = 8, 128, 64, 64, 2
    weights = random_moe(e, h, i, g, torch.bfloat16, seed=3)
    x = random_input((t, h), DEVICE, torch.bfloat16, seed=4)
    ids, w = routing("random", t, e, k, seed=5)
    out = ops_moe.moe_w4(x, ids.to(torch.int32), w.to(torch.bfloat16), *weights, g, backend="triton")
    check(out, x, ids, w.to(torch.bfloat16), weights, g)


@needs_triton
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_moe_other_activations(act):
    e, h, i, g, k, t = 4, 64, 64, 32, 2, 5
    weights = random_moe(e, h, i, g, seed=8)
    x = random_input((t, h), DEVICE, torch.float16, seed=9)
    ids, w = routing("random", t, e, k, seed=10)
    check(ops_moe.moe_w4(x, ids, w, *weights, g, act, backend="triton"), x, ids, w, weights, g, act)


def _kc(bn, bk, split=1):
    from fastawq.triton_kernels.moe import KernelConfig

    return KernelConfig(bn, bk, 4, 3, split_k=split)


# (T, k, routing, naive, block_m, w13 tile, w2 tile): per-assignment blocks (decode) and sorted
# blocks (batches); column tiles that split I = 96 and H = 64 unevenly; K split in w13 (gate/up
# sums added atomically, act * mul in w2's load), in w2, in both. Every config the tuner may pick
# must give the same sums.
CONFIGS = [
    (6, 2, "random", True, 16, None, _kc(64, 16)),
    (6, 2, "random", False, 32, None, None),
    (6, 2, "random", True, 16, None, _kc(32, 16, 3)),
    (6, 2, "random", False, 16, _kc(64, 16), _kc(32, 16, 3)),
    (6, 2, "random", True, 16, _kc(64, 16, 2), None),
    (6, 2, "random", False, 16, _kc(32, 16, 4), _kc(64, 16, 2)),
    (1, 2, "random", True, 16, _kc(128, 16, 3), _kc(64, 32, 2)),
    (6, 2, "random", False, 16, _kc(256, 16, 2), _kc(256, 32)),  # wider than I and H: masked columns
    # k = 3 with repeated experts: one block holds two rows of the same token, whose atomic adds
    # hit the same addresses in one instruction.
    (5, 3, "few_experts", False, 16, None, _kc(64, 16, 2)),
    (5, 3, "few_experts", False, 16, _kc(64, 16, 2), _kc(64, 16, 2)),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,route,naive,bm,w13,w2", CONFIGS)
def test_kernel_configs_agree_with_reference(t, k, route, naive, bm, w13, w2, dtype):
    from fastawq.triton_kernels import moe as tmoe

    e, h, i, g = 8, 64, 96, 32
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 12, dtype, route)
    base = tmoe.heuristic_config(t, k, e, h, i, g, g, sms=4)
    cfg = tmoe.MoeConfig(bm, naive, w13 or base.w13, w2 or base.w2)
    check(tmoe.moe_w4(x, ids, w, *weights, g, config=cfg), x, ids, w, weights, g)


@pytest.mark.parametrize("align", ["moe_align_torch", pytest.param("moe_align", marks=needs_triton)])
def test_moe_align_blocks_each_expert(align):
    from fastawq.triton_kernels import moe as tmoe

    e, bm = 6, 4
    ids = torch.tensor([[5, 0], [5, 2], [0, 5], [5, 3], [5, 0]], device=DEVICE)
    sorted_ids, block_expert = getattr(tmoe, align)(ids, e, bm)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    assert sorted_ids.numel() == block_expert.numel() * bm
    seen = []
    for b, ex in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * bm:(b + 1) * bm].tolist()
        real = [r for r in rows if r < n]
        if ex == e:
            assert rows == [n] * bm, "an unused block holds rows"
            continue
        assert real and all(flat[r] == ex for r in real) and rows == real + [n] * (bm - len(real))
        seen += real
    assert sorted(seen) == list(range(n))


@needs_triton
@pytest.mark.parametrize("e,bm,t,k", [(8, 16, 33, 2), (128, 16, 16, 8), (6, 32, 40, 3), (128, 64, 5, 8)])
def test_align_kernel_equals_torch_align(e, bm, t, k, poisoned_empty):
    from fastawq.triton_kernels import moe as tmoe

    gen = torch.Generator().manual_seed(e + t)
    ids = torch.randint(0, max(1, e // 2), (t, k), generator=gen).to(DEVICE)  # half the experts stay empty
    sorted_ids, block_expert = tmoe.moe_align(ids, e, bm)  # into poisoned buffers: every row written
    expect_ids, expect_blocks = tmoe.moe_align_torch(ids, e, bm)
    assert torch.equal(sorted_ids, expect_ids) and torch.equal(block_expert, expect_blocks)


def test_topk_route_matches_softmax_topk():
    logits = random_input((7, 16), "cpu", torch.float32, seed=2)
    w, ids = reference.topk_route(logits, 4, renormalize=True)
    probs = logits.softmax(-1)
    expect = probs.topk(4, dim=-1)
    assert torch.equal(ids, expect.indices)
    torch.testing.assert_close(w, expect.values / expect.values.sum(-1, keepdim=True))


def test_topk_route_grouped_sigmoid_only_picks_from_best_groups():
    logits = random_input((5, 16), "cpu", torch.float32, seed=3)
    bias = random_input((16,), "cpu", torch.float32, seed=4)
    w, ids = reference.topk_route(logits, 4, True, "sigmoid", num_groups=4, topk_groups=2, correction_bias=bias,
                                  scale=2.5)
    biased = (logits.sigmoid() + bias).view(5, 4, 4)
    best_groups = biased.topk(2, -1).values.sum(-1).topk(2, -1).indices
    assert all(set((ids[r] // 4).tolist()) <= set(best_groups[r].tolist()) for r in range(5))
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
    torch.testing.assert_close(w / 2.5, logits.sigmoid().gather(1, ids) / logits.sigmoid().gather(1, ids).sum(-1, True))


@needs_triton
def test_bad_inputs_name_the_problem():
    # On the device Triton runs on (the GPU, or the CPU under the interpreter): the last check is
    # the Triton backend's own dtype rule, not a device refusal.
    e, h, i, g = 4, 64, 64, 32
    weights = random_moe(e, h, i, g, device=DEVICE)
    x = random_input((3, h), DEVICE, torch.float16)
    ids, w = routing("random", 3, e, 2, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_states"):
        ops_moe.moe_w4(x[:, :32], ids, w, *weights, g)
    with pytest.raises(ValueError, match=r"topk_ids \(3, 1\)"):
        ops_moe.moe_w4(x, ids[:, :1], w, *weights, g)
    with pytest.raises(TypeError, match="topk_ids"):
        ops_moe.moe_w4(x, ids.float(), w, *weights, g)
    with pytest.raises(ValueError, match="w2_scales"):
        ops_moe.moe_w4(x, ids, w, *weights[:4], weights[4][:, :1], weights[5], g)
    with pytest.raises(ValueError, match="inconsistent"):
        ops_moe.moe_w4(x, ids, w, *weights[:3], weights[3][:2], *weights[4:], g)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        ops_moe.moe_w4(x, ids + 3, w, *weights, g, backend="torch")
    with pytest.raises(ValueError, match="act"):
        ops_moe.moe_w4(x, ids, w, *weights, g, "relu")
    with pytest.raises(BackendUnavailableError, match="fp16 or bf16"):
        ops_moe.moe_w4(x.float(), ids, w, *weights, g, backend="triton")


def test_auto_backend_on_cpu_is_torch():
    assert ops_moe.select_backend("moe_w4", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    e, h, i, g, k, t = 4, 64, 64, 32, 2, 3
    weights = random_moe(e, h, i, g, seed=20)
    x = random_input((t, h), DEVICE, torch.float16, seed=21)
    ids, w = routing("random", t, e, k, seed=22)
    utils = ["test_schema", "test_faketensor"]
    if backend == "torch" or HAS_CUDA:  # the interpreter would run the kernels a dozen more times
        utils += ["test_autograd_registration", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(torch.ops.fastawq.moe_w4.default, (x, ids, w, *weights, g, "silu", backend),
                          test_utils=utils)


@requires_cuda
@pytest.mark.parametrize("t", [1, 16, 256])
def test_moe_qwen3_shape_under_cuda_graph(t):
    e, h, i, g, k = 128, 2048, 768, 128, 8
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 30)
    replay_checks(lambda: ops_moe.moe_w4(x, ids, w, *weights, g, backend="triton"), x, ids, w, weights, g, 2, 40)


def replay_checks(run, x, ids, w, weights, g, rounds: int, seed: int) -> None:
    """run() once (tunes and compiles outside the capture), capture it in a CUDA graph, then replay
    it `rounds` times on new routings and inputs copied into the captured tensors, each checked."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    (t, h), e, k = x.shape, weights[0].shape[0], ids.shape[1]
    for r in range(rounds):
        new_ids, new_w = routing("random", t, e, k, seed=seed + r)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(random_input((t, h), "cuda", x.dtype, seed=seed + 10 + r))
        out.fill_(float("nan"))
        graph.replay()
        check(out, x, ids, w, weights, g)


def test_bench_moe_dry_run(tmp_path, capsys):
    import importlib.util
    import pathlib
    import sys

    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location("bench_moe", bench_dir / "bench_moe.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        assert bench.main(["--dry-run", "--ts", "1,3", "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(bench_dir))
    out = capsys.readouterr().out
    assert out.count("| tiny |") == 2
    rows = json.loads((tmp_path / "bench_moe.json").read_text())["rows"]
    assert [r["T"] for r in rows] == [1, 3] and all(r["relerr"] < 1e-2 for r in rows)
    # --routing balanced: every expert the same load, k distinct experts a token; a T whose T * k
    # the experts do not divide is refused by name.
    for ids, w in bench.routings(256, 128, 8, "cpu", 2, balanced=True):
        assert torch.bincount(ids.flatten(), minlength=128).tolist() == [16] * 128
        assert all(len(set(row.tolist())) == 8 for row in ids) and w.shape == (256, 8)
    assert bench.main(["--dry-run", "--ts", "4", "--routing", "balanced", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "bench_moe.json").read_text())["rows"][0]["routing"] == "balanced"
    with pytest.raises(SystemExit, match="E=8, which does not divide T \\* k = 6"):
        bench.main(["--dry-run", "--ts", "3", "--routing", "balanced", "--out", str(tmp_path)])


def test_tuner_descends_to_the_fastest_tiles(monkeypatch):
    # The GPU tuner's search, with a made-up cost in place of timing: it must reach the optimum.
    from fastawq.triton_kernels import moe as tmoe

    def cost(cfg, args):
        return (abs(cfg.w13.block_n - 256) + abs(cfg.w2.block_n - 128) + 10 * (cfg.w2.num_stages != 4)
                + abs(cfg.block_m - 64) + (cfg.w13.block_k != 32))

    monkeypatch.setattr(tmoe, "_time", cost)
    base = tmoe.MoeConfig(32, False, tmoe.KernelConfig(64, 128), tmoe.KernelConfig(64, 128))
    best = tmoe._tune("key", base, None)
    assert (best.w13.block_n, best.w13.block_k, best.w2.block_n, best.w2.num_stages, best.block_m) == (256, 32, 128, 4, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scoring,renorm,bias,e,k", [("softmax", True, False, 8, 2), ("softmax", False, False, 60, 8),
                                                      ("sigmoid", True, True, 16, 4), ("sigmoid", False, True, 128, 8)])
def test_topk_route_op_matches_reference(backend, scoring, renorm, bias, e, k, poisoned_empty):
    logits = random_input((9, e), DEVICE, torch.float16, seed=e + k)
    corr = random_input((e,), DEVICE, torch.float32, seed=5) * 0.1 if bias else None
    w, ids = ops_moe.topk_route(logits, k, renorm, scoring, correction_bias=corr, scale=1.5, backend=backend)
    ew, eids = reference.topk_route(logits, k, renorm, scoring, correction_bias=corr, scale=1.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, eids)
    torch.testing.assert_close(w, ew, rtol=1e-5, atol=1e-6)


def exact_router(t: int, h: int, e: int, dtype, seed: int):
    """x in {-1, 1} and router weights in multiples of 2^-10: every logit is exact in fp32, so its
    rounding to the router's dtype (and so the routing) cannot depend on the summation order."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, 2, (t, h), generator=gen) * 2 - 1).to(dtype)
    w = (torch.randint(-64, 65, (e, h), generator=gen).float() / 1024).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,h,e,k,scoring,renorm,bias", [
    (1, 64, 8, 2, "softmax", True, False),      # one program per token, one pass over H
    (5, 200, 128, 8, "softmax", True, False),   # 2 parts per token meet through the counters
    (3, 2100, 60, 4, "sigmoid", False, True),   # 8 parts, the last one short; two passes over H
    (2, 4096, 8, 2, "softmax", False, False),   # Mixtral-like: one part, two passes
    (40, 64, 16, 2, "softmax", True, False),    # above ROUTE_FUSED_MAX_T: the GEMM apart, then topk_route
])
def test_route_op_matches_reference(backend, t, h, e, k, scoring, renorm, bias, poisoned_empty):
    x, w = exact_router(t, h, e, torch.float16, seed=h + e)
    corr = random_input((e,), DEVICE, torch.float32, seed=5) * 0.1 if bias else None
    logits = torch.nn.functional.linear(x, w).float()
    choice = (logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()) + (0 if corr is None else corr)
    for rep in range(2):  # the second call finds the arrival counters re-armed
        got_w, got_ids = ops_moe.route(x, w, k, renorm, scoring, correction_bias=corr, scale=1.5, backend=backend)
        want_w, want_ids = reference.route(x, w, k, renorm, scoring, correction_bias=corr, scale=1.5)
        assert got_ids.dtype == torch.int64 and all(len(set(r.tolist())) == k for r in got_ids)
        # Equal logits tie (the kernel takes the lowest index, torch.topk any): the chosen scores,
        # best first, must be the reference's.
        assert torch.equal(choice.gather(1, got_ids), choice.gather(1, want_ids)), f"call {rep}"
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if getattr(b, "values", [b])[0] != "cuda"])
def test_routing_ops_pass_opcheck(backend, monkeypatch):
    x, w = exact_router(3, 256, 16, torch.float16, seed=2)
    corr = random_input((16,), DEVICE, torch.float32, seed=3) * 0.1
    utils = ["test_schema", "test_faketensor"]
    if backend == "torch" or HAS_CUDA:  # the interpreter would run the kernels a dozen more times
        utils += ["test_autograd_registration", "test_aot_dispatch_dynamic"]
    for fused in (True, False):  # the router GEMM in the routing launch, or in torch before it
        monkeypatch.setattr(ops_moe._backend, "ROUTE_FUSED", fused)
        torch.library.opcheck(torch.ops.fastawq.route.default, (x, w, 4, True, "sigmoid", corr, 2.0, backend),
                              test_utils=utils)
    logits = torch.nn.functional.linear(x, w)
    torch.library.opcheck(torch.ops.fastawq.topk_route.default, (logits, 4, False, "softmax", None, 1.0, backend),
                          test_utils=utils)
    xn, res, nw = exact_norm_inputs(3, 256, torch.float16, seed=4)
    for fused in (True, False):  # the norm in the routing launch, or the two launches
        monkeypatch.setattr(ops_moe._backend, "NORM_ROUTE_FUSED", fused)
        torch.library.opcheck(torch.ops.fastawq.add_rms_norm_route.default,
                              (xn, res, nw, 1e-6, 0.0, w, 4, True, "softmax", None, 1.0, backend), test_utils=utils)


@needs_triton
def test_route_fuses_the_gemm_only_for_few_tokens(monkeypatch):
    from fastawq import backend

    tk = ops_moe._triton()
    calls = []
    for name in ("route", "topk_route"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    for t in (1, backend.ROUTE_FUSED_MAX_T, backend.ROUTE_FUSED_MAX_T + 1):
        x, w = exact_router(t, 64, 8, torch.float16, seed=t)
        ops_moe.route(x, w, 2, backend="triton")
    assert calls == ["route", "route", "topk_route"]


def exact_norm_inputs(t: int, h: int, dtype, seed: int):
    """x and residual small integers (their sum and its sum of squares exact in any order), a norm
    weight near 1: the mean square, and so h, cannot depend on the summation order."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (t, h), generator=gen).to(dtype)
    res = torch.randint(-4, 5, (t, h), generator=gen).to(dtype)
    nw = (1 + torch.randint(-8, 9, (h,), generator=gen) / 64).to(dtype)
    return x.to(DEVICE), res.to(DEVICE), nw.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,h,e,k,offset", [(1, 64, 8, 2, 0.0), (5, 200, 128, 8, 1.0), (3, 2100, 60, 4, 0.0),
                                            (40, 64, 16, 2, 0.0)])
def test_add_rms_norm_route_is_the_norm_then_the_route(backend, t, h, e, k, offset, poisoned_empty, monkeypatch):
    x, res, nw = exact_norm_inputs(t, h, torch.float16, seed=h + e)
    _, w = exact_router(1, h, e, torch.float16, seed=e)
    monkeypatch.setattr(ops_moe._backend, "NORM_ROUTE_FUSED", True)
    got = ops_moe.add_rms_norm_route(x, res, nw, 1e-6, offset, w, k, backend=backend)
    want_h, want_r = reference.add_rms_norm(x, res, nw, 1e-6, offset)
    torch.testing.assert_close(got[1], want_r, rtol=0, atol=0)
    torch.testing.assert_close(got[0], want_h, rtol=2e-3, atol=2e-3)
    # The routing of the h it produced (ties: the chosen scores, best first, as the reference's).
    choice = torch.nn.functional.linear(got[0], w).float().softmax(-1)
    want_w, want_ids = reference.route(got[0], w, k)
    assert torch.equal(choice.gather(1, got[3]), choice.gather(1, want_ids))
    # h is not a small integer: its fp16 logits depend on the order of the router GEMM's sum by
    # an ulp (H200: 2e-3 relative in the weights at H = 2100), which the reference's order does not share.
    torch.testing.assert_close(got[2], want_w, rtol=5e-3, atol=1e-3)
    if backend != "torch":  # one launch, or the two it replaces: the same numbers
        monkeypatch.setattr(ops_moe._backend, "NORM_ROUTE_FUSED", False)
        apart = ops_moe.add_rms_norm_route(x, res, nw, 1e-6, offset, w, k, backend=backend)
        for a, b in zip(got, apart):
            assert torch.equal(a, b)


ROUTE_COMPILED = HAS_CUDA and _ext.has_op("moe_route")
needs_compiled_route = pytest.mark.skipif(not ROUTE_COMPILED, reason="the compiled router needs CUDA and fastawq._C")


def unit_norm_inputs(t: int, h: int, dtype, seed: int):
    """x + residual = +-1 everywhere (mean square 1, so with eps 0 the norm's rstd is exactly 1) and
    a norm weight in multiples of 1/16: h and its router logits (exact_router's weights) are exact,
    so neither the norm nor the routing can depend on the order of a sum."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (t, h), generator=gen) * 2 - 1
    res = torch.randint(-1, 2, (t, h), generator=gen) * 2
    nw = 1 + torch.randint(-2, 3, (h,), generator=gen) / 16
    return (r - res).to(dtype).to(DEVICE), res.to(dtype).to(DEVICE), nw.to(dtype).to(DEVICE)


def poison_cuda_allocator(nbytes: int = 1 << 22) -> None:
    """Leave 0xFF bytes in the caching allocator's free blocks: an unwritten float output reads NaN
    and an unwritten id -1 (the compiled op allocates its outputs in C++, past poisoned_empty)."""
    torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(255)


@needs_compiled_route
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,e,k,scoring,renorm,bias,norm,offset", [
    (1, 2048, 128, 8, "softmax", True, False, True, 0.0),    # Qwen3-30B-A3B decode: 16 parts meet
    (3, 4096, 8, 2, "softmax", True, False, True, 0.0),      # Mixtral: one part, the block chooses
    (2, 200, 5, 5, "sigmoid", False, True, False, 0.0),      # one part, E not a multiple of 4, k = E
    (4, 2100, 300, 32, "softmax", True, False, True, 1.0),   # H % 8 != 0: element loads; k at its bound
    (33, 256, 1024, 6, "sigmoid", True, True, False, 0.0),   # the most experts, 33 tokens
    # sm_90's cluster form: 8 experts a block with the last block half full, 3 chunks a thread
    (2, 6144, 60, 4, "softmax", True, False, True, 0.0),
    (1, 1024, 24, 3, "sigmoid", True, True, False, 0.0),     # 4 experts a block, 6 blocks
])
def test_compiled_route_matches_reference(dtype, t, h, e, k, scoring, renorm, bias, norm, offset):
    x, w = exact_router(t, h, e, dtype, seed=h + e)
    res = nw = None
    if norm:
        x, res, nw = unit_norm_inputs(t, h, dtype, seed=e)
    # x as the first h columns of wider rows: the kernel honours x's row stride.
    xs = torch.zeros(t, h + 8, dtype=dtype, device=DEVICE)[:, :h]
    xs.copy_(x)
    corr = random_input((e,), DEVICE, torch.float32, seed=5) * 0.1 if bias else None
    for rep in range(2):  # the second call finds the arrival counters re-armed
        poison_cuda_allocator()
        got_w, got_ids, got_h, got_r = torch.ops.fastawq.moe_route(xs, res, nw, 0.0, offset, w, k, renorm, scoring,
                                                                  corr, 1.5)
        routed = x
        if norm:
            want_h, want_r = reference.add_rms_norm(x, res, nw, 0.0, offset)
            assert torch.equal(got_r, want_r) and torch.equal(got_h, want_h), f"call {rep}"
            routed = want_h
        else:
            assert got_h.numel() == 0 and got_r.numel() == 0
        # The logits summed exactly (float64) and rounded once to the router's dtype, as the kernel
        # does: cuBLAS may reduce split-K partials in 16 bits (at H = 6144 a bf16 logit of ~300 then
        # moved by an ulp, 2.0, and the weights by 2.5 %), so reference.route's linear is not the oracle.
        logits = (routed.double() @ w.double().T).to(dtype)
        want_w, want_ids = reference.topk_route(logits, k, renorm, scoring, correction_bias=corr, scale=1.5)
        logits = logits.float()
        choice = (logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()) + (0 if corr is None else corr)
        assert got_ids.dtype == torch.int64 and got_ids.shape == (t, k)
        assert bool(((got_ids >= 0) & (got_ids < e)).all()) and all(len(set(r.tolist())) == k for r in got_ids)
        assert torch.equal(choice.gather(1, got_ids), choice.gather(1, want_ids)), f"call {rep}"
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@needs_compiled_route
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,e,k", [(1, 2048, 128, 8), (2, 4096, 8, 2), (2, 6144, 60, 4)])
def test_compiled_route_takes_fp32_sums(dtype, t, h, e, k):
    # x as fp32 sums (FASTAWQ_MOE_O_SUMS: o_proj's) beside a half residual: the cluster form rounds x
    # to the residual's dtype as it reads it, so the call is the one on x rounded first, exactly;
    # sums off the dtype grid make the rounding matter. Elsewhere the op refuses fp32 x, by name.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cluster form (sm_90) alone reads fp32 x")
    x, res, nw = unit_norm_inputs(t, h, dtype, seed=e + 1)
    _, w = exact_router(t, h, e, dtype, seed=h + e)
    x32 = x.float() + random_input((t, h), DEVICE, torch.float32, seed=3) * 1e-3
    poison_cuda_allocator()
    got = torch.ops.fastawq.moe_route(x32, res, nw, 1e-6, 0.0, w, k, True, "softmax", None, 1.0)
    want = torch.ops.fastawq.moe_route(x32.to(dtype), res, nw, 1e-6, 0.0, w, k, True, "softmax", None, 1.0)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # ops.add_rms_norm_route sends fp32 x to the compiled router where it serves (E from 16 to 128 on
    # its own, H <= 4096), norm_route_takes_sums says so, and the outputs keep the residual's dtype.
    if 16 <= e <= 128 and h <= 4096:
        assert ops_moe.norm_route_takes_sums(x32, nw, w, k, "softmax", None, None)
        h_out, r_out, _, ids = ops_moe.add_rms_norm_route(x32, res, nw, 1e-6, 0.0, w, k)
        assert h_out.dtype == dtype and torch.equal(h_out, want[2]) and torch.equal(ids, want[1])
    else:
        assert not ops_moe.norm_route_takes_sums(x32, nw, w, k, "softmax", None, None)
    with pytest.raises(RuntimeError, match="fp32 sums beside an fp16 / bf16 residual"):
        torch.ops.fastawq.moe_route(x32, None, None, 0.0, 0.0, w, k, True, "softmax", None, 1.0)
    with pytest.raises(RuntimeError, match="cluster form only"):
        big = torch.ops.fastawq.moe_route  # E = 300: past the cluster form's experts
        _, w300 = exact_router(t, h, 300, dtype, seed=2)
        big(x32, res, nw, 1e-6, 0.0, w300, k, True, "softmax", None, 1.0)


@needs_compiled_route
def test_compiled_route_errors_name_the_shapes(monkeypatch):
    x, w = exact_router(2, 64, 8, torch.float16, seed=1)
    with pytest.raises(RuntimeError, match=r"router_weight \[8, 64\] BFloat16"):
        torch.ops.fastawq.moe_route(x, None, None, 0.0, 0.0, w.bfloat16(), 2, True, "softmax", None, 1.0)
    with pytest.raises(RuntimeError, match=r"top-k from 1 to min\(E, 32\), got k=9 of 8"):
        torch.ops.fastawq.moe_route(x, None, None, 0.0, 0.0, w, 9, True, "softmax", None, 1.0)
    with pytest.raises(RuntimeError, match=r"residual and norm_weight come together"):
        torch.ops.fastawq.moe_route(x, x, None, 1e-6, 0.0, w, 2, True, "softmax", None, 1.0)
    assert torch.ops.fastawq.moe_route_declines(2048, 2048, 8) != "" and torch.ops.fastawq.moe_route_declines(128, 2048, 8) == ""
    assert "H=9000" in torch.ops.fastawq.moe_route_declines(128, 9000, 8)
    # ops.route declines it for what it does not take, and the automatic choice moves on to Triton.
    with pytest.raises(BackendUnavailableError, match="router in x's dtype"):
        ops_moe.route(x, w.float(), 2, backend="cuda")
    monkeypatch.setattr(ops_moe._backend, "ROUTE_CUDA", True)
    assert ops_moe._route_backend(x, w.float(), 2, "softmax", None, None) == "triton"
    # Automatic: only for E in ROUTE_CUDA_EXPERTS on sm_90 (where it was measured faster).
    x16, w16 = exact_router(2, 64, 16, torch.float16, seed=1)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert ops_moe._route_backend(x16, w16, 2, "softmax", None, None) == ("cuda" if hopper else "triton")
    assert ops_moe._route_backend(x, w, 2, "softmax", None, None) == "triton"  # E = 8
    monkeypatch.setattr(ops_moe._backend, "ROUTE_CUDA_EXPERTS", (1, 1 << 30))
    assert ops_moe._route_backend(x, w, 2, "softmax", None, None) == ("cuda" if hopper else "triton")
    monkeypatch.setattr(ops_moe._backend, "ROUTE_CUDA", False)  # off: the automatic choice keeps Triton
    assert ops_moe._route_backend(x, w, 2, "softmax", None, None) == "triton"
    assert ops_moe._route_backend(x, w, 2, "softmax", None, "cuda") == "cuda"


def test_add_rms_norm_route_errors_name_the_shapes():
    x, res, nw = exact_norm_inputs(2, 64, torch.float32, seed=1)
    _, w = exact_router(1, 64, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"residual \(2, 32\)"):
        ops_moe.add_rms_norm_route(x, res[:, :32], nw, 1e-6, 0.0, w, 2)
    with pytest.raises(ValueError, match=r"router_weight \(8, 32\)"):
        ops_moe.add_rms_norm_route(x, res, nw, 1e-6, 0.0, w[:, :32], 2)


@needs_triton
def test_route_routes_x_in_the_routers_dtype():
    # bf16 activations, fp32 router (as some checkpoints keep it): x is cast to fp32 exactly.
    x, w = exact_router(4, 256, 16, torch.float32, seed=9)
    got = ops_moe.route(x.to(torch.bfloat16), w, 3, backend="triton")
    want = reference.route(x, w, 3)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_route_errors_name_the_shapes():
    x, w = exact_router(2, 64, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"x \(2, 32\) and router_weight \(8, 64\)"):
        ops_moe.route(x[:, :32], w, 2)
    with pytest.raises(ValueError, match=r"k=9 must lie in \[1, 8\]"):
        ops_moe.route(x, w, 9)
    with pytest.raises(TypeError, match="floating-point"):
        ops_moe.route(x.to(torch.int32), w, 2)


@needs_triton
def test_topk_route_group_limit_stays_in_torch():
    logits = random_input((3, 16), DEVICE, torch.float32, seed=6)
    with pytest.raises(BackendUnavailableError, match="group-limited"):
        ops_moe.topk_route(logits, 2, scoring="sigmoid", num_groups=4, topk_groups=2, backend="triton")
    w, ids = ops_moe.topk_route(logits, 2, scoring="sigmoid", num_groups=4, topk_groups=2)
    assert torch.equal(ids, reference.topk_route(logits, 2, scoring="sigmoid", num_groups=4, topk_groups=2)[1])


@requires_cuda
@pytest.mark.parametrize("t", [1, 16, 200])
def test_every_tuning_candidate_is_correct(t):
    # The tuner may pick any variant it times (tiles, warps, stages, K splits, block rows).
    from fastawq.triton_kernels import moe as tmoe

    e, h, i, g, k = 8, 1024, 4096, 128, 2
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 60)
    base = tmoe.heuristic_config(t, k, e, h, i, g, g, torch.cuda.get_device_properties(0).multi_processor_count)
    configs = [base]
    configs += [replace(base, w13=kc) for kc in tmoe._variants(base.w13, base.block_m)]
    configs += [replace(base, w2=kc) for kc in tmoe._variants(base.w2, base.block_m)]
    configs += [replace(base, w2=replace(base.w2, split_k=s)) for s in (1, 2, 4, 8)]
    configs += [replace(base, w13=replace(base.w13, split_k=s)) for s in (1, 2, 4, 8)]
    configs += [replace(base, w13=replace(base.w13, block_k=base.w13.block_k // 2, num_stages=4)),
                replace(base, w2=replace(base.w2, block_k=base.w2.block_k // 2, num_stages=4))]
    configs += [replace(base, block_m=bm) for bm in (16, 32, 64) if not base.naive]
    if tmoe.use_naive(t, k, e):
        configs += tmoe._gemv_variants(tmoe.gemv_config(t, k, h, i, g, g, 132))
    for cfg in dict.fromkeys(configs):
        check(tmoe.moe_w4(x, ids, w, *weights, g, config=cfg), x, ids, w, weights, g)


def _compile_for_sm90(fn, sig: dict, constexprs: dict, **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton

    sig = {**sig, **{name: "constexpr" for name in constexprs}}
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)


def compile_heuristic_kernels(t: int, split13: int | None = None, wide: bool = False, packed: bool = False) -> None:
    """Build the Qwen3-30B-A3B shape's MoE kernels for sm_90 with the configs the heuristic picks
    (w13's K split forced to split13 when given: its atomic path and w2's gate/up input; with
    wide, the tuner's 256-column tiles; packed: the grouped GEMM on packed experts)."""
    from fastawq.triton_kernels import moe as tmoe

    cfg = tmoe.heuristic_config(t, 8, 128, 2048, 768, 128, 128, sms=132)
    if split13 is not None:
        cfg = replace(cfg, w13=replace(cfg.w13, split_k=split13))
    if wide:
        cfg = replace(cfg, **{f: replace(getattr(cfg, f), block_n=256, block_k=min(getattr(cfg, f).block_k, 32),
                                         num_warps=8) for f in ("w13", "w2")})
    gate_up = cfg.w13.split_k > 1
    ptrs = {"ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "qw_ptr": "*i32", "s_ptr": "*fp16",
            "qz_ptr": "*i32"}
    dims = {"E": "i32", "H": "i32", "I": "i32", "G": "i32", "TOPK": "i32"}
    common = {"NAIVE": cfg.naive, "BLOCK_M": cfg.block_m, "INTERPRET": False, "PACKED": packed}
    h_ptr = "*fp32" if gate_up else "*fp16"
    _compile_for_sm90(
        tmoe.moe_w13_kernel, {"x_ptr": "*fp16", **ptrs, "h_ptr": h_ptr, "n_assign": "i32", **dims, "stride_xm": "i32",
                              "split_k": "i32"},
        {"ACT": 0, **common, "BLOCK_N": cfg.w13.block_n, "BLOCK_K": cfg.w13.block_k, "ATOMIC": gate_up},
        num_warps=cfg.w13.num_warps, num_stages=cfg.w13.num_stages)
    _compile_for_sm90(
        tmoe.moe_w2_kernel, {"h_ptr": h_ptr, "ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
                             "tw_ptr": "*fp32", "qw_ptr": "*i32", "s_ptr": "*fp16", "qz_ptr": "*i32",
                             "out_ptr": "*fp32" if cfg.w2.split_k > 1 else "*fp16", "n_assign": "i32", **dims,
                             "split_k": "i32"},
        {**common, "BLOCK_N": cfg.w2.block_n, "BLOCK_K": cfg.w2.block_k, "ATOMIC": cfg.w2.split_k > 1,
         "GATE_UP": gate_up, "ACT": 0, "BF16": False},
        num_warps=cfg.w2.num_warps, num_stages=cfg.w2.num_stages)
    if packed:  # (the CUDA-core form reads the AWQ layout only)
        return
    gemv = tmoe.gemv_config(t, 8, 2048, 768, 128, 128, sms=132)
    for w13, kc in ((True, gemv.w13), (False, gemv.w2)):
        _compile_for_sm90(
            tmoe.moe_gemv_kernel, {"a_ptr": "*fp16" if w13 else "*fp32", "ids_ptr": "*i64", "tw_ptr": "*fp32",
                                   "qw_ptr": "*i32", "s_ptr": "*fp16", "qz_ptr": "*i32", "out_ptr": "*fp32",
                                   "E": "i32", "K": "i32", "N": "i32", "G": "i32", "TOPK": "i32",
                                   "stride_am": "i32", "split_k": "i32"},
            {"W13": w13, "ACT": 0, "BLOCK_W": kc.block_n // 8, "BLOCK_K": kc.block_k},
            num_warps=kc.num_warps, num_stages=kc.num_stages)
    if not cfg.naive:
        _compile_for_sm90(tmoe.moe_align_kernel, {"ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32",
                                                  "n": "i32", "E": "i32", "max_blocks": "i32"},
                          {"BLOCK_M": cfg.block_m, "E_PAD": 128, "CHUNK": 64}, num_warps=8)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the kernels run for real")
def test_heuristic_configs_compile_for_sm90():
    # The interpreter accepts programs the GPU compiler rejects: build the kernels for an H100/H200
    # ahead of time (Triton's bundled ptxas, no GPU needed), in a process that is not interpreting.
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_moe_op as t; [t.compile_heuristic_kernels(n, s, packed=p) for n in (1, 16, 256) for s in (None, 1, 2) for p in (False, True)]; t.compile_heuristic_kernels(1, 4, wide=True)"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,g,w13,w2", [
    (1, 2, 32, None, None),
    (2, 3, 32, _kc(128, 16, 3), _kc(512, 16)),  # uneven K splits, a tile wider than H
    (1, 2, -1, _kc(256, 32, 2), _kc(128, 32, 5)),  # one group over each K
    (3, 2, 32, _kc(256, 32, 64), None),  # more splits than K tiles: idle programs
])
def test_gemv_decode_configs_agree_with_reference(t, k, g, w13, w2, dtype):
    # The CUDA-core decode path: one program per (assignment, words of a row, K split), fp32 atomics.
    from fastawq.triton_kernels import moe as tmoe

    e, h, i = 8, 64, 96
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 40, dtype)
    base = tmoe.gemv_config(t, k, h, i, h if g == -1 else g, i if g == -1 else g, sms=4)
    cfg = replace(base, w13=w13 or base.w13, w2=w2 or base.w2)
    check(tmoe.moe_w4(x, ids, w, *weights, g, config=cfg), x, ids, w, weights, g)


def test_tuner_finds_a_wide_tile_that_only_wins_with_a_k_split(monkeypatch):
    # A synthetic cost where a 256-column w13 tile is slower than the heuristic's unless K is split
    # 4 ways: one pass of tiles-then-splits misses it, the second pass finds it.
    from fastawq.triton_kernels import moe as tmoe

    base = tmoe.heuristic_config(1, 8, 128, 2048, 768, 128, 128, sms=132)

    def cost(cfg, args):
        w13 = cfg.w13
        if w13.block_n == 256:
            return 1.0 if w13.split_k == 4 else 9.0
        return 5.0 - 0.1 * (w13.split_k == 4)

    monkeypatch.setattr(tmoe, "_time", cost)
    best = tmoe._tune("key", base, None)
    assert (best.w13.block_n, best.w13.split_k) == (256, 4) and best.w13.block_k <= 32


# --- the compiled MoE decode kernel (csrc/moe/) ---


@pytest.mark.skipif(not _ext.has_op("moe_gemv_w4_declines"), reason="needs fastawq._C with CUDA kernels")
def test_compiled_moe_fit_rules_need_no_gpu():
    declines = torch.ops.fastawq.moe_gemv_w4_declines
    assert declines(128, 2048, 768, 128) == "" and declines(8, 4096, 14336, -1) == ""
    assert "multiples of 32" in declines(8, 4096, 14344, 128)  # I % 32 != 0
    assert "group_size" in declines(8, 4096, 14336, 48)
    assert "positive" in declines(0, 4096, 14336, 128)


def test_moe_auto_choice_is_sized_by_the_load_per_expert():
    from fastawq import backend

    assert ops_moe._load(1, 8, 128) == 1 and ops_moe._load(16, 8, 128) == 1  # Qwen3-30B-A3B decode
    assert ops_moe._load(1, 2, 8) == 1 and ops_moe._load(16, 2, 8) == 4  # Mixtral
    assert backend._cuda_order("moe_w4", backend.MOE_GEMV_MAX_LOAD)[0] == "cuda"
    assert backend._cuda_order("moe_w4", backend.MOE_MMA_MAX_LOAD)[0] == "cuda"  # the tensor-core kernel
    assert backend._cuda_order("moe_w4", backend.MOE_MMA_MAX_LOAD + 1)[0] == "triton"
    # Past the tensor-core kernel's 4096 assignments a load it would serve goes to Triton, not to
    # the CUDA-core kernel (which reads an expert once per assignment).
    assert ops_moe._load(512, 8, 128) == 32 and ops_moe._load(600, 8, 128) == backend.MOE_MMA_MAX_LOAD + 1
    assert backend._cuda_order("moe_w4", ops_moe._load(600, 8, 128))[0] == "triton"
    assert ops_moe._load(4096, 1, 2048) == 2  # the CUDA-core kernel's loads keep their bucket


# (E, H, I, G, k, T, load): w13 tiles are 128 gate columns (I = 96 and 160 leave a part tile), w2
# tiles 256 columns (H = 96, 288 part tiles); H = 4096 splits K over blocks, H = 64 does not.
COMPILED_CASES = [
    (8, 96, 160, 32, 2, 1, "random"),
    (8, 288, 96, 32, 1, 1, "random"),
    (16, 4096, 96, 32, 4, 1, "random"),
    (4, 64, 4096, -1, 2, 1, "random"),
    (8, 256, 128, 64, 8, 1, "random"),
    (8, 128, 96, 32, 2, 9, "few_experts"),
    (128, 2048, 768, 128, 8, 2, "random"),
]


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_compiled_moe_matches_reference(case, dtype, poisoned_empty):
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=7 * t + k, dtype=dtype, load=load)
    for _ in range(2):  # the second call finds the workspace and counters the first left zeroed
        out = ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda")
        check(out, x, ids, w, weights, g)


@needs_compiled
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_compiled_moe_without_early_loads(monkeypatch, case, poisoned_empty):
    # w2's one-token ring loads its first weights before the PDL wait unless
    # FASTAWQ_GEMV_EARLY_LOADS=0 (read at each call; the default is covered above): the other form.
    monkeypatch.setenv("FASTAWQ_GEMV_EARLY_LOADS", "0")
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=7 * t + k + 1, dtype=torch.bfloat16, load=load)
    for _ in range(2):
        out = ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda")
        check(out, x, ids, w, weights, g)


ONE_TOKEN_CASES = [c for c in COMPILED_CASES if c[5] == 1]


def poison_allocator_cache() -> None:
    """Hand the caching allocator's free blocks back full of NaN: a buffer the op allocates in C++
    (at::empty, which poisoned_empty does not reach) then shows an element no kernel wrote, rather
    than the last call's value at the same address."""
    for numel in (1 << 12, 1 << 15, 1 << 18, 1 << 20):
        torch.full((numel,), float("nan"), device="cuda")
    torch.cuda.synchronize()


@needs_compiled
@pytest.mark.parametrize("early", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ONE_TOKEN_CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_compiled_moe_h_partials(monkeypatch, case, dtype, early, poisoned_empty):
    # FASTAWQ_MOE_H_PARTIALS=1 (read at each call): at one token a split w13 stores its split sums
    # and w2 adds them as it builds h (H = 288, 4096 and 256 split w13 into 3, 32 and 2; the others
    # do not split and keep the usual path). Both settings of early loads, which move w2's wait.
    monkeypatch.setenv("FASTAWQ_MOE_H_PARTIALS", "1")
    monkeypatch.setenv("FASTAWQ_GEMV_EARLY_LOADS", early)
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=5 * k + 3, dtype=dtype, load=load)
    for _ in range(2):  # the second call reuses the workspace (the partials need no zeroing)
        poison_allocator_cache()
        out = ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda")
        check(out, x, ids, w, weights, g)


@needs_compiled
@pytest.mark.parametrize("partials", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ONE_TOKEN_CASES + [(8, 128, 96, 32, 2, 3, "random")],
                         ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_compiled_moe_sums(monkeypatch, case, dtype, partials, poisoned_empty):
    # moe_gemv_w4_sums: the weighted sum in fp32, unconverted (one token: w13 zeroes it, w2 adds into
    # it), alone and with the w13 partials; at 3 tokens (another form) moe_gemv_w4's output widened.
    # Rounded, it is moe_gemv_w4's output up to the order of the fp32 additions.
    monkeypatch.setenv("FASTAWQ_MOE_H_PARTIALS", partials)
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=9 * k + 1, dtype=dtype, load=load)
    bad = ids.clone()
    bad[0, 0] = e  # adds nothing
    keep = bad < e
    for _ in range(2):  # the buffer is new each call and zeroed by w13: poison what it is carved from
        poison_allocator_cache()
        sums = torch.ops.fastawq.moe_gemv_w4_sums(x, ids, w.float(), *weights, g, "silu")
        assert sums.dtype == torch.float32 and sums.shape == x.shape
        check(sums.to(dtype), x, ids, w, weights, g)
        out = torch.ops.fastawq.moe_gemv_w4(x, ids, w.float(), *weights, g, "silu")
        ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
        assert ((sums.to(dtype).float() - out.float()).abs() <= 2 * ulp * out.float().abs() + 1e-6).all()
    poison_allocator_cache()
    sums = torch.ops.fastawq.moe_gemv_w4_sums(x, bad, w.float(), *weights, g, "silu")
    check(sums.to(dtype), x, ids.where(keep, 0), w * keep, weights, g)


@needs_compiled
def test_compiled_moe_sums_under_graph_and_opcheck():
    e, h, i, g, k, t = 128, 2048, 768, 128, 8, 1
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 62)
    wf = w.float()
    sums = ops_moe.moe_w4_sums(x, ids, wf, *weights, g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sums = ops_moe.moe_w4_sums(x, ids, wf, *weights, g)
    for r in range(3):
        new_ids, new_w = routing("random", t, e, k, seed=80 + r)
        ids.copy_(new_ids)
        wf.copy_(new_w)
        x.copy_(random_input((t, h), "cuda", x.dtype, seed=90 + r))
        sums.fill_(float("nan"))
        graph.replay()
        check(sums.to(x.dtype), x, ids, wf, weights, g)
    e, h, i, g, k, t = 4, 64, 64, 32, 2, 1
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=91)
    torch.library.opcheck(torch.ops.fastawq.moe_gemv_w4_sums.default, (x, ids, w.float(), *weights, g, "silu"))


@needs_compiled
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_compiled_moe_h_partials_activations_bad_ids_and_graph(monkeypatch, act):
    # w2 applies w13's activation when it reads the partials: each activation, an id outside
    # [0, E) (zeros, as without the switch), then the Qwen3-30B-A3B shape under a CUDA graph.
    monkeypatch.setenv("FASTAWQ_MOE_H_PARTIALS", "1")
    e, h, i, g, k, t = 8, 1024, 128, 64, 4, 1
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=31)
    check(ops_moe.moe_w4(x, ids, w, *weights, g, act, backend="cuda"), x, ids, w, weights, g, act)
    bad = ids.clone()
    bad[0, 1] = e
    keep = (bad >= 0) & (bad < e)
    out = ops_moe.moe_w4(x, bad, w, *weights, g, act, backend="cuda")
    check(out, x, ids.where(keep, 0), w * keep, weights, g, act)
    if act == "silu":
        e, h, i, g, k, t = 128, 2048, 768, 128, 8, 1
        weights, x, ids, w = moe_case(e, h, i, g, k, t, 61)
        plan = ops_moe.moe_w4_plan(x, *weights, g)
        replay_checks(lambda: plan(x, ids, w), x, ids, w, weights, g, 3, 71)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [20.0, 1e-3])
def test_compiled_moe_one_token_keeps_large_and_small_activations(scale, dtype):
    # At one token the MoE GEMV sums 8 rows in half2 / bfloat162 (block_gemv_h2): large inputs
    # (x up to ~70, so w2's input h reaches the thousands; the output ~10^4) must not overflow
    # fp16, small ones must keep their precision.
    e, h, i, g, k, t = 8, 1024, 256, 64, 2, 1
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=21, dtype=dtype)
    x = (x.float() * scale).to(dtype)
    out = ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda")
    check(out, x, ids, w, weights, g)


@needs_compiled
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_compiled_moe_other_activations_and_int32_ids(act):
    e, h, i, g, k, t = 8, 128, 96, 32, 2, 3
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=11)
    out = ops_moe.moe_w4(x, ids.to(torch.int32), w, *weights, g, act, backend="cuda")
    check(out, x, ids, w, weights, g, act)


@needs_compiled
def test_compiled_moe_ids_out_of_range_add_nothing():
    # The kernel cannot check ids without a host sync; an id outside [0, E) contributes zeros and
    # must leave the split-K counters as it found them (the next call is right).
    e, h, i, g, k, t = 8, 4096, 96, 32, 4, 2
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=12)
    bad = ids.clone()
    bad[0, 1], bad[1, 3] = -1, e
    out = ops_moe.moe_w4(x, bad, w, *weights, g, backend="cuda")
    keep = (bad >= 0) & (bad < e)
    check(out, x, ids.where(keep, 0), w * keep, weights, g)
    check(ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda"), x, ids, w, weights, g)


@needs_compiled
def test_compiled_moe_under_cuda_graph_and_by_default_at_low_load():
    e, h, i, g, k, t = 128, 2048, 768, 128, 8, 1
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 60)
    plan = ops_moe.moe_w4_plan(x, *weights, g)
    assert plan.backend == "cuda/triton"  # compiled at one token, the grouped Triton GEMM above
    replay_checks(lambda: plan(x, ids, w), x, ids, w, weights, g, 3, 70)


@needs_compiled
def test_compiled_moe_opcheck_and_errors():
    e, h, i, g, k, t = 4, 64, 64, 32, 2, 3
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=90)
    torch.library.opcheck(torch.ops.fastawq.moe_gemv_w4.default, (x, ids, w, *weights, g, "silu"))
    with pytest.raises(RuntimeError, match="scales must have x's dtype"):
        torch.ops.fastawq.moe_gemv_w4(x.bfloat16(), ids, w, *weights, g, "silu")
    with pytest.raises(RuntimeError, match="topk_weights must be contiguous fp32"):
        torch.ops.fastawq.moe_gemv_w4(x, ids, w.half(), *weights, g, "silu")
    with pytest.raises(RuntimeError, match="inconsistent MoE weights"):
        torch.ops.fastawq.moe_gemv_w4(x, ids, w, *weights[:3], weights[3][:, :32].contiguous(), *weights[4:], g, "silu")
    with pytest.raises(BackendUnavailableError, match="scales in x's dtype"):
        ops_moe.moe_w4(x, ids, w, weights[0], weights[1].bfloat16(), *weights[2:], g, backend="cuda")
