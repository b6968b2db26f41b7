"""The W4A16 ops: awq_gemm (and its cached plan) and awq_dequantize, with the fake impls of the
compiled GEMM, dequantize and CPU ops.

Every op takes the AWQ "GEMM" layout (see reference.py) and accepts ``backend=`` to force one of
``cuda | triton | cpu | torch``; otherwise backend.select_backend decides.
"""
from __future__ import annotations

from typing import Callable

import torch

from fastawq import _ext, reference
from fastawq import backend as backend_mod
from fastawq.backend import select_backend
from fastawq.ops._common import HALF as _HALF
from fastawq.ops._common import check_same_device as _check_same_device
from fastawq.ops._common import cpu_module as _cpu
from fastawq.ops._common import triton_module as _triton


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
    if x2.shape[0] == 0 or n == 0 or k == 0:
        return f"empty problem (M={x2.shape[0]}, N={n}, K={k})"
    return cuda_gemm_declines(backend_mod.cuda_gemm_kernel(rows), rows or backend_mod.CUDA_GEMV_MAX_M + 1, n, k, g)


def cuda_gemm_declines(kernel: str, m: int, n: int, k: int, g: int) -> str | None:
    """None when the compiled kernel `kernel` takes an (m, n, k, g) problem, else why not.

    The fit rules (multiples of 32, alignment) have one owner, the C++ op awq_gemm_declines;
    an older fastawq._C without it (and without kernel names) counts as unavailable."""
    if not _ext.has_op("awq_gemm_declines"):
        return "the loaded fastawq._C predates named GEMM kernels (no awq_gemm_declines): rebuild fastawq"
    why = torch.ops.fastawq.awq_gemm_declines(kernel, m, n, k, g)
    return f"kernel {kernel!r} declines (M={m}, N={n}, K={k}, group_size={g}): {why}" if why else None


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
    if backend is None and x.is_cpu and backend_mod.env_switch(b"FASTAWQ_BACKEND") is None:
        # A weight already repacked for the CPU kernel skips planning (~100 us a call).
        out = _cpu().cached_gemm(x, qweight, scales, qzeros, group_size, bias)
        if out is not None:
            return out
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
    check_activations(x, bias, k, n, f"qweight {tuple(qweight.shape)}")
    device = _check_same_device(x=x, qweight=qweight, scales=scales, qzeros=qzeros, bias=bias)
    probe = x.reshape(-1, k)[:1] if x.numel() else x.new_empty((1, k))
    return plan_by_buckets(
        "awq_gemm", device, k, n, backend,
        fits=lambda be, rows: _gemm_fits(be, probe, qweight, n, k, g, rows),
        bind=lambda be, bound: _bind_gemm(be, x.dtype, qweight, scales, qzeros, g, bias,
                                          backend_mod.cuda_gemm_kernel(bound)),
        variant=lambda be, bound: backend_mod.cuda_gemm_kernel(bound) if be == "cuda" else None,
    )


def check_activations(x: torch.Tensor, bias: torch.Tensor | None, k: int, n: int, weight: str) -> None:
    """x [..., K] floating point and bias [N] for a W4 weight described by `weight` (for the message)."""
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must end in K={k} to match {weight}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} must have shape ({n},) to match {weight}")


