"""The compiled ops (fastawq._C) against reference.py on the GPU, and the kernels' fit rules
(awq_gemm_declines, no tensors) on any machine whose _C holds the CUDA ops."""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext, ops, reference

pytestmark = pytest.mark.skipif(not _ext.has_op("awq_gemm"), reason="fastawq._C is not built with CUDA ops")


def gpu(fn):
    """A test that launches kernels: skipped without a CUDA device."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


DTYPES = [torch.float16, torch.bfloat16]
MS = [1, 7, 16, 127, 128, 129, 1024]
GROUPS = [32, 64, 128, -1]
# Small shapes with odd tile counts: N not a multiple of the 128-column tile, K of a few tiles.
SMALL_SHAPES = [(128, 32), (384, 160), (512, 544), (1152, 96)]
KERNELS = ["auto", "gemv", "gemv_staged", "mma", "dequant_cublas"]


def declines(kernel: str, m: int, n: int, k: int, g: int) -> str:
    return torch.ops.fastawq.awq_gemm_declines(kernel, m, n, k, g)


def _poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the caching allocator's free blocks, so an unwritten output shows up as NaN."""
    torch.empty(numel + 4096, dtype=dtype, device="cuda").fill_(float("nan"))


def _gemm(x, qw, s, qz, g, bias=None, kernel="auto"):
    _poison_allocator(x.shape[0] * qw.shape[1] * 8, x.dtype)
    return torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, bias, kernel)


def _every_kernel_that_fits(x, qw, s, qz, g, bias=None):
    """Run each named kernel that takes the problem; a declining one must raise with its reason."""
    m, k = x.shape
    n = qw.shape[1] * 8
    ran = []
    for kernel in KERNELS:
        why = declines(kernel, m, n, k, g)
        if why:
            with pytest.raises(RuntimeError, match="declines the problem"):
                _gemm(x, qw, s, qz, g, bias, kernel)
            continue
        assert_close_to_reference(_gemm(x, qw, s, qz, g, bias, kernel), x, qw, s, qz, g, bias)
        ran.append(kernel)
    assert "auto" in ran and "dequant_cublas" in ran
    return ran


# --- fit rules: no GPU needed -------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_declines_takes_the_plain_decode_shape(kernel):
    assert declines(kernel, 1, 4096, 4096, 128) == ""


@pytest.mark.parametrize(
    "kernel, m, n, k, g, reason",
    [
        ("gemv", 3, 4096, 4096, 128, "M <= 2"),
        ("gemv_staged", 8, 4096, 4096, 128, "M <= 2"),
        ("gemv", 1, 4096, 4096 + 16, 16, "multiples of 32"),
        ("gemv", 1, 4096, 4096, 16, "multiples of 32"),
        ("gemv", 1, 200, 256, 64, "N/8 a multiple of 4"),
        ("mma", 16, 200, 256, 64, "N % 32"),
        ("mma", 16, 256, 272, 16, "multiples of 32"),
        ("dequant_cublas", 16, 100, 256, 64, "multiple of 8"),
        ("mma", 1, 256, 250, 64, "not a multiple of group_size"),
        ("warp9", 1, 256, 256, 64, "unknown kernel"),
    ],
)
def test_declines_names_the_reason(kernel, m, n, k, g, reason):
    assert reason in declines(kernel, m, n, k, g)


def test_declines_edges():
    # Larger M never makes mma or dequant_cublas decline: "auto" owns the size threshold.
    assert declines("mma", 4096, 256, 256, 64) == "" and declines("dequant_cublas", 4096, 256, 256, 64) == ""
    assert declines("gemv", 2, 32, 32, 32) == "" and declines("gemv_staged", 2, 32, 32, 32) == ""
    assert declines("auto", 5, 12, 7, 7) == ""  # dequantize + cuBLAS takes the rest


# --- kernels against the reference ---------------------------------------------------------------


@gpu
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


@gpu
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
    ran = _every_kernel_that_fits(x, qw, s, qz, g, bias)
    assert "mma" in ran


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("shape", LLAMA3_8B_SHAPES)
def test_gemm_llama_shapes(shape, group, m, dtype):
    k, n = shape
    g = reference.resolve_group_size(group, k)
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=k * 3 + n)
    x = random_input((m, k), "cuda", dtype, seed=m + 11)
    assert_close_to_reference(_gemm(x, qw, s, qz, g), x, qw, s, qz, g)
    if m in (1, 16, 129, 1024):  # the tensor-core kernel at every row-block size, also past "auto"'s M
        assert_close_to_reference(_gemm(x, qw, s, qz, g, kernel="mma"), x, qw, s, qz, g)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17, 33])
@pytest.mark.parametrize("group", [32, 64])
def test_gemm_split_k_counters_are_reused(m, group, dtype):
    """K = 2048 makes the tensor-core kernel split K; later launches (other M blocks, the GEMV)
    reuse the self-resetting tile counters."""
    k, n = 2048, 640
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    bias = random_input((n,), "cuda", dtype, seed=3)
    for kernel in ("mma", "gemv", "mma", "gemv_staged", "mma"):
        if declines(kernel, m, n, k, group):
            continue
        assert_close_to_reference(_gemm(x, qw, s, qz, group, bias, kernel), x, qw, s, qz, group, bias)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("group", [32, 64, 96, 128, -1])
