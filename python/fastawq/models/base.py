"""What the quantizer needs to know about one architecture: where its decoder layers live and which
linears share an input behind an op whose output channels a scale can be folded into."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

# How a scale s folds into the op in front of a group of linears (the linears take W * s):
#   norm        y = x * w (+ b)        ->  w /= s, b /= s
#   gemma_norm  y = x * (1 + w)        ->  w = (1 + w) / s - 1
#   linear      y = x W^T + b           ->  the last len(s) rows of W and b /= s
#   act         y = act(x)              ->  wrapped in ScaledActivation (y / s)
#   none        no scaling: the linears are only clipped and rounded
PREV_KINDS = ("norm", "gemma_norm", "linear", "act", "none")


@dataclass
class ScaleGroup:
    linears: list[str]
    prev: str | None = None
    kind: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in PREV_KINDS:
            raise ValueError(f"unknown scale-group kind {self.kind!r}; expected one of {PREV_KINDS}")
        if (self.kind == "none") != (self.prev is None):
            raise ValueError(f"scale group {self.linears}: prev={self.prev!r} does not fit kind={self.kind!r}")


@dataclass(frozen=True)
class Architecture:
    """One supported family. `groups(layer, config)` lists the scale groups of one decoder layer;
    a linear of the layer that no group names is still clipped and rounded on its own."""

    name: str
    model_types: tuple[str, ...]
    layers_path: str
    groups: Callable[[nn.Module, object], list[ScaleGroup]]
    # The activation that an "act" group wraps in ScaledActivation, relative to the layer.
    act_path: str | None = None
    notes: str = field(default="", compare=False)


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as e:
        raise AttributeError(f"{type(root).__name__} has no submodule {path!r}") from e


def llama_like_groups(layer: nn.Module, *, mlp_norm: str = "post_attention_layernorm", norm_kind: str = "norm") -> list[ScaleGroup]:
    """Llama's layout, shared by Mistral, Qwen2/3 and the Gemma family."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [ScaleGroup(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "input_layernorm", norm_kind)]
    # v -> o only when v's output is o's whole input (no grouped-query head sharing).
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup(["self_attn.o_proj"], "self_attn.v_proj", "linear"))
    groups.append(ScaleGroup(["mlp.gate_proj", "mlp.up_proj"], mlp_norm, norm_kind))
    if mlp.up_proj.weight.shape[0] == mlp.down_proj.weight.shape[1]:
        groups.append(ScaleGroup(["mlp.down_proj"], "mlp.up_proj", "linear"))
    return groups
