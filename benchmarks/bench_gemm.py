"""pytest-benchmark microbenchmarks of awq_gemm per backend against torch.matmul on dense weights (fp16 on GPU, fp32 on CPU).

    python -m pytest benchmarks/bench_gemm.py --benchmark-columns=median,ops
On a GPU: the Llama-3-8B shapes at M = 1, 16, 256 with every available backend. On CPU: a small
shape with the torch and CPU backends. The GPU suite's table (gemm_table.py) is the measurement
of record; these are for quick comparisons while working on a kernel.
"""
from __future__ import annotations

import pytest
import torch

from fastawq import _ext, backend, ops

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPES = [(4096, 4096), (14336, 4096)] if CUDA else [(1024, 1024)]
MS = [1, 16, 256] if CUDA else [1, 16]
BACKENDS = (["cuda"] if _ext.has_op("awq_gemm") else []) + (["triton"] if backend.triton_available() else []) + ["torch"]
if not CUDA:
    BACKENDS = ["cpu", "torch"]
DTYPE = torch.float16 if CUDA else torch.float32
ROTATE = 8  # weight buffers per case, so a GPU run does not time L2 hits


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _packed(k, n, g=128):
    out = []
    for i in range(ROTATE):
        gen = torch.Generator(device="cpu").manual_seed(i)
        q = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int32)
        z = torch.randint(-(2**31), 2**31 - 1, (k // g, n // 8), generator=gen, dtype=torch.int32)
        s = torch.rand(k // g, n, generator=gen) * 0.01 + 1e-3
        out.append((q.to(DEVICE), s.to(DEVICE, DTYPE), z.to(DEVICE)))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}N{s[1]}")
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("be", BACKENDS + ["matmul_dense"])
def test_awq_gemm(benchmark, be, m, shape):
    k, n = shape
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    state = {"i": 0}
    if be == "matmul_dense":
        ws = [torch.randn(k, n, device=DEVICE, dtype=DTYPE) for _ in range(ROTATE)]

        def fn():
            state["i"] = (state["i"] + 1) % ROTATE
            torch.matmul(x, ws[state["i"]])
            _sync()
    else:
        packed = _packed(k, n)
        if be == "torch" and CUDA and m > 16:
            pytest.skip("the reference is not a contender at large M")

        def fn():
            state["i"] = (state["i"] + 1) % ROTATE
            ops.awq_gemm(x, *packed[state["i"]], 128, backend=be)
            _sync()

    fn()  # compile / tune / repack outside the timing
    benchmark(fn)
