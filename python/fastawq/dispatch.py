"""A quantized model spread over several devices (GPUs, CPU, disk) through accelerate's dispatch:
each decoder layer lives on one device and hooks move the activations between them."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def spans_devices(device_map: Any, max_memory: dict | None, offload_folder: str | None) -> bool:
    """Does this request need dispatch rather than one `.to(device)`?"""
    if max_memory is not None or offload_folder is not None:
        return True
    if isinstance(device_map, str) and device_map in ("balanced", "balanced_low_0", "sequential"):
        return True
    return isinstance(device_map, dict) and len({str(v) for v in device_map.values()}) > 1


def dispatch(model: nn.Module, device_map: Any, max_memory: dict | None, offload_folder: str | None) -> dict:
    """Place `model` (on the CPU) by `device_map` ("auto", "balanced", "sequential" or a dict of
    module name -> device / "cpu" / "disk") within `max_memory`; returns the map used."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"device_map={device_map!r}: expected auto, balanced, balanced_low_0, sequential or a dict")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    elif not isinstance(device_map, dict):
        raise TypeError(f"device_map must be a string or a dict, got {type(device_map).__name__}")
    devices = {str(v) for v in device_map.values()}
    if devices <= {"disk", "meta"}:
        raise ValueError(f"max_memory={max_memory} leaves no room on any device: everything would be on disk")
    if "disk" in devices and offload_folder is None:
        raise ValueError(f"device_map puts modules on 'disk' ({_on(device_map, 'disk')}); pass offload_folder=")
    names = {n for n, _ in model.named_modules()}
    unknown = [k for k in device_map if k and k not in names]
    if unknown:
        raise ValueError(f"device_map names modules the model does not have: {unknown[:5]}")
    if "disk" in devices or "meta" in devices:
        # Packed int32 buffers go to the offload folder with the weights (accelerate keeps buffers
        # resident by default, which would leave the disk-mapped layers' qweights in RAM).
        dispatch_model(model, device_map=device_map, offload_dir=offload_folder, offload_buffers=True)
    else:
        dispatch_model(model, device_map=device_map)
    log.info("model dispatched over %s", ", ".join(sorted(devices)))
    return device_map


def _on(device_map: dict, dev: str) -> list[str]:
    return [k for k, v in device_map.items() if str(v) == dev][:3]


def main_device(device_map: Any) -> str:
    """The accelerator the model mostly runs on (it decides the float dtype), else the CPU."""
    if isinstance(device_map, dict):
        for v in device_map.values():
            if str(v) not in ("cpu", "disk", "meta"):
                return f"cuda:{v}" if isinstance(v, int) else str(v)
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
