"""Loads the compiled extension ``fastawq._C`` if it is there and was built for this torch.

The compiled kernels are preferred, never required: any reason not to use them (not built,
built against another torch, failed to load) becomes one warning and a fallback to Triton/torch.
"""
from __future__ import annotations

import functools
import importlib
import logging
import warnings

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str | None]:
    try:
        info = importlib.import_module("fastawq._build_info")
    except ImportError:
        return False, "fastawq was installed without compiled kernels"
    built = getattr(info, "TORCH_VERSION", None)
    if built is not None and built != torch.__version__:
        msg = (
            f"fastawq's compiled kernels were built against torch {built}, but torch "
            f"{torch.__version__} is installed; using the Triton/torch kernels instead. Rebuild with "
            f"`pip install --no-build-isolation --force-reinstall --no-deps fastawq` to use them."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False, msg
    try:
        importlib.import_module("fastawq._C")
    except (ImportError, OSError) as e:
        msg = f"fastawq._C failed to load ({e}); using the Triton/torch kernels instead"
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False, msg
    return True, None


def is_loaded() -> bool:
    return _load()[0]


def has_op(name: str) -> bool:
    return is_loaded() and hasattr(torch.ops.fastawq, name)


def built_archs() -> list[str]:
    try:
        info = importlib.import_module("fastawq._build_info")
    except ImportError:
        return []
    return list(getattr(info, "CUDA_ARCHS", []))


def supports_device(device: torch.device) -> bool:
    """True when the compiled kernels hold machine code this CUDA device can run."""
    if device.type != "cuda" or not is_loaded():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    for arch in built_archs():
        digits = arch.rstrip("af").replace(".", "")
        if len(digits) >= 2 and int(digits[:-1]) == major and int(digits[-1]) <= minor:
            return True
    return False


def status() -> dict:
    loaded, reason = _load()
    return {"loaded": loaded, "reason": reason, "archs": built_archs()}
