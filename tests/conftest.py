"""Shared fixtures. Without a GPU, Triton kernels run under the interpreter on CPU tensors."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests check correctness with the heuristic configs (test_triton checks every tuning candidate);
# tuning every shape would only cost time.
os.environ.setdefault("FASTAWQ_TRITON_TUNE", "0")
# The suite compares CPU outputs with the fp32 oracle and with pseudo-quantized logits at fp32
# tolerances, so it runs the exact CPU kernels. The default on AVX2-only CPUs (int8 activations)
# is tested against its own oracle where a test sets FASTAWQ_CPU_ACT or isa= itself
# (test_cpu_kernel, test_cpu_backend, test_cpu_fused).
os.environ.setdefault("FASTAWQ_CPU_ACT", "exact")

import pytest  # noqa: E402

from fastawq import reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# The four layer shapes (K, N) of Llama-3-8B.
LLAMA3_8B_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def random_awq(k: int, n: int, group_size: int, device="cpu", dtype=torch.float16, seed: int = 0):
    """Fresh random packed weights: every nibble and zero point uniform in [0, 15]."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = reference.resolve_group_size(group_size, k)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.002).to(dtype)
    return (
        reference.pack_int4(q).to(device),
        s.to(device),
        reference.pack_int4(z).to(device),
    )


def exact_awq_problem(k: int, n: int, group_size: int, rows: int, scale_dtype, x_dtype, seed: int = 11):
    """(x, qweight, scales, qzeros, g) whose product is exact in every precision involved.

    Scales in {1/4, 1/8} and 8 nonzeros of x in {-1, 1} per row keep every partial sum a multiple
    of 1/8 below 2^10, so a kernel must equal the oracle bit for bit: any nibble-order,
    zero-point or tail error shows."""
    gen = torch.Generator().manual_seed(seed)
    g = reference.resolve_group_size(group_size, k)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32)
    s = (2.0 ** -torch.randint(2, 4, (k // g, n), generator=gen)).to(scale_dtype)
    x = torch.zeros(rows, k)
    for row in range(rows):
        cols = torch.randperm(k, generator=gen)[:8]
        x[row, cols] = torch.randint(0, 2, (8,), generator=gen).float() * 2 - 1
    return x.to(x_dtype), reference.pack_int4(q), s, reference.pack_int4(z), g


def random_input(shape, device="cpu", dtype=torch.float16, seed: int = 1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def same_dtype_error(x, qweight, scales, qzeros, g, bias=None) -> float:
    """Max abs error of plain torch in x's dtype (dequantize, then matmul) against the fp32 oracle:
    the yardstick for what a kernel of that precision can do."""
    ref = reference.awq_gemm(x.float(), qweight, scales.float(), qzeros, g, None if bias is None else bias.float())
    w = reference.dequantize(qweight, scales, qzeros, g).to(x.dtype)
    if x.device.type == "cpu" and x.dtype == torch.float16:
        # CPU fp16 matmul accumulates in fp32 anyway; model the output rounding instead.
        y = (x.float() @ w.float()).to(x.dtype)
    else:
        y = x @ w
    if bias is not None:
        y = y + bias
    return (y.float() - ref).abs().max().item()


def assert_close_to_reference(out, x, qweight, scales, qzeros, g, bias=None, factor: float = 4.0,
                              slack: float = 0.0):
    """`slack`: extra absolute error the caller can justify (e.g. x itself rounded differently)."""
    assert not torch.isnan(out).any() and not torch.isinf(out).any(), "output has NaN/inf (unwritten?)"
    ref = reference.awq_gemm(x.float(), qweight, scales.float(), qzeros, g, None if bias is None else bias.float())
    err = (out.float() - ref).abs().max().item()
    budget = slack + factor * same_dtype_error(x, qweight, scales, qzeros, g, bias) + 1e-2 * ref.abs().max().item() * (
        2**-8 if x.dtype == torch.float16 else 2**-5
    )
    assert err <= budget, f"max error {err:.4g} > budget {budget:.4g} (ref max {ref.abs().max().item():.4g})"


def spy_fp32_first_argument(monkeypatch, op_name: str) -> list[bool]:
    """Wrap torch.ops.fastawq.<op_name> where it is built: each call appends to the returned list
    whether its first argument is fp32 (the sums handoffs' checks that the fp32 path ran)."""
    from fastawq import _ext

    seen: list[bool] = []
    if _ext.has_op(op_name):
        real = getattr(torch.ops.fastawq, op_name)

        def spy(first, *args):
            seen.append(first.dtype == torch.float32)
            return real(first, *args)

        monkeypatch.setattr(torch.ops.fastawq, op_name, spy)
    return seen
