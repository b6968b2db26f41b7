"""Loads the compiled extension ``fastawq._C`` if it is there and was built for this torch.

The compiled kernels are preferred, never required: any reason not to use them (not built,
built against another torch, failed to load) becomes one warning and a fallback to Triton/torch.
The check happens before the shared library is opened, so a torch mismatch never surfaces as an
"undefined symbol" crash.
"""
from __future__ import annotations

import functools
import importlib
import logging
import warnings

import torch

logger = logging.getLogger(__name__)

REBUILD_HINT = (
    "rebuild with `FASTAWQ_BUILD_KERNELS=on pip install --no-build-isolation --no-deps "
    "--force-reinstall .` in the fastawq source tree (`-e .` for an editable install)"
)


def _build_info():
    try:
        return importlib.import_module("fastawq._build_info")
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str | None]:
    info = _build_info()
    if info is None:
        return False, "fastawq was installed without compiled kernels"
    built = getattr(info, "TORCH_VERSION", None)
    if built is not None and built != torch.__version__:
        msg = (
            f"fastawq's compiled kernels were built against torch {built}, but torch "
            f"{torch.__version__} is installed; using the Triton/torch kernels instead. To use them, "
            f"{REBUILD_HINT}."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False, msg
    try:
        importlib.import_module("fastawq._C")
    except (ImportError, OSError) as e:
        msg = (
            f"fastawq._C (built for torch {built}, running torch {torch.__version__}) failed to load: "
            f"{e}; using the Triton/torch kernels instead. To use them, {REBUILD_HINT}."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False, msg
    logger.debug("fastawq._C loaded (archs %s)", built_archs())
    return True, None


def is_loaded() -> bool:
    return _load()[0]


def has_op(name: str) -> bool:
    return is_loaded() and hasattr(torch.ops.fastawq, name)


def built_archs() -> list[str]:
    info = _build_info()
    return [a for a in getattr(info, "CUDA_ARCHS", []) if a] if info is not None else []


def _arch_runs_on(arch: str, major: int, minor: int) -> bool:
    """Machine code for sm_XY runs on the same major with minor >= Y; 'a'/'f' variants only on XY."""
    specific = arch.endswith(("a", "f"))
    digits = arch.rstrip("af").split(".")
    if len(digits) != 2 or not all(d.isdigit() for d in digits):
        return False
    a_major, a_minor = int(digits[0]), int(digits[1])
    if specific:
        return (a_major, a_minor) == (major, minor)
    return a_major == major and a_minor <= minor


def supports_device(device: torch.device) -> bool:
    """True when the compiled kernels hold machine code this CUDA device can run."""
    if device.type != "cuda" or not is_loaded():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return any(_arch_runs_on(a, major, minor) for a in built_archs())


def status() -> dict:
    loaded, reason = _load()
    info = _build_info()
    return {
        "loaded": loaded,
        "reason": reason,
        "archs": built_archs(),
        "built_torch": getattr(info, "TORCH_VERSION", None) if info is not None else None,
    }