def plan_by_buckets(
    op: str, device: torch.device, k: int, n: int, backend: str | None, *,
    fits: Callable[[str, int | None], str | None],
    bind: Callable[[str, int | None], Callable[[torch.Tensor], torch.Tensor]],
    variant: Callable[[str, int | None], object] = lambda be, bound: None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plan of a W4 GEMM op: one backend per M bucket of backend.size_buckets(op).

    fits(backend, bound) says why a backend declines the bucket (None: it takes it); bind(backend,
    bound) makes the bucket's [M, K] -> [M, N] function; variant names what a backend runs per bucket
    (the compiled kernel), so buckets that run the same thing collapse into one binding."""
    # The choice depends on the call's M only through the measured size buckets (backend.py), so
    # a plan binds one kernel per bucket and picks by M with one comparison.
    bounds = backend_mod.size_buckets(op) if device.type == "cuda" else [None]
    chosen = [
        select_backend(op, device, backend=backend, m=bound, shapes_ok=lambda b, rows=bound: fits(b, rows))
        for bound in bounds
    ]
    if len({(be, variant(be, b)) for b, be in zip(bounds, chosen)}) == 1:
        bounds, chosen = [None], chosen[:1]
    buckets = [(bound, be, bind(be, bound)) for bound, be in zip(bounds, chosen)]

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
        if x.dim() == 2 and x.shape[0]:  # [M, K] as the kernels take it: no reshapes (~3 us each on a CPU)
            return kernel(x)
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], n))
        return kernel(x2).reshape(*x.shape[:-1], n)

    be = "/".join(dict.fromkeys(be for _, be, _ in buckets))
    run.backend = be
    return run


def _bind_gemm(
    be: str, dtype: torch.dtype, qweight, scales, qzeros, g: int, bias, kernel: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    if be != "torch" and bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if be == "torch":
        return lambda x2: reference.awq_gemm(x2, qweight, scales, qzeros, g, bias)
    if be == "cuda":
        scales_x = scales if scales.dtype == dtype else scales.to(dtype)
        return lambda x2: torch.ops.fastawq.awq_gemm(x2.contiguous(), qweight, scales_x, qzeros, g, bias, kernel)
    if be == "cpu":  # repacked now: a call is one kernel call
        return _cpu().bind_gemm(dtype, qweight, scales, qzeros, g, bias)
    impl = _triton().awq_gemm
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
    """Output shapes of the compiled GEMM, dequantize and CPU ops, so they trace under
    torch.compile and pass opcheck (the one place for them; _ext.py only loads _C)."""
    if _ext.has_op("awq_gemm"):

        @torch.library.register_fake("fastawq::awq_gemm")
        def _(x, qweight, scales, qzeros, group_size, bias, kernel="auto"):
            torch._check(x.dim() == 2, lambda: f"x {tuple(x.shape)} must be [M, K]")
            torch._check(
                x.shape[1] == qweight.shape[0], lambda: f"x {tuple(x.shape)} vs qweight {tuple(qweight.shape)}"
            )
            torch._check(qweight.dtype == torch.int32, lambda: f"qweight is {qweight.dtype}, not int32")
            return x.new_empty((x.shape[0], qweight.shape[1] * 8))

    if _ext.has_op("awq_dequantize"):

        @torch.library.register_fake("fastawq::awq_dequantize")
        def _(qweight, scales, qzeros, group_size):
            torch._check(qweight.dtype == torch.int32, lambda: f"qweight is {qweight.dtype}, not int32")
            torch._check(scales.shape[1] == qweight.shape[1] * 8, lambda: f"scales {tuple(scales.shape)} vs qweight")
            return scales.new_empty((qweight.shape[0], qweight.shape[1] * 8))

    if _ext.has_op("awq_cpu_gemm"):

        @torch.library.register_fake("fastawq::awq_cpu_repack")
        def _(qweight, scales, qzeros, group_size):
            k, n = qweight.shape[0], qweight.shape[1] * 8
            torch._check(k % group_size == 0, lambda: f"K={k} is not a multiple of group_size={group_size}")
            nb, groups = (n + 63) // 64, k // group_size
            return (qweight.new_empty((nb, k // 8, 64)), scales.new_empty((nb, groups, 64), dtype=torch.float32),
                    qzeros.new_empty((nb, groups, 64), dtype=torch.uint8))

        @torch.library.register_fake("fastawq::awq_cpu_gemm")
        def _(x, w, scales, zeros16, group_size, n, bias, isa="auto"):
            torch._check(x.dim() == 2, lambda: f"x {tuple(x.shape)} must be [M, K]")
            torch._check(x.shape[1] == w.shape[1] * 8, lambda: f"x {tuple(x.shape)} vs repacked w {tuple(w.shape)}")
            return x.new_empty((x.shape[0], n))

    if _ext.has_op("awq_cpu_decode_layer"):

        @torch.library.register_fake("fastawq::awq_cpu_decode_layer")
        def _(res, x, norm1, norm2, weights, groups, ns, biases, k_cache, v_cache, pos, cos, sin_signed, q_norm,
              k_norm, num_heads, num_kv_heads, eps, scale, activation, isa="auto"):
            torch._check(res.dim() == 2, lambda: f"res {tuple(res.shape)} must be [B, H]")
            return torch.empty_like(res)


_register_fakes()
