"""Helpers shared by the op wrappers: device checks and the backend modules, imported lazily."""
from __future__ import annotations

import torch

from fastawq.backend import _module

HALF = (torch.float16, torch.bfloat16)


def triton_module():
    return _module("fastawq.triton_kernels")


def cpu_module():
    return _module("fastawq.cpu")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    return next(iter(devices))


def call_op(op, impl, *args):
    """The schema'd op under torch.compile; its impl directly in eager mode, where the
    dispatcher's round trip into Python would cost more than a decode step's norm itself."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)
