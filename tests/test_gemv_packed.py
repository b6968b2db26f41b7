"""The decode kernel on the repacked layout (awq_gemv_packed) and its load-time repack.

CPU: the repack round trip is bit-exact, and a bit-level emulation of the kernel's reading of the
layout (written from csrc/gemv/awq_gemv_packed.h, not from the inverse) matches the reference.
GPU (skipped without CUDA and the compiled op): the kernel against reference.awq_gemm.
"""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext, reference
from fastawq.ops import packed_gemm
from fastawq.ops.repack import awq_gemv_repack, awq_gemv_unpack

HAS_KERNEL = torch.cuda.is_available() and _ext.has_op("awq_gemv_packed")
requires_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and fastawq._C with awq_gemv_packed")

# (K, N, G): N below, at and across the 128-column tile and the 4-column lane chunk; K one batch,
# a few, and across groups of every size.
ROUND_TRIP_SHAPES = [
    (8, 8, 8), (32, 8, 32), (64, 24, 32), (96, 136, 32), (128, 128, 64), (256, 264, 128), (384, 520, 128),
    (200, 40, 40),
]


@pytest.mark.parametrize("k,n,g", ROUND_TRIP_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(k, n, g, dtype):
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=k + n)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    assert wp.dtype == torch.int32 and tuple(wp.shape) == (k // 8, n)
    assert sz.dtype == dtype and tuple(sz.shape) == (k // g, 2 * n)
    qw2, s2, qz2 = awq_gemv_unpack(wp, sz, n, g)
    assert torch.equal(qw2, qw) and torch.equal(qz2, qz)
    assert torch.equal(s2.view(torch.int16), s.view(torch.int16))  # bit identity, not value equality


def _emulate_layout(wp: torch.Tensor, sz: torch.Tensor, n: int, g: int) -> tuple[torch.Tensor, ...]:
    """q [K, N], scales [K/G, N], zeros [K/G, N] read the way the kernel reads them."""
    k = wp.shape[0] * 8
    q = torch.empty(k, n, dtype=torch.int32)
    words = wp.view(k // 8, n // 4, 4)  # [kb, c4, j]: one lane's 16 bytes per (kb, c4)
    for j in range(4):
        w = words[:, :, j]
        for c in range(4):
            lo = (w >> (8 * c)) & 0xF  # byte c of w & 0x0F0F0F0F
            hi = (w >> (8 * c + 4)) & 0xF  # byte c of (w >> 4) & 0x0F0F0F0F
            q[2 * j :: 8, c::4] = lo
            q[2 * j + 1 :: 8, c::4] = hi
    pairs = sz.view(k // g, n // 4, 4, 2)  # [g, c4, c, (s, z)]: one lane's 16 bytes per (g, c4)
    return q, pairs[..., 0].reshape(k // g, n), pairs[..., 1].reshape(k // g, n)


@pytest.mark.parametrize("k,n,g", [(32, 8, 32), (96, 136, 32), (256, 264, 128), (384, 520, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layout_as_the_kernel_reads_it(k, n, g, dtype):
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=3 * k + n)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    q, s_read, z_read = _emulate_layout(wp, sz, n, g)
    assert torch.equal(q, reference.unpack_int4(qw))
    assert torch.equal(s_read.view(torch.int16), s.view(torch.int16))
    assert torch.equal(z_read.to(torch.int32), reference.unpack_int4(qz))
    # The kernel's arithmetic: f = 0.5 + q/256 per weight, per group 256 * s * (sum x f - (0.5 + z/256) sum x).
    x = random_input((3, k), dtype=dtype)
    xf = x.float()
    f = 0.5 + q.float() / 256
    out = torch.zeros(3, n)
    for grp in range(k // g):
        rows = slice(grp * g, (grp + 1) * g)
        acc = xf[:, rows] @ f[rows]
        xs = xf[:, rows].sum(dim=1, keepdim=True)
        fz = 0.5 + z_read[grp].float() / 256
        out += s_read[grp].float() * (acc - fz * xs)
    assert_close_to_reference((256 * out).to(dtype), x, qw, s, qz, g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fallback_matches_reference(dtype):
    k, n, g = 256, 264, 64
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=5)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    x = random_input((2, k), dtype=dtype)
    bias = random_input((n,), dtype=dtype, seed=2)
    assert_close_to_reference(packed_gemm(x, wp, sz, n, g, bias), x, qw, s, qz, g, bias)


def test_repack_rejects_bad_shapes():
    qw, s, qz = random_awq(64, 16, 32)
    with pytest.raises(ValueError, match="group_size|qweight|scales"):
        awq_gemv_repack(qw, s[:1], qz, 32)
    wp, sz = awq_gemv_repack(qw, s, qz, 32)
    with pytest.raises(ValueError, match="N=24"):
        awq_gemv_unpack(wp, sz, 24, 32)
    with pytest.raises(ValueError, match="szpacked"):
        awq_gemv_unpack(wp, sz[:, :8], 16, 32)


@pytest.mark.skipif(not _ext.has_op("awq_gemv_packed"), reason="fastawq._C is not built with awq_gemv_packed")
def test_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 256, dtype=torch.bfloat16)
        wp = torch.empty(32, 136, dtype=torch.int32)
        sz = torch.empty(4, 272, dtype=torch.bfloat16)
        out = torch.ops.fastawq.awq_gemv_packed(x, wp, sz, 136, 64, None)
        assert tuple(out.shape) == (3, 136) and out.dtype == torch.bfloat16
        with pytest.raises(Exception, match="M <= 8"):
            torch.ops.fastawq.awq_gemv_packed(torch.empty(9, 256, dtype=torch.bfloat16), wp, sz, 136, 64, None)


# --- GPU ---

def _poisoned_call(x, wp, sz, n, g, bias=None, *tile, op="awq_gemv_packed"):
    """Fill a freed block of the output's size with NaN first, so unwritten outputs show."""
    junk = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    del junk
    return getattr(torch.ops.fastawq, op)(x, wp, sz, n, g, bias, *tile)


def _setup(k, n, g, dtype, seed=0):
    qw, s, qz = random_awq(k, n, g, "cuda", dtype, seed=seed)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    return qw, s, qz, wp, sz


# Edges: N < one tile, N = tile + 8, odd tile counts; K = one batch, one group, split K; every group size.
GPU_SHAPES = [
    (32, 8, 32), (64, 136, 32), (128, 128, 64), (256, 264, 128), (1024, 1000, 64), (2048, 392, 128),
    (8192, 128, 128), (11008, 520, 32), (4096, 4104, 128),
]


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(k, n, g, m, dtype):
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)
    bias = random_input((n,), "cuda", dtype, seed=7)
    x2 = random_input((m, k), "cuda", dtype, seed=m + 100)  # a second call: the workspace was re-zeroed
    assert_close_to_reference(_poisoned_call(x2, wp, sz, n, g, bias), x2, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("prefetch", ["", "0", "1000"])
@pytest.mark.parametrize("early", ["0", "1"])
def test_early_loads_match_reference(monkeypatch, k, n, g, m, prefetch, early):
    # FASTAWQ_GEMV_EARLY_LOADS (on unless "0"; read at each call): the first weight batch is loaded
    # before the PDL wait. The weights here were written by torch just before, as a repack writes them.
    # FASTAWQ_GEMV_PREFETCH: the default 2 batches into L2 before the wait, none, or a warp's range.
    monkeypatch.setenv("FASTAWQ_GEMV_EARLY_LOADS", early)
    monkeypatch.setenv("FASTAWQ_GEMV_PREFETCH", prefetch)
    qw, s, qz, wp, sz = _setup(k, n, g, torch.bfloat16, seed=k + n + m)
    for seed in (m, m + 100):  # the second call finds the workspace the first re-zeroed
        x = random_input((m, k), "cuda", torch.bfloat16, seed=seed)
        bias = random_input((n,), "cuda", torch.bfloat16, seed=7) if seed > 100 else None
        assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias), x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("early", ["0", "1"])
@pytest.mark.parametrize("pingpong", ["0", "1"])
def test_pingpong_matches_reference(monkeypatch, k, n, g, m, dtype, early, pingpong):
    # FASTAWQ_GEMV_PINGPONG=1 / 0 (read at each call; unset: at M = 2 only): two batches an iteration,
    # the register buffers trading roles (odd and even batch counts a warp, one batch, groups of one
    # batch), or one; with and without the first batch loaded before the PDL wait.
    monkeypatch.setenv("FASTAWQ_GEMV_PINGPONG", pingpong)
    monkeypatch.setenv("FASTAWQ_GEMV_EARLY_LOADS", early)
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    for seed in (m, m + 100):
        x = random_input((m, k), "cuda", dtype, seed=seed)
        bias = random_input((n,), "cuda", dtype, seed=7) if seed > 100 else None
        assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias), x, qw, s, qz, g, bias)
    for warps_per_sm in (1, 64):  # long warp ranges, and one batch a warp
        x = random_input((m, k), "cuda", dtype, seed=m + 7)
        out = torch.ops.fastawq.awq_gemv_packed(x, wp, sz, n, g, None, warps_per_sm)
        assert_close_to_reference(out, x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("k,n", LLAMA3_8B_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_llama_shapes(k, n, m, dtype):
    g = 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("k,n", [(4096, 28672), (14336, 4104), (2048, 392)])
@pytest.mark.parametrize("warps_per_sm", [1, 7, 16, 64])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_every_grid_plan_matches_reference(k, n, warps_per_sm, m):
    # An explicit warps_per_sm takes the warp-count plan (1: few splits, long ranges; 64: ranges of
    # 2 steps and many splits, blocks over several waves); 0, the automatic one-wave plan, is the
    # rest of this file. Ranges that leave a block's last warps empty are among them.
    g, dtype = 128, torch.float16
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=warps_per_sm + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, None, warps_per_sm), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scale", [300.0, 1e-3])
def test_half2_path_keeps_large_and_small_activations(m, scale, dtype):
    # M <= 2 sums 8 rows in half2 / bfloat162 (consume_h2): activations in the thousands must not
    # overflow fp16, and small ones must keep their precision (both against the fp32 oracle).
    k, n, g = 4096, 264, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=5)
    x = (random_input((m, k), "cuda", torch.float32, seed=m) * scale).to(dtype)
    x[:, 7] = 4000.0 if scale > 1 else x[:, 7]  # one massive channel, as LLM activations have
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)


@requires_kernel
def test_repack_on_gpu_equals_cpu():
    qw, s, qz = random_awq(512, 264, 128, dtype=torch.bfloat16, seed=9)
    wp, sz = awq_gemv_repack(qw, s, qz, 128)
    wpg, szg = awq_gemv_repack(qw.cuda(), s.cuda(), qz.cuda(), 128)
    assert torch.equal(wpg.cpu(), wp) and torch.equal(szg.cpu().view(torch.int16), sz.view(torch.int16))


def check_graph_replay(op, m: int) -> None:
    """op captured in a CUDA graph replays correctly with new inputs (split K: the graph replays the
    workspace reduction, and leaves the workspace zeroed for the next replay)."""
    k, n, g, dtype = 8192, 392, 128, torch.float16
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=11)
    x = random_input((m, k), "cuda", dtype, seed=1)
    op(x, wp, sz, n, g, None)  # workspace allocated outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, wp, sz, n, g, None)
    for seed in (2, 3, 4):
        x.copy_(random_input((m, k), "cuda", dtype, seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("m", [1, 4])
def test_cuda_graph_replay_with_changed_inputs(m):
    check_graph_replay(torch.ops.fastawq.awq_gemv_packed, m)


@requires_kernel
@pytest.mark.parametrize("m", [1, 3, 8])
def test_opcheck(m):
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_gemv_packed.default, (x, wp, sz, n, g, bias))
    torch.library.opcheck(torch.ops.fastawq.awq_gemv_packed.default, (x, wp, sz, n, g, None))


@requires_kernel
def test_bad_inputs_are_named():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    op = torch.ops.fastawq.awq_gemv_packed
    with pytest.raises(RuntimeError, match="M <= 8.*m=9"):
        op(random_input((9, k), "cuda", torch.float16), wp, sz, n, g, None)
    with pytest.raises(RuntimeError, match="wpacked must be int32"):
        op(x, wp[:16], sz, n, g, None)
    with pytest.raises(RuntimeError, match="szpacked must be"):
        op(x, wp, sz.to(torch.bfloat16), n, g, None)
    with pytest.raises(RuntimeError, match="group_size"):
        op(x, wp, sz, n, 48, None)
    with pytest.raises(RuntimeError, match="n must be"):
        op(x, wp, sz, 12, g, None)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        buf = torch.empty(k + 8, device="cuda", dtype=torch.float16)
        op(buf[1 : 1 + k].view(1, k), wp, sz, n, g, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, wp, sz, n, g, random_input((n + 8,), "cuda", torch.float16))
    with pytest.raises(RuntimeError, match="one CUDA device"):
        op(x, wp.cpu(), sz, n, g, None)
    with pytest.raises(RuntimeError, match="warps_per_sm must be in 1..64.*65"):
        op(x, wp, sz, n, g, None, 65)


# --- awq_gemv_packed_act: act(gate) * up staged in the kernel (branch wip/gemv-act-prologue) ---

def _matches_the_plain_gemv(out, x, wp, sz, n, g, bias):
    """A fused-prologue GEMV's output against awq_gemv_packed on the input it stages."""
    two = torch.ops.fastawq.awq_gemv_packed(x.contiguous(), wp, sz, n, g, bias)
    torch.testing.assert_close(out, two, rtol=2e-2, atol=2e-2 * two.abs().max().item())


HAS_ACT_KERNEL = HAS_KERNEL and _ext.has_op("awq_gemv_packed_act")
requires_act_kernel = pytest.mark.skipif(not HAS_ACT_KERNEL, reason="needs CUDA and awq_gemv_packed_act")


@requires_act_kernel
@pytest.mark.parametrize("k,n,g", [(32, 8, 32), (256, 264, 128), (1024, 1000, 64), (11008, 520, 32), (14336, 4096, 128)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pingpong", ["0", "1"])
def test_act_kernel_matches_reference(monkeypatch, k, n, g, m, act, dtype, pingpong):
    monkeypatch.setenv("FASTAWQ_GEMV_PINGPONG", pingpong)  # the two-batch loop too
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n)
    gu = random_input((m, 2 * k), "cuda", dtype, seed=m + k) * 2
    bias = random_input((n,), "cuda", dtype, seed=7) if n % 3 == 0 else None
    x = reference.act_mul(gu, act)  # what act_mul's launch would hand the GEMV
    out = _poisoned_call(gu, wp, sz, n, g, bias, act, op="awq_gemv_packed_act")
    assert out.shape == (m, n) and out.dtype == dtype
    # The kernel's act (fp32 erff / tanhf) and torch's may round an element of x to neighbouring
    # 16-bit values: allow one ulp of every x element through |W| (bf16 2^-7, fp16 2^-10 relative).
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    w = reference.dequantize(qw, s, qz, g).float()
    slack = ((x.float().abs() * ulp) @ w.abs()).max().item()
    assert_close_to_reference(out, x, qw, s, qz, g, bias, slack=slack)
    _matches_the_plain_gemv(out, x, wp, sz, n, g, bias)


@requires_act_kernel
def test_act_kernel_errors():
    qw, s, qz, wp, sz = _setup(256, 128, 64, torch.float16)
    op = torch.ops.fastawq.awq_gemv_packed_act
    gu = random_input((1, 512), "cuda", torch.float16, seed=1)
    with pytest.raises(RuntimeError, match="act must be silu"):
        op(gu, wp, sz, 128, 64, None, "relu")
    with pytest.raises(RuntimeError, match="M <= 2"):
        op(random_input((3, 512), "cuda", torch.float16, seed=1), wp, sz, 128, 64, None, "silu")
    with pytest.raises(RuntimeError, match="wpacked must be int32"):
        op(random_input((1, 256), "cuda", torch.float16, seed=1), wp, sz, 128, 64, None, "silu")
    with pytest.raises(RuntimeError, match="gate_up must be"):
        op(gu[:, :511], wp, sz, 128, 64, None, "silu")


@requires_act_kernel
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_act_linear_dispatch(monkeypatch, rows):
    # modules.fused.act_linear: the one launch where the flag is on and the GEMV serves the rows,
    # act_mul and the projection otherwise; the two agree.
    from fastawq import backend
    from fastawq.modules import WQLinear
    from fastawq.modules.fused import act_gemv_fits, act_linear

    lin = torch.nn.Linear(512, 384, bias=True).half().cuda()
    wq = WQLinear.from_linear(lin, 128)
    wq.set_layout("packed")
    gu = random_input((rows, 1, 1024), "cuda", torch.float16, seed=rows)
    monkeypatch.setattr(backend, "ACT_GEMV_FUSED", False)
    off = act_linear(gu, "silu", wq)
    assert not act_gemv_fits(gu, "silu", wq)
    monkeypatch.setattr(backend, "ACT_GEMV_FUSED", True)
    assert act_gemv_fits(gu, "silu", wq) is (rows <= backend.PACKED_GEMV_MAX_M)
    on = act_linear(gu, "silu", wq)
    assert on.shape == off.shape == (rows, 1, 384)
    torch.testing.assert_close(on, off, rtol=2e-2, atol=2e-2 * off.abs().max().item())


# --- awq_gemv_packed_norm: add + RMSNorm staged in the kernel (branch wip/gemv-act-prologue) ---

HAS_NORM_KERNEL = HAS_KERNEL and _ext.has_op("awq_gemv_packed_norm")
requires_norm_kernel = pytest.mark.skipif(not HAS_NORM_KERNEL, reason="needs CUDA and awq_gemv_packed_norm")


@requires_norm_kernel
@pytest.mark.parametrize("k,n,g", [(32, 8, 32), (256, 264, 128), (2048, 5120, 128), (4096, 6144, 128), (5120, 392, 64)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("with_residual,offset", [(True, 0.0), (False, 0.0), (True, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pingpong", ["0", "1"])
def test_norm_kernel_matches_reference(monkeypatch, k, n, g, m, with_residual, offset, dtype, pingpong):
    monkeypatch.setenv("FASTAWQ_GEMV_PINGPONG", pingpong)  # the two-batch loop too
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n)
    x = random_input((m, k), "cuda", dtype, seed=m + k) * 3
    res = random_input((m, k), "cuda", dtype, seed=m + k + 1) * 3 if with_residual else None
    nw = random_input((k,), "cuda", dtype, seed=9) * 0.5 + (0.0 if offset else 1.0)
    bias = random_input((n,), "cuda", dtype, seed=7) if n % 3 == 0 else None
    h, r = reference.add_rms_norm(x, res, nw, 1e-6, offset)
    torch.full((m, n), float("nan"), dtype=dtype, device="cuda")  # poison a block the outputs may reuse
    out, r_out = torch.ops.fastawq.awq_gemv_packed_norm(x, res, nw, 1e-6, offset, wp, sz, n, g, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    # The kernel's rsqrt and sum order may round an element of h to a neighbouring 16-bit value (K =
    # 32 fp16 went 3 % over the budget without this on the H200): one ulp of every h element through |W|.
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    w = reference.dequantize(qw, s, qz, g).float()
    slack = ((h.float().abs() * ulp) @ w.abs()).max().item()
    assert_close_to_reference(out, h, qw, s, qz, g, bias, slack=slack)
    if with_residual:
        assert torch.equal(r_out, r), "the new residual is x + residual rounded once"
    else:
        assert r_out.numel() == 0
    _matches_the_plain_gemv(out, h, wp, sz, n, g, bias)


@requires_norm_kernel
def test_norm_kernel_errors():
    qw, s, qz, wp, sz = _setup(256, 128, 64, torch.float16)
    op = torch.ops.fastawq.awq_gemv_packed_norm
    x = random_input((1, 256), "cuda", torch.float16, seed=1)
    nw = torch.ones(256, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="M <= 2"):
        op(random_input((3, 256), "cuda", torch.float16, seed=1), None, nw, 1e-6, 0.0, wp, sz, 128, 64, None)
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x, x[:, :128].contiguous(), nw, 1e-6, 0.0, wp, sz, 128, 64, None)
    with pytest.raises(RuntimeError, match="norm_weight must be"):
        op(x, None, nw.float(), 1e-6, 0.0, wp, sz, 128, 64, None)


@requires_norm_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_llama_with_both_prologues_matches_without(monkeypatch, dtype):
    # The fused engine's decode with add + RMSNorm inside QKV and gate_up and act_mul inside down
    # (backend.NORM_GEMV_FUSED, ACT_GEMV_FUSED) against the same model without them, CUDA graphs.
    import copy

    from transformers import AutoModelForCausalLM, LlamaConfig

    from fastawq import backend
    from fastawq.modules import WQLinear
    from fastawq.modules.fused import fuse_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, mod in list(parent.named_children()):
                    if isinstance(mod, torch.nn.Linear):
                        setattr(parent, name, WQLinear.from_linear(mod.to(dtype), 32))
    ref = ref.to(dtype).cuda()  # fuse_model takes the AWQ layout and repacks for decode itself
    ids = torch.randint(0, cfg.vocab_size, (1, 40), device="cuda")
    feed = torch.randint(0, cfg.vocab_size, (12, 1), device="cuda")  # the same tokens for both runs
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(backend, "NORM_GEMV_FUSED", on)
        monkeypatch.setattr(backend, "ACT_GEMV_FUSED", on)
        fused = fuse_model(copy.deepcopy(ref), max_seq_len=128, batch_size=1, backend="cuda", use_cuda_graphs=True)
        layouts = {mod.layout for mod in fused.modules() if isinstance(mod, WQLinear)}
        assert layouts == {"packed"}, f"the prologues need the packed layout, fused decode has {layouts}"
        rt = fused.fastawq_runtime
        steps = [rt.prefill(ids)[:, -1].float()]
        for tok in feed:
            lf = rt.decode(tok)
            assert torch.isfinite(lf).all()
            steps.append(lf.float())
        logits[on] = torch.stack(steps)
    diff = float((logits[True] - logits[False]).norm() / logits[False].norm())
    assert diff < 2e-2, f"prologues vs separate launches: relative difference {diff:.2g}"


# --- awq_gemv_packed_sums / _act_sums: the projection added into fp32 sums (FASTAWQ_DENSE_SUMS) ---

HAS_SUMS_KERNEL = HAS_KERNEL and _ext.has_op("awq_gemv_packed_sums")
requires_sums_kernel = pytest.mark.skipif(not HAS_SUMS_KERNEL, reason="needs CUDA and awq_gemv_packed_sums")


@requires_sums_kernel
@pytest.mark.parametrize("k,n,g", [(32, 8, 32), (256, 264, 128), (1024, 1000, 64), (4096, 4104, 128), (14336, 4096, 128)])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pingpong", ["0", "1"])
def test_sums_kernels_add_the_projection(monkeypatch, k, n, g, m, dtype, pingpong):
    # The blocks add their tiles (split 0 the bias) into sums and write nothing else: sums that start
    # at c end at c + y (c random, so a tile added twice or not at all shows), for the plain GEMV and
    # the act prologue, both loop forms. Rounded, the sums are the ordinary ops' outputs up to the
    # order of the fp32 additions.
    monkeypatch.setenv("FASTAWQ_GEMV_PINGPONG", pingpong)
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + 3 * n)
    bias = random_input((n,), "cuda", dtype, seed=9) if n % 3 == 0 else None
    x = random_input((m, k), "cuda", dtype, seed=m + k)
    c = random_input((m, n), "cuda", torch.float32, seed=5)
    sums = c.clone()
    torch.ops.fastawq.awq_gemv_packed_sums(x, wp, sz, n, g, bias, sums)
    assert_close_to_reference((sums - c).to(dtype), x, qw, s, qz, g, bias)
    plain = torch.ops.fastawq.awq_gemv_packed(x, wp, sz, n, g, bias)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert ((sums - c).to(dtype).float() - plain.float()).abs().le(2 * ulp * plain.float().abs() + 1e-3).all()

    gu = random_input((m, 2 * k), "cuda", dtype, seed=m + 2 * k) * 2
    sums = c.clone()
    torch.ops.fastawq.awq_gemv_packed_act_sums(gu, wp, sz, n, g, bias, "silu", sums)
    act = torch.ops.fastawq.awq_gemv_packed_act(gu, wp, sz, n, g, bias, "silu")
    assert ((sums - c).to(dtype).float() - act.float()).abs().le(2 * ulp * act.float().abs() + 1e-3).all()

    # gate_up as fp32 sums (FASTAWQ_DENSE_GU_SUMS): rounded to dtype as they are read, so sums off
    # the dtype grid give what their rounding gives, up to the order of the fp32 additions.
    gu32 = gu.float() + random_input((m, 2 * k), "cuda", torch.float32, seed=7) * gu.float().abs() * 1e-4
    sums32 = c.clone()
    torch.ops.fastawq.awq_gemv_packed_act_sums(gu32, wp, sz, n, g, bias, "silu", sums32)
    sums_rounded = c.clone()
    torch.ops.fastawq.awq_gemv_packed_act_sums(gu32.to(dtype), wp, sz, n, g, bias, "silu", sums_rounded)
    assert ((sums32 - sums_rounded).abs() <= 1e-5 * sums_rounded.abs() + 1e-4).all()


@requires_sums_kernel
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("zero_len", [4, 4100, 2 * 28672])
def test_sums_kernel_zeroes_the_next_sums(m, zero_len):
    # awq_gemv_packed_sums(zero=): the launch also fills `zero` (a later projection's sums, any
    # length a multiple of 4, from one float4 to more than the grid's threads) with zeros, and its
    # own sums are what they are without it.
    k, n, g = 1024, 4096, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=11)
    x = random_input((m, k), "cuda", torch.float16, seed=12)
    c = random_input((m, n), "cuda", torch.float32, seed=13)
    sums = c.clone()
    full = random_input((zero_len + 8,), "cuda", torch.float32, seed=14)
    before = full.clone()
    torch.ops.fastawq.awq_gemv_packed_sums(x, wp, sz, n, g, None, sums, full[4:4 + zero_len])  # 16-byte aligned
    assert (full[4:4 + zero_len] == 0).all()
    assert torch.equal(full[:4], before[:4]) and torch.equal(full[4 + zero_len:], before[4 + zero_len:])
    assert_close_to_reference((sums - c).half(), x, qw, s, qz, g, None)


@requires_sums_kernel
def test_sums_kernels_errors_opcheck_and_graph():
    qw, s, qz, wp, sz = _setup(256, 128, 64, torch.float16)
    x = random_input((2, 256), "cuda", torch.float16, seed=1)
    op, act_op = torch.ops.fastawq.awq_gemv_packed_sums, torch.ops.fastawq.awq_gemv_packed_act_sums
    with pytest.raises(RuntimeError, match=r"sums must be a contiguous fp32 \[M=2, N=128\]"):
        op(x, wp, sz, 128, 64, None, torch.zeros(2, 128, dtype=torch.float16, device="cuda"))
    with pytest.raises(RuntimeError, match=r"sums must be a contiguous fp32 \[M=2, N=128\]"):
        op(x, wp, sz, 128, 64, None, torch.zeros(1, 128, device="cuda"))
    with pytest.raises(RuntimeError, match="M <= 2"):
        op(random_input((3, 256), "cuda", torch.float16, seed=1), wp, sz, 128, 64, None, torch.zeros(3, 128, device="cuda"))
    with pytest.raises(RuntimeError, match="act must be silu"):
        act_op(random_input((2, 512), "cuda", torch.float16, seed=1), wp, sz, 128, 64, None, "relu",
               torch.zeros(2, 128, device="cuda"))
    with pytest.raises(RuntimeError, match=r"zero must be a contiguous, 16-byte aligned fp32 tensor"):
        op(x, wp, sz, 128, 64, None, torch.zeros(2, 128, device="cuda"), torch.zeros(8, dtype=torch.float16,
                                                                                   device="cuda"))
    with pytest.raises(RuntimeError, match=r"zero must be .* multiple of 4 elements"):
        op(x, wp, sz, 128, 64, None, torch.zeros(2, 128, device="cuda"), torch.zeros(6, device="cuda"))
    both = torch.zeros(2, 256, device="cuda")
    with pytest.raises(RuntimeError, match="overlaps sums"):
        op(x, wp, sz, 128, 64, None, both.view(-1)[:256].view(2, 128), both.view(-1)[128:])
    with pytest.raises(RuntimeError, match="overlaps sums .* or x"):
        op(x, wp, sz, 128, 64, None, torch.zeros(2, 128, device="cuda"), x.view(torch.float32).view(-1)[:64])
    with pytest.raises(RuntimeError, match="x must be fp16 or bf16"):
        torch.ops.fastawq.awq_gemv_packed_act(random_input((2, 512), "cuda", torch.float32, seed=1), wp, sz, 128, 64,
                                              None, "silu")  # fp32 gate_up: the sums form only
    torch.library.opcheck(op.default, (x, wp, sz, 128, 64, None, torch.zeros(2, 128, device="cuda")))
    torch.library.opcheck(op.default, (x, wp, sz, 128, 64, None, torch.zeros(2, 128, device="cuda"),
                                       torch.zeros(64, device="cuda")))
    torch.library.opcheck(act_op.default, (random_input((2, 512), "cuda", torch.float32, seed=3), wp, sz, 128, 64,
                                           None, "silu", torch.zeros(2, 128, device="cuda")))
    torch.library.opcheck(act_op.default, (random_input((2, 512), "cuda", torch.float16, seed=2), wp, sz, 128, 64,
                                           None, "silu", torch.zeros(2, 128, device="cuda")))
    # Under a graph: the sums are re-zeroed between replays by the caller (the norm in the engine).
    sums = torch.zeros(2, 128, device="cuda")
    graph = torch.cuda.CUDAGraph()
    op(x, wp, sz, 128, 64, None, sums)
    with torch.cuda.graph(graph):
        op(x, wp, sz, 128, 64, None, sums)
    for r in range(3):
        x.copy_(random_input((2, 256), "cuda", torch.float16, seed=20 + r))
        sums.zero_()
        graph.replay()
        assert_close_to_reference(sums.half(), x, qw, s, qz, 64, None)
