"""The tensor-core kernel on the packed layout (awq_mma_packed, csrc/gemv/awq_mma_packed.cu).

CPU: a bit-level emulation of the kernel's fragments (written from the kernel's comments: which
lane loads which 16 bytes, the byte permute and mask that make an A register, the B registers, the
C layout, the per-group correction with the sum of x) matches the reference, so the labelling is
checked without a GPU. GPU (skipped without CUDA and the compiled op): the kernel against
reference.awq_gemm on shapes across every tile edge, every batch-tile count and tile width.
"""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext
from fastawq.ops.repack import awq_gemv_repack
from test_gemv_packed import _poisoned_call as poisoned_call
from test_gemv_packed import _setup, check_graph_replay

HAS_KERNEL = torch.cuda.is_available() and _ext.has_op("awq_mma_packed")
requires_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and fastawq._C with awq_mma_packed")

MAGIC = {torch.float16: (0x6400, 1024.0), torch.bfloat16: (0x4300, 128.0)}


def _byte_perm(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _column_pair(w: int, c: int, magic: int) -> int:
    """column_pair<T, c>(w, w >> 4) of the kernel, on the word as an unsigned 32-bit int."""
    sel = c | (c << 4) | ((4 + c) << 8) | ((4 + c) << 12)
    return (_byte_perm(w, w >> 4, sel) & 0x000F000F) | (magic << 16) | magic


def _halves(reg: int, dtype: torch.dtype) -> tuple[float, float]:
    bits = torch.tensor([reg & 0xFFFF, reg >> 16], dtype=torch.int32).to(torch.int16)
    lo, hi = bits.view(dtype).float().tolist()
    return lo, hi


def _place_a(a: torch.Tensor, gq: int, t: int, regs: list[int], dtype: torch.dtype) -> None:
    """Lane (gq, t)'s four A registers of an m16n8k16 mma into the 16 x 16 A tile."""
    a[gq, 2 * t : 2 * t + 2] = torch.tensor(_halves(regs[0], dtype))
    a[gq + 8, 2 * t : 2 * t + 2] = torch.tensor(_halves(regs[1], dtype))
    a[gq, 2 * t + 8 : 2 * t + 10] = torch.tensor(_halves(regs[2], dtype))
    a[gq + 8, 2 * t + 8 : 2 * t + 10] = torch.tensor(_halves(regs[3], dtype))


def _emulate(x: torch.Tensor, wp: torch.Tensor, sz: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """y [M, N] as the kernel computes it, one mma (16 x 16 A, 16 x 8 B) at a time."""
    dtype = x.dtype
    magic_bits, magic = MAGIC[dtype]
    m, k = x.shape
    n4 = n // 4
    words = (wp.view(k // 8, n4, 4).to(torch.int64) & 0xFFFFFFFF).tolist()
    xf = x.float()
    pairs = sz.view(k // g, n4, 4, 2).float()
    y = torch.zeros(m, n)
    tiles = -(-m // 8)
    for chunk in range(0, n4, 8):
        acc = torch.zeros(m, n)
        xs = torch.zeros(m)
        for s in range(k // 32):
            for h in range(2):
                for tile in range(2):
                    a = torch.zeros(16, 16)
                    cols = [-1] * 16
                    for lane in range(32):
                        gq, t = divmod(lane, 4)
                        c4 = chunk + gq
                        if c4 >= n4:
                            continue
                        w = words[4 * s + t][c4]
                        w0, w1 = w[2 * h], w[2 * h + 1]
                        regs = [_column_pair(w0, 2 * tile, magic_bits), _column_pair(w0, 2 * tile + 1, magic_bits),
                                _column_pair(w1, 2 * tile, magic_bits), _column_pair(w1, 2 * tile + 1, magic_bits)]
                        _place_a(a, gq, t, regs, dtype)
                        cols[gq], cols[gq + 8] = 4 * c4 + 2 * tile, 4 * c4 + 2 * tile + 1
                    for nt in range(tiles):
                        b = torch.zeros(16, 8)
                        for lane in range(32):
                            gq, t = divmod(lane, 4)
                            row = min(nt * 8 + gq, m - 1)
                            k0 = 32 * s + 8 * t + 4 * h
                            b[2 * t : 2 * t + 2, gq] = xf[row, k0 : k0 + 2]
                            b[2 * t + 8 : 2 * t + 10, gq] = xf[row, k0 + 2 : k0 + 4]
                        c = a @ b  # [16 fragment rows, 8 batch rows]
                        if tile == 0:
                            ones = torch.ones(16, 16) @ b
                        for col in range(8):
                            bm = nt * 8 + col
                            if bm >= m:
                                continue
                            for r in range(16):
                                if cols[r] >= 0:
                                    acc[bm, cols[r]] += c[r, col]
                            if tile == 0:
                                xs[bm] += ones[0, col]
            if (s + 1) * 32 % g == 0:
                grp = s * 32 // g
                sc = pairs[grp, ..., 0].reshape(n)
                zm = magic + pairs[grp, ..., 1].reshape(n)
                lo, hi = 4 * chunk, min(4 * chunk + 32, n)
                y[:, lo:hi] += sc[lo:hi] * (acc[:, lo:hi] - zm[lo:hi] * xs[:, None])
                acc.zero_()
                xs.zero_()
    return y.to(dtype)


@pytest.mark.parametrize("m,k,n,g", [(3, 64, 40, 32), (9, 64, 72, 64), (1, 128, 32, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragments_as_the_kernel_reads_them(m, k, n, g, dtype):
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=m + k + n)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    x = random_input((m, k), dtype=dtype, seed=m)
    assert_close_to_reference(_emulate(x, wp, sz, n, g), x, qw, s, qz, g)


@pytest.mark.skipif(not _ext.has_op("awq_mma_packed"), reason="fastawq._C is not built with awq_mma_packed")
def test_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(17, 256, dtype=torch.bfloat16)
        wp = torch.empty(32, 136, dtype=torch.int32)
        sz = torch.empty(4, 272, dtype=torch.bfloat16)
        out = torch.ops.fastawq.awq_mma_packed(x, wp, sz, 136, 64, None)
        assert tuple(out.shape) == (17, 136) and out.dtype == torch.bfloat16
        with pytest.raises(Exception, match="M <= 32"):
            torch.ops.fastawq.awq_mma_packed(torch.empty(33, 256, dtype=torch.bfloat16), wp, sz, 136, 64, None)


# --- GPU ---

def _poisoned_call(x, wp, sz, n, g, bias=None, chunks=0, warps=0):
    return poisoned_call(x, wp, sz, n, g, bias, chunks, warps, op="awq_mma_packed")


# Edges: N below one 32-column chunk, across chunks and the 64/128-column tiles; K one step, one
# group, across groups of every size, split K.
GPU_SHAPES = [
    (32, 8, 32), (64, 136, 32), (128, 40, 64), (256, 264, 128), (1024, 1000, 64), (2048, 392, 128),
    (8192, 128, 128), (11008, 520, 32), (4096, 4104, 128),
]
MS = [1, 2, 5, 8, 9, 16, 17, 25, 32]


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(k, n, g, m, dtype):
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)
    bias = random_input((n,), "cuda", dtype, seed=7)
    x2 = random_input((m, k), "cuda", dtype, seed=m + 100)  # a second call: the workspace was re-zeroed
    assert_close_to_reference(_poisoned_call(x2, wp, sz, n, g, bias), x2, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 12, 32])
@pytest.mark.parametrize("m", [4, 12, 20])
def test_every_tile(chunks, warps, m):
    if m > 16 and chunks == 4:
        pytest.skip("4 chunks take at most 2 batch tiles")
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.bfloat16, seed=chunks + warps + m)
    x = random_input((m, k), "cuda", torch.bfloat16, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, None, chunks, warps), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("defer", ["0", "1"])
def test_deferred_refills_match_reference(monkeypatch, k, n, g, m, dtype, defer):
    # FASTAWQ_MMA_DEFER (on unless "0"; read at each call): the register ring refills each slot after
    # the next slot's first use and loads a group's pairs at its first step (groups of one step
    # included); "0": each slot refilled right after its own use.
    monkeypatch.setenv("FASTAWQ_MMA_DEFER", defer)
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    for seed in (m, m + 100):
        x = random_input((m, k), "cuda", dtype, seed=seed)
        bias = random_input((n,), "cuda", dtype, seed=7) if seed > 100 else None
        assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias), x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 32, 64])
@pytest.mark.parametrize("m", [3, 8])
def test_deferred_refills_every_tile(monkeypatch, chunks, warps, m):
    # Long warp ranges (several passes over the ring) down to one or two steps a warp.
    monkeypatch.setenv("FASTAWQ_MMA_DEFER", "1")
    k, n, g = 4096, 392, 64
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=chunks + warps + m)
    x = random_input((m, k), "cuda", torch.float16, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, None, chunks, warps), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("k,n", LLAMA3_8B_SHAPES)
@pytest.mark.parametrize("m", [2, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_llama_shapes(k, n, m, dtype):
    g = 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("m", [3, 16])
def test_cuda_graph_replay_with_changed_inputs(m):
    check_graph_replay(torch.ops.fastawq.awq_mma_packed, m)


@requires_kernel
@pytest.mark.parametrize("m", [1, 12, 32])
def test_opcheck(m):
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_mma_packed.default, (x, wp, sz, n, g, bias))
    torch.library.opcheck(torch.ops.fastawq.awq_mma_packed.default, (x, wp, sz, n, g, None, 2, 8))


@requires_kernel
def test_bad_inputs_are_named():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    op = torch.ops.fastawq.awq_mma_packed
    with pytest.raises(RuntimeError, match="awq_mma_packed: takes 1 <= M <= 32.*m=33"):
        op(random_input((33, k), "cuda", torch.float16), wp, sz, n, g, None)
    with pytest.raises(RuntimeError, match="chunks must be"):
        op(random_input((20, k), "cuda", torch.float16), wp, sz, n, g, None, 4, 0)
    with pytest.raises(RuntimeError, match="warps_per_sm"):
        op(x, wp, sz, n, g, None, 0, 65)
    with pytest.raises(RuntimeError, match="wpacked must be int32"):
        op(x, wp[:16], sz, n, g, None)
    with pytest.raises(RuntimeError, match="group_size"):
        op(x, wp, sz, n, 48, None)


def test_dispatch_buckets_name_one_kernel_each():
    from fastawq import backend
    from fastawq.ops.repack import MAX_M, MMA_MAX_M, _compiled_packed_op

    bounds = backend.size_buckets("packed_gemm")
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])
    assert backend.PACKED_GEMV_MAX_M <= MAX_M and backend.PACKED_MMA_MAX_M <= MMA_MAX_M
    assert _compiled_packed_op(backend.PACKED_GEMV_MAX_M) == "awq_gemv_packed"
    assert _compiled_packed_op(backend.PACKED_GEMV_MAX_M + 1) == "awq_mma_packed"


@requires_kernel
@pytest.mark.parametrize("m", [1, 3, 12, 16])
def test_packed_gemm_dispatches_to_the_compiled_kernels(m):
    from fastawq import ops

    k, n, g = 1024, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=m)
    x = random_input((m, k), "cuda", torch.float16, seed=m)
    plan = ops.packed_gemm_plan(x, wp, sz, n, g)
    assert_close_to_reference(plan(x), x, qw, s, qz, g)
