"""The compiled ops (fastawq._C) against reference.py on the GPU. Skipped without CUDA or _C."""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext, ops, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _ext.has_op("awq_gemm"), reason="fastawq._C is not built/loaded"),
]

DTYPES = [torch.float16, torch.bfloat16]
MS = [1, 7, 16, 127, 128, 129, 1024]
GROUPS = [32, 64, 128, -1]
# Small shapes with odd tile counts: N not a multiple of the 128-column tile, K of a few tiles.
SMALL_SHAPES = [(128, 32), (384, 160), (512, 544), (1152, 96)]


def _poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the caching allocator's free blocks, so an unwritten output shows up as NaN."""
    torch.empty(numel + 4096, dtype=dtype, device="cuda").fill_(float("nan"))


def _gemm(x, qw, s, qz, g, bias=None, path=0, split_k=0):
    _poison_allocator(x.shape[0] * qw.shape[1] * 8, x.dtype)
    if path == 0 and split_k == 0:
        return torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, bias)
    return torch.ops.fastawq.awq_gemm_config(x, qw, s, qz, g, bias, path, split_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SMALL_SHAPES + LLAMA3_8B_SHAPES[:2])
def test_dequantize_exact(shape, group, dtype):
    k, n = shape
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=k + n + group)
    g = reference.resolve_group_size(group, k)
    _poison_allocator(k * n, dtype)
    out = torch.ops.fastawq.awq_dequantize(qw, s, qz, g)
    torch.testing.assert_close(out, reference.dequantize(qw, s, qz, g), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_gemm_small_shapes(shape, group, m, dtype):
    k, n = shape
    g = reference.resolve_group_size(group, k)
    if k % g:
        pytest.skip(f"K={k} not divisible by group {g}")
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=m + k)
    x = random_input((m, k), "cuda", dtype, seed=m)
    bias = random_input((n,), "cuda", dtype, seed=7) if m % 2 else None
    # auto, tensor-core (default width), dequant+cuBLAS, 4 warps, 8 warps, 4 warps with 128-row stages
    for path in (0, 1, 2, 3, 4, 5):
        out = _gemm(x, qw, s, qz, g, bias, path=path)
        assert_close_to_reference(out, x, qw, s, qz, g, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("shape", LLAMA3_8B_SHAPES)
def test_gemm_llama_shapes(shape, group, m, dtype):
    k, n = shape
    g = reference.resolve_group_size(group, k)
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=k * 3 + n)
    x = random_input((m, k), "cuda", dtype, seed=m + 11)
    out = _gemm(x, qw, s, qz, g)
    assert_close_to_reference(out, x, qw, s, qz, g)
    if m in (1, 16, 129, 1024):  # both tensor-core widths (auto takes dequantize + cuBLAS above M=32)
        for path in (3, 4, 5):
            assert_close_to_reference(_gemm(x, qw, s, qz, g, path=path), x, qw, s, qz, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("group", [32, 64])
def test_gemm_forced_split_k(split_k, group, dtype):
    k, n = 2048, 640
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=split_k)
    x = random_input((33, k), "cuda", dtype, seed=split_k)
    bias = random_input((n,), "cuda", dtype, seed=3)
    for path in (3, 4, 5, 3):  # later launches reuse the split-K tile counters
        out = _gemm(x, qw, s, qz, group, bias, path=path, split_k=split_k)
        assert_close_to_reference(out, x, qw, s, qz, group, bias)