@pytest.mark.parametrize("shape", [(96, 32), (192, 160), (576, 544), (1152, 96), (2048, 1056), (4096, 288)])
def test_gemv(shape, group, m, dtype):
    """The CUDA-core decode kernels: columns straddling their 256-column tile, K of a few 32-row
    batches, groups that do not divide their 32..128-row chunks, K long enough to split."""
    k, n = shape
    g = reference.resolve_group_size(group, k)
    if k % g:
        pytest.skip(f"K={k} not divisible by group {g}")
    qw, s, qz = random_awq(k, n, group, "cuda", dtype, seed=m * 7 + k + n)
    x = random_input((m, k), "cuda", dtype, seed=m + 3)
    bias = random_input((n,), "cuda", dtype, seed=5) if m % 2 else None
    for kernel in ("gemv", "gemv_staged"):
        assert declines(kernel, m, n, k, g) == ""
        assert_close_to_reference(_gemm(x, qw, s, qz, g, bias, kernel), x, qw, s, qz, g, bias)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("shape", LLAMA3_8B_SHAPES)
def test_gemv_llama_shapes(shape, m, dtype):
    k, n = shape
    qw, s, qz = random_awq(k, n, 128, "cuda", dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    for kernel in ("gemv", "gemv_staged"):
        assert_close_to_reference(_gemm(x, qw, s, qz, 128, kernel=kernel), x, qw, s, qz, 128)


@gpu
def test_gemv_graph_replay_split_k():
    """Split-K GEMV re-zeroes its workspace and counters: replays and a second layer sharing them
    stay correct."""
    k, n, g = 4096, 1024, 128
    a = random_awq(k, n, g, "cuda", torch.float16, seed=1)
    b = random_awq(k, 2 * n, g, "cuda", torch.float16, seed=2)
    x = random_input((1, k), "cuda", torch.float16)
    torch.ops.fastawq.awq_gemm(x, *a, g, None, "gemv")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a = torch.ops.fastawq.awq_gemm(x, *a, g, None, "gemv")
        out_b = torch.ops.fastawq.awq_gemm(x, *b, g, None, "gemv")
        out_c = torch.ops.fastawq.awq_gemm(x, *b, g, None, "gemv_staged")
        out_d = torch.ops.fastawq.awq_gemm(x, *a, g, None, "mma")
    for seed in (5, 6, 7):
        x.copy_(random_input((1, k), "cuda", torch.float16, seed=seed))
        graph.replay()
        assert_close_to_reference(out_a, x, *a, g)
        assert_close_to_reference(out_b, x, *b, g)
        assert_close_to_reference(out_c, x, *b, g)
        assert_close_to_reference(out_d, x, *a, g)


@gpu
@pytest.mark.parametrize("case", ["shape", "unknown", "misaligned"])
def test_named_kernel_rejects(case):
    k, g = 256, 64
    n = 256 if case == "misaligned" else 200  # N/8 = 25 is not a multiple of a GEMV lane's 4 words
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    if case == "misaligned":  # contiguous, 2 bytes past a 16-byte boundary
        x = torch.empty(k + 8, dtype=torch.float16, device="cuda")[1 : k + 1].view(1, k).copy_(x)
        expect = {kn: "16-byte aligned" for kn in ("gemv", "gemv_staged", "mma")}
    elif case == "unknown":
        expect = {"path6": r"unknown kernel 'path6' \(m=1, n=200"}
    else:
        problem = r"\(m=1, n=200, k=256, group_size=64\)"
        expect = {kn: f"'{kn}' declines the problem {problem}" for kn in ("gemv", "gemv_staged", "mma")}
    for kernel, message in expect.items():
        with pytest.raises(RuntimeError, match=message):
            torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, None, kernel)
    # "auto" falls back to dequantize + cuBLAS.
    assert_close_to_reference(torch.ops.fastawq.awq_gemm(x, qw, s, qz, g, None), x, qw, s, qz, g)


@gpu
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


@gpu
def test_public_op_dispatches_to_cuda():
    k, n, g = 512, 256, 128
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((3, 5, k), "cuda", torch.bfloat16)
    out = ops.awq_gemm(x, qw, s, qz, g, backend="cuda")  # ops casts scales to x's dtype
    assert out.shape == (3, 5, n) and out.dtype == torch.bfloat16
    assert_close_to_reference(out.reshape(15, n), x.reshape(15, k), qw, s.to(torch.bfloat16), qz, g)


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 64])
def test_opcheck(m, kernel):
    k, n, g = 256, 128, 64
    if declines(kernel, m, n, k, g):
        pytest.skip(f"{kernel} declines M={m}")
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_gemm.default, (x, qw, s, qz, g, bias, kernel))
    torch.library.opcheck(torch.ops.fastawq.awq_gemm.default, (x, qw, s, qz, g, None, kernel))
    torch.library.opcheck(torch.ops.fastawq.awq_dequantize.default, (qw, s, qz, g))


def _bad_inputs():
    k, n, g = 256, 128, 64
    qw, s, qz = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((4, k), "cuda", torch.float16)
    return x, qw, s, qz, g


@gpu
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


@gpu
def test_dequantize_rejects_bad_group():
    _, qw, s, qz, _ = _bad_inputs()
    with pytest.raises(RuntimeError, match="not divisible by group_size=96"):
        torch.ops.fastawq.awq_dequantize(qw, s, qz, 96)
