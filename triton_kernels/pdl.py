"""Programmatic dependent launch (PDL, sm_90) for the Triton kernels of the decode path.

A kernel launched with PDL may start while the previous kernel in the stream finishes: it calls
`pdl_enter` first, which waits until that kernel's writes are visible and lets the next kernel
launch in turn. The compiled kernels do the same (csrc/common/pdl.cuh) under the same switch,
FASTAWQ_PDL (unset or 1/on/true: on where the GPU has it; 0/off/false: off).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_ON = ("", "1", "on", "true")
_OFF = ("0", "off", "false")


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl.extra.cuda, "gdc_wait")


# The POSIX environment as CPython keeps it (bytes), read without os.environ's key encoding: a
# launch asks at every call, as the compiled kernels do, so one process can compare both settings.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def env(name: bytes) -> str:
    """The environment variable `name` as this process has it now (read at each call)."""
    if _ENV_BYTES is not None:
        raw = _ENV_BYTES.get(name)
        return raw.decode(errors="replace") if raw else ""
    return os.environ.get(name.decode(), "")


def requested() -> bool:
    """FASTAWQ_PDL: unset or 1/on/true (PDL where the GPU has it), 0/off/false (never)."""
    return _parse(env(b"FASTAWQ_PDL"))


@functools.cache
def _parse(value: str) -> bool:
    if value not in _ON + _OFF:  # exactly as csrc/common/pdl.cpp accepts them
        raise ValueError(f"FASTAWQ_PDL must be 1/on/true or 0/off/false, got {value!r}")
    return value in _ON


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_has_pdl()


def enabled(device: torch.device) -> bool:
    """Launch Triton kernels on `device` with PDL."""
    if device.type != "cuda" or env(b"TRITON_INTERPRET") == "1" or not requested():
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # First in a kernel launched with launch_options: nothing the previous kernel writes is read,
    # and nothing is written, before the wait.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