GEMV_MS = [1, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", GEMV_MS)
@pytest.mark.parametrize("group", [32, 64, 96, 128, -1])
@pytest.mark.parametrize("shape", [(96, 32), (192, 160), (576, 544), (1152, 96), (2048, 1056)])
def test_gemv(shape, group, m, dtype):
    """The CUDA-core decode kernel (path 6): columns straddling its 64/128/256-column tiles, K of a
    few 32-row batches, groups that do not divide its 32..128-row chunks, auto and forced splits."""
    k, n = shape
    g = reference.resolve_group_size(group, k)
    if k % g:
        pytest.skip(f"K={k} not divisible by group {g}")
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=m * 7 + k + n)
    x = random_input((m, k), "cuda", dtype, seed=m + 3)
    bias = random_input((n,), "cuda", dtype, seed=5) if m % 2 else None
    # 7: the prefetching variant (M = 1; larger M runs path 6's kernel); 8, 9: cp.async-staged (M <= 2)
    for path in (6, 7, 8, 9) if m <= 2 else (6, 7):
        for split_k in (0, 1, 3, 1000):
            out = _gemm(x, qw, s, qz, g, bias, path=path, split_k=split_k)
            assert_close_to_reference(out, x, qw, s, qz, g, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", LLAMA3_8B_SHAPES)
def test_gemv_llama_shapes(shape, m, dtype):
    k, n = shape
    qw, s, qz = random_awq(k, n, 128, "cuda", dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    for path in (6, 7, 8, 9) if m <= 2 else (6, 7):
        assert_close_to_reference(_gemm(x, qw, s, qz, 128, path=path), x, qw, s, qz, 128)


def test_gemv_graph_replay_split_k():
    """Split-K GEMV re-zeroes its workspace and counters: replays and a second layer sharing them
    stay correct."""
    k, n, g = 4096, 1024, 128
    a = random_awq(k, n, g, "cuda", torch.float16, seed=1)
    b = random_awq(k, 2 * n, g, "cuda", torch.float16, seed=2)
    x = random_input((1, k), "cuda", torch.float16)
    torch.ops.fastawq.awq_gemm_config(x, *a, g, None, 6, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a = torch.ops.fastawq.awq_gemm_config(x, *a, g, None, 6, 16)
        out_b = torch.ops.fastawq.awq_gemm_config(x, *b, g, None, 6, 7)
        out_c = torch.ops.fastawq.awq_gemm_config(x, *b, g, None, 8, 5)
    for seed in (5, 6, 7):
        x.copy_(random_input((1, k), "cuda", torch.float16, seed=seed))
        graph.replay()
        assert_close_to_reference(out_a, x, *a, g)
        assert_close_to_reference(out_b, x, *b, g)
        assert_close_to_reference(out_c, x, *b, g)


def test_gemv_rejects_unsupported_shape():
    k, n, g = 256, 200, 64  # N/8 = 25 is not a multiple of the 4 words a lane reads at M=1
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    with pytest.raises(RuntimeError, match=r"GEMV kernel needs .*n=200"):
        torch.ops.fastawq.awq_gemm_config(x, qw, s, qz, g, None, 6, 0)
    assert_close_to_reference(torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, None), x, qw, s, qz, g)


def test_gemm_cuda_graph_replay():
    k, n, g = 4096, 4096, 128
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, None)
    for seed in (5, 6):
        x.copy_(random_input((1, k), "cuda", torch.float16, seed=seed))
        graph.replay()
        assert_close_to_reference(out, x, qw, s, qz, g)


def test_public_op_dispatches_to_cuda():
    k, n, g = 512, 256, 128
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((3, 5, k), "cuda", torch.bfloat16)
    out = ops.awq_gemm(x, qw, s, qz, g, backend="cuda")  # ops casts scales to x's dtype
    assert out.shape == (3, 5, n) and out.dtype == torch.bfloat16
    assert_close_to_reference(out.reshape(15, n), x.reshape(15, k), qw, s.to(torch.bfloat16), qz, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 129])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("shape", [(256, 384), (1152, 640), (4096, 4096), (14336, 4096)])
def test_gemm_tiled(shape, group, m, dtype):
    k, n = shape
    g = reference.resolve_group_size(group, k)
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=m + n)
    x = random_input((m, k), "cuda", dtype, seed=m)
    bias = random_input((n,), "cuda", dtype, seed=9) if m % 2 else None
    qt = torch.ops.fastawq.awq_repack_tiled(qw)
    _poison_allocator(m * n, dtype)
    for split_k in (0, 3):
        out = torch.ops.fastawq.awq_gemm_tiled(x, qt, s, qz, g, bias, split_k)
        assert_close_to_reference(out, x, qw, s, qz, g, bias)


@pytest.mark.parametrize("m", [1, 64])
def test_opcheck(m):
    k, n, g = 256, 128, 64
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_gemm.default, (x, qw, s, qz, g, bias))
    torch.library.opcheck(torch.ops.fastawq.awq_gemm.default, (x, qw, s, qz, g, None))
    torch.library.opcheck(torch.ops.fastawq.awq_dequantize.default, (qw, s, qz, g))
    torch.library.opcheck(torch.ops.fastawq.awq_gemm_config.default, (x, qw, s, qz, g, bias, 1, 2))
    qt = torch.ops.fastawq.awq_repack_tiled(qw)
    torch.library.opcheck(torch.ops.fastawq.awq_repack_tiled.default, (qw,))
    torch.library.opcheck(torch.ops.fastawq.awq_gemm_tiled.default, (x, qt, s, qz, g, bias, 0))


def _bad_inputs():
    k, n, g = 256, 128, 64
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((4, k), "cuda", torch.float16)
    return x, qw, s, qz, g


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x, qw, s, qz, g: (x.float(), qw, s, qz, g), "x must be fp16 or bf16"),
        (lambda x, qw, s, qz, g: (x, qw, s.to(torch.bfloat16), qz, g), "scales must have x's dtype"),
        (lambda x, qw, s, qz, g: (x[:, :128], qw, s, qz, g), r"x must be \[M, K=256\]"),
        (lambda x, qw, s, qz, g: (x.t().contiguous().t(), qw, s, qz, g), "must be contiguous"),
        (lambda x, qw, s, qz, g: (x, qw, s, qz, 96), "not divisible by group_size=96"),
        (lambda x, qw, s, qz, g: (x, qw, s[:2], qz, g), "inconsistent shapes"),
        (lambda x, qw, s, qz, g: (x, qw.float(), s, qz, g), "must be int32"),
    ],
)
def test_gemm_rejects_bad_inputs(mutate, message):
    args = mutate(*_bad_inputs())
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastawq.awq_gemm(*args, None)


def test_dequantize_rejects_bad_group():
    _, qw, s, qz, _ = _bad_inputs()
    with pytest.raises(RuntimeError, match="not divisible by group_size=96"):
        torch.ops.fastawq.awq_dequantize(qw, s, qz, 96)
