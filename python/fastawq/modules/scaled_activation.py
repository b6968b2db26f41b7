"""ScaledActivation: act(x) / scales, for activations a scale does not commute with (GELU). It
lives with the modules, not the quantizer, because loading a checkpoint must rebuild it."""
from __future__ import annotations

import torch
from torch import nn

from fastawq.models.base import set_submodule


class ScaledActivation(nn.Module):
    """act(x) / scales: AutoAWQ's wrapper. The buffer is saved as `<act>.scales`, the name AutoAWQ
    checkpoints use."""

    def __init__(self, act: nn.Module, scales: torch.Tensor):
        super().__init__()
        self.act = act
        self.scales = nn.Parameter(scales.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) / self.scales.view(*([1] * (x.dim() - 1)), -1).to(x.dtype)


def wrap_activation(layer: nn.Module, act_path: str, channels: int, dtype: torch.dtype = torch.float32) -> None:
    """Insert a unit ScaledActivation so a checkpoint's `<act>.scales` has somewhere to load."""
    act = layer.get_submodule(act_path)
    if not isinstance(act, ScaledActivation):
        set_submodule(layer, act_path, ScaledActivation(act, torch.ones(channels, dtype=dtype)))
