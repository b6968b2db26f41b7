"""Folding a per-channel scale s into the op in front of a group of linears: the linears take
W * s, the op divides its output channels by s, and the float model computes the same function."""
from __future__ import annotations

import torch
from torch import nn

from fastawq.models.base import ScaleGroup, set_submodule
from fastawq.modules.scaled_activation import ScaledActivation, wrap_activation


# s [K] fp32: the scale of the K input channels of every linear in `group`
@torch.no_grad()
def apply_scale(layer: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    s = s.to(torch.float32)
    prev = layer.get_submodule(group.prev) if group.prev else None
    if group.kind == "norm":
        prev.weight.data = (prev.weight.float() / s).to(prev.weight.dtype)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data = (prev.bias.float() / s).to(prev.bias.dtype)
    elif group.kind == "gemma_norm":
        prev.weight.data = ((1.0 + prev.weight.float()) / s - 1.0).to(prev.weight.dtype)
    elif group.kind == "linear":
        n = s.numel()
        w = prev.weight
        if w.shape[0] < n:
            raise ValueError(f"cannot fold a scale of {n} channels into {group.prev} with weight {tuple(w.shape)}")
        w.data[-n:] = (w.data[-n:].float() / s[:, None]).to(w.dtype)
        if prev.bias is not None:
            prev.bias.data[-n:] = (prev.bias.data[-n:].float() / s).to(prev.bias.dtype)
    elif group.kind == "act":
        if isinstance(prev, ScaledActivation):
            prev.scales.data = prev.scales.data * s.to(prev.scales.dtype)
        else:
            set_submodule(layer, group.prev, ScaledActivation(prev, s.to(torch.float32)))
    else:
        raise ValueError(f"scale group {group.linears} has no op to fold a scale into (kind={group.kind!r})")
    for name in group.linears:
        lin = layer.get_submodule(name)
        lin.weight.data = (lin.weight.float() * s).to(lin.weight.dtype)


__all__ = ["ScaledActivation", "apply_scale", "wrap_activation"]
