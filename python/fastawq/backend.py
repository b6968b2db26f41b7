"""Which backend serves an op: compiled CUDA > Triton (GPU) > CPU kernels > torch reference.

This module is the only place that chooses. The user overrides it with ``backend=`` on an op or
the ``FASTAWQ_BACKEND`` environment variable; a forced backend that cannot serve the call is an
error that says why, never a silent fallback.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from fastawq import _ext

BACKENDS = ("cuda", "triton", "cpu", "torch")

# Ops each backend implements, by module: the module must define a function of the op's name.
_TRITON_MODULE = "fastawq.triton_kernels"
_CPU_MODULE = "fastawq.cpu"


# Per-op order on CUDA devices where measurement overrules "compiled first", by problem size:
# a list of (largest M, order), the first entry whose bound is >= M applies (None: any M).
# awq_gemm (benchmarks/RESULTS.md, H200, 2026-11-30): above M=8 the Triton kernels beat the
# compiled ones at every M measured (geomean vs cuBLAS at M=16/64/1024/4096: Triton
# 0.93/0.73/0.78/0.92, compiled 0.67/0.40/0.74/0.83); at M <= 8 see CUDA_GEMV_MAX_M.
CUDA_GEMV_MAX_M = 2
_CUDA_PREFERENCE: dict[str, list[tuple[int | None, tuple[str, ...]]]] = {
    "awq_gemm": [(CUDA_GEMV_MAX_M, ("cuda", "triton", "torch")), (None, ("triton", "cuda", "torch"))],
}


def size_buckets(op: str) -> list[int | None]:
    """The M bounds at which `op`'s automatic choice on CUDA may change (None: unbounded)."""
    return [bound for bound, _ in _CUDA_PREFERENCE.get(op, [(None, ())])]


def _cuda_order(op: str, m: int | None) -> tuple[str, ...]:
    for bound, order in _CUDA_PREFERENCE.get(op, []):
        if bound is None or (m is not None and m <= bound):
            return order
    return ("cuda", "triton", "torch")


class BackendUnavailableError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return _module(_TRITON_MODULE) is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _why_not(backend: str, op: str, device: torch.device, shapes_ok) -> str | None:
    """None if `backend` can run `op` on `device`; otherwise the reason, in words."""
    if backend == "torch":
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return f"tensors are on {device}, the compiled kernels run on CUDA devices"
        if not _ext.is_loaded():
            return _ext.status()["reason"]
        if not _ext.has_op(op):
            return f"the compiled extension has no op {op!r}"
        if not _ext.supports_device(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            return f"the compiled kernels were built for {_ext.built_archs()}, this GPU is sm {cap}"
        return shapes_ok("cuda")
    if backend == "triton":
        if not triton_available():
            return "triton is not installed"
        if device.type != "cuda" and not triton_interpreting():
            return f"tensors are on {device}; Triton runs on GPUs (or on CPU with TRITON_INTERPRET=1)"
        if not hasattr(_module(_TRITON_MODULE), op):
            return f"no Triton kernel for {op!r}"
        return shapes_ok("triton")
    if backend == "cpu":
        if device.type != "cpu":
            return f"tensors are on {device}, the CPU kernels run on the CPU"
        mod = _module(_CPU_MODULE)
        if mod is None or not hasattr(mod, op):
            return f"no CPU kernel for {op!r}"
        return shapes_ok("cpu")
    return f"unknown backend {backend!r}; choose one of {BACKENDS}"


def _always(_backend: str) -> None:
    return None


def select_backend(
    op: str, device: torch.device, *, backend: str | None = None, shapes_ok=_always, m: int | None = None
) -> str:
    """Pick the backend for one call of `op` on `device` (with `m` rows, where the order depends on it).

    `shapes_ok(backend)` returns None when that backend's kernels take the call's shapes and
    dtypes, else the reason; it lets a backend decline without knowing about the others.
    """
    forced = backend or os.environ.get("FASTAWQ_BACKEND") or None
    if forced:
        reason = _why_not(forced, op, device, shapes_ok)
        if reason is not None:
            raise BackendUnavailableError(f"backend {forced!r} cannot run {op}: {reason}")
        return forced
    if device.type == "cuda":
        candidates = _cuda_order(op, m)
    else:
        # The Triton interpreter is a test vehicle, never an automatic choice on CPU.
        candidates = ("cpu", "torch")
    for name in candidates:
        if _why_not(name, op, device, shapes_ok) is None:
            return name
    return "torch"


def report(device: torch.device, ops: tuple[str, ...]) -> dict[str, str]:
    """For `fastawq env`: the backend each op would use on `device`, or why none can."""
    out = {}
    for op in ops:
        try:
            chosen = {select_backend(op, device, m=b) for b in size_buckets(op)}
            out[op] = "/".join(sorted(chosen)) if len(chosen) > 1 else chosen.pop()
        except BackendUnavailableError as e:
            out[op] = f"error: {e}"
    return out
