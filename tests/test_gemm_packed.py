"""The tensor-core kernel with the batch as the mma's M (awq_gemm_packed, csrc/gemv/awq_gemm_packed.cu).

CPU: a bit-level emulation of the kernel's fragments (written from the kernel's comments: which
lane loads which 16 bytes of the layout, the byte permute and mask that make a B register, its
dequantization in x's dtype, the A registers from one 16-byte load of x per row, the C layout)
matches the reference, and the staged form's shared-memory quads are the mma's A registers. GPU
(skipped without CUDA and the compiled op): the kernel against reference.awq_gemm on shapes across
every tile edge (16-row m-tiles, 16/32/64-row blocks, the 128-column tile, the 4-column lane chunk),
forced K splits, and the Llama-3-8B shapes.
"""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext
from fastawq.ops.repack import awq_gemv_repack
from test_gemv_packed import _poisoned_call as poisoned_call
from test_gemv_packed import _setup, check_graph_replay
from test_mma_packed import MAGIC, _column_pair, _halves

HAS_KERNEL = torch.cuda.is_available() and _ext.has_op("awq_gemm_packed")
requires_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and fastawq._C with awq_gemm_packed")


def _emulate(x: torch.Tensor, wp: torch.Tensor, sz: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """y [M, N] as the kernel computes it, one mma (16 x 16 A, 16 x 8 B) at a time."""
    dtype = x.dtype
    magic_bits, magic = MAGIC[dtype]
    m, k = x.shape
    n4 = n // 4
    words = (wp.view(k // 8, n4, 4).to(torch.int64) & 0xFFFFFFFF).tolist()
    pairs = sz.view(k // g, n4, 4, 2)
    y = torch.zeros(m, n)
    for c4w in range(0, n4, 8):  # a warp's 32 columns
        for mt in range(-(-m // 16)):
            rows = [min(16 * mt + r, m - 1) for r in range(16)]
            acc = torch.zeros(16, n)
            for s in range(k // 32):
                grp = 32 * s // g
                for h in range(2):
                    a = torch.zeros(16, 16)
                    for t in range(4):
                        k0 = 32 * s + 8 * t + 4 * h
                        for r in range(16):
                            a[r, 2 * t : 2 * t + 2] = x[rows[r], k0 : k0 + 2].float()
                            a[r, 2 * t + 8 : 2 * t + 10] = x[rows[r], k0 + 2 : k0 + 4].float()
                    for j in range(4):
                        b = torch.zeros(16, 8)
                        cols = [-1] * 8
                        for lane in range(32):
                            gq, t = divmod(lane, 4)
                            c4 = c4w + gq
                            if c4 >= n4:
                                continue
                            w = words[4 * s + t][c4]
                            scale, zero = pairs[grp, c4, j]
                            for r, word in enumerate((w[2 * h], w[2 * h + 1])):
                                mq = torch.tensor(_halves(_column_pair(word, j, magic_bits), dtype), dtype=dtype)
                                # hsub2 (exact), then hmul2 rounded to x's dtype
                                wv = (mq - (magic + zero)) * scale
                                b[2 * t + 8 * r : 2 * t + 8 * r + 2, gq] = wv.float()
                            cols[gq] = 4 * c4 + j
                        c = a @ b
                        for gq in range(8):
                            if cols[gq] >= 0:
                                acc[:, cols[gq]] += c[:, gq]
            for r in range(16):
                if 16 * mt + r < m:
                    lo, hi = 4 * c4w, min(4 * c4w + 32, n)
                    y[16 * mt + r, lo:hi] = acc[r, lo:hi]
    return y.to(dtype)


@pytest.mark.parametrize("m,k,n,g", [(3, 64, 40, 32), (17, 64, 72, 64), (16, 128, 32, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragments_as_the_kernel_reads_them(m, k, n, g, dtype):
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=m + k + n)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    x = random_input((m, k), dtype=dtype, seed=m)
    assert_close_to_reference(_emulate(x, wp, sz, n, g), x, qw, s, qz, g)


def _staged_quads(x: torch.Tensor, row0: int, s0: int, s1: int, mt_count: int) -> dict[int, tuple[int, ...]]:
    """The staged form's shared memory (FASTAWQ_GEMM_STAGE_X=1) as its 128 threads write it: the
    16-byte quads by byte offset from the staged region, each as its four 32-bit words."""
    m, k = x.shape
    words = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [M, K / 2]: k pairs
    smem: dict[int, tuple[int, ...]] = {}
    items = (s1 - s0) * mt_count * 32
    for tid in range(128):
        for j in range(tid, items, 128):
            r, mt, c, p = j // (32 * mt_count), (j >> 5) % mt_count, (j >> 3) & 3, j & 7
            row = row0 + 16 * mt + p
            k0 = 32 * (s0 + r) + 8 * c
            u = words[min(row, m - 1), k0 // 2 : k0 // 2 + 4].tolist()
            v = words[min(row + 8, m - 1), k0 // 2 : k0 // 2 + 4].tolist()
            at = (j >> 5) * 1024 + (j & 31) * 16
            assert at not in smem and at + 512 not in smem, "two items on one quad"
            smem[at] = (u[0], v[0], u[1], v[1])
            smem[at + 512] = (u[2], v[2], u[3], v[3])
    return smem


@pytest.mark.parametrize("m,mt_count,row0,s0,s1", [(16, 1, 0, 0, 16), (5, 1, 0, 3, 8), (40, 2, 32, 1, 9),
                                                   (64, 4, 0, 0, 8), (70, 4, 64, 2, 5)])
def test_staged_quads_are_the_mma_a_fragments(m, mt_count, row0, s0, s1):
    # Lane (g, t)'s load at + 16 (8t + g) + ((r MT + mt) 2 + h) 512 must be the mma's A registers
    # {a0, a1, a2, a3} of k-step h, under the layout's k labels (_emulate's a: slots 2t, 2t + 1 are
    # k0, k0 + 1 and slots 2t + 8, 2t + 9 are k0 + 2, k0 + 3, k0 = 32 s + 8t + 4h): rows g and g + 8.
    k = 32 * s1 + 64
    x = random_input((m, k), dtype=torch.float16, seed=m + s0)
    smem = _staged_quads(x, row0, s0, s1, mt_count)
    assert len(smem) == (s1 - s0) * mt_count * 64
    bits = x.view(torch.int16).to(torch.int64) & 0xFFFF
    pair = lambda row, kk: int(bits[min(row, m - 1), kk]) | int(bits[min(row, m - 1), kk + 1]) << 16  # noqa: E731
    for r in range(s1 - s0):
        for mt in range(mt_count):
            for h in range(2):
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    quad = smem[16 * (8 * t + g) + ((r * mt_count + mt) * 2 + h) * 512]
                    k0 = 32 * (s0 + r) + 8 * t + 4 * h
                    top, bottom = row0 + 16 * mt + g, row0 + 16 * mt + g + 8
                    assert quad == (pair(top, k0), pair(bottom, k0), pair(top, k0 + 2), pair(bottom, k0 + 2))


@pytest.mark.skipif(not _ext.has_op("awq_gemm_packed"), reason="fastawq._C is not built with awq_gemm_packed")
def test_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(300, 256, dtype=torch.bfloat16)
        wp = torch.empty(32, 136, dtype=torch.int32)
        sz = torch.empty(4, 272, dtype=torch.bfloat16)
        out = torch.ops.fastawq.awq_gemm_packed(x, wp, sz, 136, 64, None)
        assert tuple(out.shape) == (300, 136) and out.dtype == torch.bfloat16


# --- GPU ---

def _poisoned_call(x, wp, sz, n, g, bias=None, m_tiles=0, chunks=0, splits=0):
    return poisoned_call(x, wp, sz, n, g, bias, m_tiles, chunks, splits, op="awq_gemm_packed")


# Edges: N below one 4-column chunk pair, across the 32-column warp and 128-column block tiles; K
# one step, one group, across groups of every size, split K.
GPU_SHAPES = [
    (32, 8, 32), (64, 136, 32), (128, 40, 64), (256, 264, 128), (1024, 1000, 64), (2048, 392, 128),
    (8192, 128, 128), (11008, 520, 32), (4096, 4104, 128),
]
# Across the 16-row m-tiles and the 16 / 32 / 64-row blocks, and several 64-row blocks.
MS = [1, 15, 16, 17, 32, 33, 48, 64, 65, 127, 128, 129, 200]


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
@pytest.mark.parametrize("m_tiles,chunks", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("m", [5, 24, 70])
def test_every_tile_and_split(m_tiles, chunks, splits, m):
    # A forced tile on any M (1 m-tile at M = 70: 5 blocks along M; 2 chunks: 256-column tiles on
    # N = 392) and forced K splits (64 of 64 steps: one step a block, shorter than the ring).
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.bfloat16, seed=m_tiles + chunks + splits + m)
    x = random_input((m, k), "cuda", torch.bfloat16, seed=m)
    bias = random_input((n,), "cuda", torch.bfloat16, seed=3)
    out = _poisoned_call(x, wp, sz, n, g, bias, m_tiles, chunks, splits)
    assert_close_to_reference(out, x, qw, s, qz, g, bias)


# The x modes of awq_gemm_packed's A/B switches (read at each call): FASTAWQ_GEMM_SHARE_X=1, one
# ring a block with x staged once per step for the 4 warps and a barrier a step; FASTAWQ_GEMM_STAGE_X=1,
# x staged once a block in the mma's A order (at most 16 steps a block at one m-tile, 8 above:
# automatic splits are cut that fine, forced ones of 1 and 3 splits at 64 steps run the ring form),
# with and without its weight ring filled before the PDL wait (FASTAWQ_GEMV_EARLY_LOADS=1). (Every
# mode keeps the weights' ring items in the layout's row order, since session 36.)
X_MODES = {
    "shared_x": {"FASTAWQ_GEMM_SHARE_X": "1"},
    "staged_x": {"FASTAWQ_GEMM_STAGE_X": "1"},
    "staged_x_early": {"FASTAWQ_GEMM_STAGE_X": "1", "FASTAWQ_GEMV_EARLY_LOADS": "1"},
}


@requires_kernel
@pytest.mark.parametrize("mode", list(X_MODES))
@pytest.mark.parametrize("m_tiles,chunks", [(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("splits", [0, 1, 3, 64])
@pytest.mark.parametrize("m", [5, 16, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_x_modes(monkeypatch, mode, m_tiles, chunks, splits, m, dtype):
    # Automatic (0) and forced tiles and splits, down to one step a block (64 splits).
    for name, value in X_MODES[mode].items():
        monkeypatch.setenv(name, value)
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m_tiles + chunks + splits + m)
    for seed in (m, m + 100):  # a second call: the workspace was re-zeroed
        x = random_input((m, k), "cuda", dtype, seed=seed)
        bias = random_input((n,), "cuda", dtype, seed=3) if seed > 100 else None
        out = _poisoned_call(x, wp, sz, n, g, bias, m_tiles, chunks, splits)
        assert_close_to_reference(out, x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("mode,dtype", [("shared_x", torch.float16), ("staged_x", torch.bfloat16)])
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [16, 33, 129])
def test_x_modes_shapes(monkeypatch, mode, dtype, k, n, g, m):
    for name, value in X_MODES[mode].items():
        monkeypatch.setenv(name, value)
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)


@requires_kernel
def test_staged_x_runs_the_staged_instance(monkeypatch):
    # The switch reaches the launch: the kernel's last template argument is its x mode (2: staged),
    # and a forced split too coarse for the staged region falls back to the ring form (0).
    import re

    k, n, g, m = 4096, 392, 128, 16
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)

    def x_modes(splits):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.fastawq.awq_gemm_packed(x, wp, sz, n, g, None, 0, 0, splits)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "awq_gemm_packed_kernel" in e.name]
        return {int(re.search(r"awq_gemm_packed_kernel<[^<>]*, (\d+)>", name).group(1)) for name in names}

    monkeypatch.setenv("FASTAWQ_GEMM_STAGE_X", "1")
    assert x_modes(0) == {2}
    assert x_modes(2) == {0}  # 64 steps a block: more than the staged region holds
    monkeypatch.setenv("FASTAWQ_GEMM_STAGE_X", "0")
    assert x_modes(0) == {0}


def check_llama_shape(call, k: int, n: int, m: int, dtype) -> None:
    """call(x, wp, sz, n, g) on a Llama-3-8B layer shape (g128) against the reference."""
    g = 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(call(x, wp, sz, n, g), x, qw, s, qz, g)


def check_extreme_activations(call, scale: float, dtype) -> None:
    """Weights dequantized to x's dtype before the mma (fp32 sums): activations in the thousands and
    tiny ones both stay within what dequantize-then-matmul in that dtype gets."""
    k, n, g, m = 4096, 264, 128, 40
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=5)
    x = (random_input((m, k), "cuda", torch.float32, seed=m) * scale).to(dtype)
    x[:, 7] = 4000.0 if scale > 1 else x[:, 7]
    assert_close_to_reference(call(x, wp, sz, n, g), x, qw, s, qz, g)


def check_weight_errors_are_named(op, m: int = 20) -> None:
    """The layout checks every packed op shares, with their messages."""
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    with pytest.raises(RuntimeError, match="wpacked must be int32"):
        op(x, wp[:16], sz, n, g, None)
    with pytest.raises(RuntimeError, match="szpacked must be"):
        op(x, wp, sz.to(torch.bfloat16), n, g, None)
    with pytest.raises(RuntimeError, match="group_size"):
        op(x, wp, sz, n, 48, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, wp, sz, n, g, random_input((n + 8,), "cuda", torch.float16))


@requires_kernel
@pytest.mark.parametrize("k,n", LLAMA3_8B_SHAPES)
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_llama_shapes(k, n, m, dtype):
    check_llama_shape(_poisoned_call, k, n, m, dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [300.0, 1e-3])
def test_large_and_small_activations(scale, dtype):
    check_extreme_activations(_poisoned_call, scale, dtype)


@requires_kernel
@pytest.mark.parametrize("m", [16, 70])
def test_cuda_graph_replay_with_changed_inputs(m):
    check_graph_replay(torch.ops.fastawq.awq_gemm_packed, m)


@requires_kernel
@pytest.mark.parametrize("m", [1, 33, 130])
def test_opcheck(m):
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_gemm_packed.default, (x, wp, sz, n, g, bias))
    torch.library.opcheck(torch.ops.fastawq.awq_gemm_packed.default, (x, wp, sz, n, g, None, 2, 2, 4))


@requires_kernel
def test_bad_inputs_are_named():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((20, k), "cuda", torch.float16)
    op = torch.ops.fastawq.awq_gemm_packed
    with pytest.raises(RuntimeError, match="m_tiles must be 1, 2 or 4.*m_tiles=3"):
        op(x, wp, sz, n, g, None, 3, 0, 0)
    with pytest.raises(RuntimeError, match="chunks 1 or 2.*chunks=2"):
        op(x, wp, sz, n, g, None, 4, 2, 0)
    with pytest.raises(RuntimeError, match="splits must be in 1..K/32.*9"):
        op(x, wp, sz, n, g, None, 0, 0, 9)
    check_weight_errors_are_named(op)


def test_dispatch_names_the_kernel_above_the_swap_ab_bucket(monkeypatch):
    # Above backend.PACKED_MMA_MAX_M the compiled backend (when forced, or once PACKED_GEMM_MAX_M
    # puts it in the automatic choice) is awq_gemm_packed; a bound not above the swap-AB one adds
    # no bucket. (awq_wgmma_packed's own bucket off: test_wgmma_packed.py checks it.)
    from fastawq import backend
    from fastawq.ops.repack import _compiled_packed_op

    monkeypatch.setattr(backend, "PACKED_WGMMA", False)

    assert _compiled_packed_op(None) == "awq_gemm_packed"
    assert _compiled_packed_op(backend.PACKED_MMA_MAX_M) == "awq_mma_packed"
    monkeypatch.setattr(backend, "PACKED_GEMM_MAX_M", 0)
    assert backend.size_buckets("packed_gemm") == [backend.PACKED_GEMV_MAX_M, backend.PACKED_MMA_MAX_M, None]
    monkeypatch.setattr(backend, "PACKED_GEMM_MAX_M", 64)
    assert backend.size_buckets("packed_gemm") == [backend.PACKED_GEMV_MAX_M, backend.PACKED_MMA_MAX_M, 64, None]
    assert _compiled_packed_op(64) == "awq_gemm_packed"
    monkeypatch.setattr(backend._ext, "has_op", lambda name: True)
    assert backend.packed_fused_max_batch() == 64
    assert backend.preferred_layout(torch.device("cuda"), 64) == "packed"
    monkeypatch.setattr(backend._ext, "has_op", lambda name: name != "awq_gemm_packed")
    assert backend.packed_fused_max_batch() == backend.PACKED_MMA_MAX_M


@requires_kernel
@pytest.mark.parametrize("m", [17, 100])
def test_packed_gemm_forced_cuda_above_the_buckets(m):
    from fastawq import ops

    k, n, g = 1024, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=m)
    x = random_input((m, k), "cuda", torch.float16, seed=m)
    plan = ops.packed_gemm_plan(x, wp, sz, n, g, backend="cuda")
    assert_close_to_reference(plan(x), x, qw, s, qz, g)
