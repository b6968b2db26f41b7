"""Public W4A16 ops: validation, backend dispatch, and fake impls for torch.compile.

Every op takes the AWQ "GEMM" layout (see reference.py) and accepts ``backend=`` to force one of
``cuda | triton | cpu | torch``; otherwise backend.select_backend decides.
"""
from __future__ import annotations

from typing import Callable

import torch

from fastawq import _ext, reference
from fastawq import backend as backend_mod
from fastawq.backend import _module, select_backend

_HALF = (torch.float16, torch.bfloat16)


def _triton():
    return _module("fastawq.triton_kernels")


def _cpu():
    return _module("fastawq.cpu")


def _check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    return next(iter(devices))


def _module_fits(mod, fn: str, *args) -> str | None:
    """A backend module may define `<op>_fits(...)` returning why it declines a call."""
    check = getattr(mod, fn, None)
    return check(*args) if check is not None else None


# x [M, K] · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8]
def _gemm_fits(
    backend: str, x2: torch.Tensor, qweight: torch.Tensor, n: int, k: int, g: int, rows: int | None = None
) -> str | None:
    if backend in ("cuda", "triton") and x2.dtype not in _HALF:
        return f"x is {x2.dtype}; the {backend} kernels take fp16 or bf16 activations"
    if backend == "cuda":
        return _cuda_gemm_fits(x2, n, k, g, rows)
    if backend == "triton":
        return _module_fits(_triton(), "awq_gemm_fits", x2, qweight, g)
    if backend == "cpu":
        return _module_fits(_cpu(), "awq_gemm_fits", x2, qweight, g)
    return None


def _cuda_gemm_fits(x2: torch.Tensor, n: int, k: int, g: int, rows: int | None) -> str | None:
    # The compiled op takes every shape check_awq_shapes accepts: inside C++ it runs the
    # tensor-core kernel when N % 32, K % 32 and G % 32 are 0 and the operands are 16-byte
    # aligned, and dequantize + cuBLAS otherwise (csrc/gemm/awq_gemm.cpp). Only an empty
    # problem is left to the reference.
    if x2.shape[0] == 0 or n == 0 or k == 0:
        return f"empty problem (M={x2.shape[0]}, N={n}, K={k})"
    # The small-M bucket is served by the compiled op for its GEMV kernel (csrc/gemv/); shapes
    # the GEMV declines would go to dequantize + cuBLAS there, so decline them (Triton serves).
    if rows is not None and rows <= backend_mod.CUDA_GEMV_MAX_M and (k % 32 or g % 32 or n % 32):
        return f"the compiled GEMV needs K, N and group_size multiples of 32 (K={k}, N={n}, group_size={g})"
    return None


# x [..., K] fp16/bf16 · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32 · bias [N]  ->  [..., N]
def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(qweight, scales, qzeros) + bias, accumulated in fp32, in x's dtype."""
    return awq_gemm_plan(x, qweight, scales, qzeros, group_size, bias, backend=backend)(x)


def awq_gemm_plan(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Validate once and bind the backend for activations like `x` (same device, dtype and K).

    The returned function computes awq_gemm for any such activations with a reshape and one
    backend call: a quantized layer caches it, so decoding pays neither validation nor dispatch
    per call. Its `.backend` attribute names the backend chosen ("cuda/triton": by M, see
    backend.size_buckets).
    """
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, group_size)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must end in K={k} to match qweight {tuple(qweight.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} must have shape ({n},) to match qweight {tuple(qweight.shape)}")
    device = _check_same_device(x=x, qweight=qweight, scales=scales, qzeros=qzeros, bias=bias)
    # The choice depends on the call's M only through the measured size buckets (backend.py), so
    # a plan binds one kernel per bucket and picks by M with one comparison.
    probe = x.reshape(-1, k)[:1] if x.numel() else x.new_empty((1, k))
    bounds = backend_mod.size_buckets("awq_gemm") if device.type == "cuda" else [None]
    chosen = [
        select_backend(
            "awq_gemm", device, backend=backend, m=bound,
            shapes_ok=lambda b, rows=bound: _gemm_fits(b, probe, qweight, n, k, g, rows),
        )
        for bound in bounds
    ]
    if len(set(chosen)) == 1:
        bounds, chosen = [None], chosen[:1]
    buckets = [
        (bound, be, _bind_gemm(be, x.dtype, qweight, scales, qzeros, g, bias)) for bound, be in zip(bounds, chosen)
    ]

    if len(buckets) == 1:
        kernel = buckets[0][2]
    else:
        def kernel(x2):
            rows = x2.shape[0]
            for bound, _, fn in buckets:
                if bound is None or rows <= bound:
                    return fn(x2)
            raise AssertionError("the last bucket is unbounded")

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], n))
        return kernel(x2).reshape(*x.shape[:-1], n)

    be = "/".join(dict.fromkeys(be for _, be, _ in buckets))
    run.backend = be
    return run


def _bind_gemm(be: str, dtype: torch.dtype, qweight, scales, qzeros, g: int, bias) -> Callable[[torch.Tensor], torch.Tensor]:
    if be != "torch" and bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if be == "torch":
        return lambda x2: reference.awq_gemm(x2, qweight, scales, qzeros, g, bias)
    if be == "cuda":
        scales_x = scales if scales.dtype == dtype else scales.to(dtype)
        return lambda x2: torch.ops.fastawq.awq_gemm(x2.contiguous(), qweight, scales_x, qzeros, g, bias)
    impl = (_triton() if be == "triton" else _cpu()).awq_gemm
    return lambda x2: impl(x2, qweight, scales, qzeros, g, bias)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  w [K, N] (scales' dtype)
def awq_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, group_size)
    device = _check_same_device(qweight=qweight, scales=scales, qzeros=qzeros)

    def fits(b: str) -> str | None:
        if b in ("cuda", "triton") and scales.dtype not in _HALF:
            return f"scales are {scales.dtype}; the {b} kernels produce fp16 or bf16"
        if b == "cuda" and n % 8 != 0:
            return f"N={n} is not a multiple of 8"
        return None

    be = select_backend("awq_dequantize", device, backend=backend, shapes_ok=fits)
    if be == "cuda":
        return torch.ops.fastawq.awq_dequantize(qweight, scales, qzeros, g)
    if be == "triton":
        return _triton().awq_dequantize(qweight, scales, qzeros, g)
    if be == "cpu":
        return _cpu().awq_dequantize(qweight, scales, qzeros, g)
    return reference.dequantize(qweight, scales, qzeros, g)


def _register_fakes() -> None:
    """Shapes of the compiled ops' outputs, so they trace under torch.compile."""
    if _ext.has_op("awq_gemm"):

        @torch.library.register_fake("fastawq::awq_gemm")
        def _(x, qweight, scales, qzeros, group_size, bias):
            return x.new_empty((x.shape[0], qweight.shape[1] * 8))

    if _ext.has_op("awq_dequantize"):

        @torch.library.register_fake("fastawq::awq_dequantize")
        def _(qweight, scales, qzeros, group_size):
            return scales.new_empty((qweight.shape[0], qweight.shape[1] * 8))


_register_fakes()
