"""One record per architecture: where its modules live, its norm and activation, which linears
share an input behind an op a scale can fold into, and whether the fused engine can serve it.
Everything architecture-specific lives here; the quantizer, the checkpoint loader and the fused
engine read it and hard-code no module path."""
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
NORM_FORMS = ("rms", "layer")


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


GroupsFn = Callable[[nn.Module, object], list[ScaleGroup]]


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One supported family. Paths are dotted submodule names: the first block from the causal LM,
    `attn`/`mlp`/norms from one decoder layer, `qkv`/`o_proj` from the attention module and
    `gate_up`/`down_proj` from the MLP. The defaults are Llama's.

    `groups(layer, config)` lists the scale groups of one decoder layer; left None, they follow
    from the paths (Llama's layout). A linear that no group names is still clipped and rounded."""

    name: str
    model_types: tuple[str, ...]
    groups: GroupsFn | None = None
    # From the causal LM.
    layers_path: str = "model.layers"
    embed_path: str = "model.embed_tokens"
    final_norm_path: str = "model.norm"
    lm_head_path: str = "lm_head"
    rotary_path: str | None = "model.rotary_emb"
    # From one decoder layer: the norms whose outputs feed attention and the MLP (None: no norm
    # with a weight in front, as in post-norm layers; `parallel`: one norm feeds both).
    attn: str = "self_attn"
    mlp: str = "mlp"
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    parallel: bool = False
    # From the attention module / the MLP: the linears reading the attention norm's output (one
    # name when the checkpoint fuses them: Phi-3's qkv_proj is q, k, v stacked along N, its
    # gate_up_proj gate, then up; two for latent attention: q_a_proj, kv_a_proj_with_mqa).
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    # A fused qkv's rows: "stacked" [q | k | v] (v is the last rows) or "interleaved" per head or
    # per group (GPT-NeoX, Bloom, Falcon): then v's rows are scattered and take no scale.
    qkv_layout: str = "stacked"
    o_proj: str = "o_proj"
    qk_norm: tuple[str, str] | None = None  # per-head norms after q/k (Qwen3), fused into rope
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    down_proj: str = "down_proj"
    gated_mlp: bool = True  # False: act(up(x)) -> down, and gate_up names the one input linear
    # Norm form: RMSNorm or LayerNorm, and Gemma's y = x * (offset + w).
    norm: str = "rms"
    norm_offset: float = 0.0
    # The config attribute naming the activation, and (for "act" groups) the activation module
    # a ScaledActivation wraps, relative to the layer.
    act_attr: str = "hidden_act"
    act_path: str | None = None
    # Why the fused engine cannot serve this family; None when it can (subject to the config
    # checks in modules/fused.py: sliding window, partial rotary, activation).
    fused_blocker: str | None = None
    family: str = ""  # the README's model table groups types by it
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.norm not in NORM_FORMS:
            raise ValueError(f"{self.name}: norm={self.norm!r}; expected one of {NORM_FORMS}")
        if self.qkv_layout not in ("stacked", "interleaved"):
            raise ValueError(f"{self.name}: qkv_layout={self.qkv_layout!r}; expected 'stacked' or 'interleaved'")
        if not 1 <= len(self.qkv) <= 3 or len(self.gate_up) not in (1, 2):
            raise ValueError(f"{self.name}: qkv={self.qkv} needs 1 to 3 names, gate_up={self.gate_up} 1 or 2")

    @property
    def fusable(self) -> bool:
        return self.fused_blocker is None

    def scale_groups(self, layer: nn.Module, config: object) -> list[ScaleGroup]:
        return self.groups(layer, config) if self.groups is not None else standard_groups(self, layer)

    # Full names inside one decoder layer (an empty `attn` / `mlp` means the layer itself).
    def attn_linears(self) -> list[str]:
        return [_join(self.attn, n) for n in self.qkv]

    def mlp_linears(self) -> list[str]:
        return [_join(self.mlp, n) for n in self.gate_up]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as e:
        raise AttributeError(f"{type(root).__name__} has no submodule {path!r}") from e


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `path` (ModuleList indices included) by `module`."""
    parent, _, name = path.rpartition(".")
    setattr(get_submodule(root, parent) if parent else root, name, module)


def standard_groups(
    arch: Architecture, layer: nn.Module, *, parallel: bool | None = None,
    attn_norm: str | None = "", mlp_norm: str | None = "",
) -> list[ScaleGroup]:
    """The scale groups that follow from the record (keywords override it for one config):
    attention norm -> q/k/v, v -> o, MLP norm -> gate/up (one group with q/k/v when parallel),
    then up -> down (gated) or activation -> down (act_path). A fused qkv / gate_up takes the scale
    on its last rows (v, up). With no norm in front, a group is only clipped and rounded."""
    parallel = arch.parallel if parallel is None else parallel
    attn_norm = arch.attn_norm if attn_norm == "" else attn_norm
    mlp_norm = arch.mlp_norm if mlp_norm == "" else mlp_norm
    kind = "gemma_norm" if arch.norm_offset == 1.0 else "norm"

    def group(linears: list[str], norm: str | None) -> ScaleGroup:
        return ScaleGroup(linears, norm, kind) if norm is not None else ScaleGroup(linears)

    attn = get_submodule(layer, arch.attn) if arch.attn else layer
    mlp = get_submodule(layer, arch.mlp) if arch.mlp else layer
    if parallel:
        groups = [group(arch.attn_linears() + arch.mlp_linears(), attn_norm)]
    else:
        groups = [group(arch.attn_linears(), attn_norm)]
    v = get_submodule(attn, arch.qkv[-1])
    o = get_submodule(attn, arch.o_proj)
    # v -> o only when v's output is o's whole input (no grouped-query head sharing); fused,
    # v is the last third of a stacked qkv exactly when q, k and v have one size.
    if len(arch.qkv) == 3:
        v_to_o = v.weight.shape == o.weight.shape
    elif len(arch.qkv) == 1:
        v_to_o = arch.qkv_layout == "stacked" and v.weight.shape[0] == 3 * o.weight.shape[1]
    else:
        v_to_o = False
    if v_to_o:
        groups.append(ScaleGroup([_join(arch.attn, arch.o_proj)], _join(arch.attn, arch.qkv[-1]), "linear"))
    if not parallel:
        groups.append(group(arch.mlp_linears(), mlp_norm))
    up = get_submodule(mlp, arch.gate_up[-1])
    down = get_submodule(mlp, arch.down_proj)
    if arch.gated_mlp:
        up_rows = up.weight.shape[0] if len(arch.gate_up) == 2 else up.weight.shape[0] / 2
        if up_rows == down.weight.shape[1]:
            groups.append(ScaleGroup([_join(arch.mlp, arch.down_proj)], _join(arch.mlp, arch.gate_up[-1]), "linear"))
    elif arch.act_path is not None:
        # The activation does not commute with a scale: a ScaledActivation divides its output.
        groups.append(ScaleGroup([_join(arch.mlp, arch.down_proj)], arch.act_path, "act"))
    return groups


def mla_attention_groups(layer: nn.Module, attn: str = "self_attn", norm: str = "input_layernorm",
                         kind: str = "norm") -> list[ScaleGroup]:
    """Multi-head latent attention (MiniCPM3, DeepSeek-V2/V3): the attention norm feeds the two
    down-projections (or q_proj without a q latent), each latent norm feeds its up-projection;
    v is interleaved with k inside kv_b_proj's rows, so o takes no scale."""
    q_in = "q_a_proj" if getattr(get_submodule(layer, attn), "q_a_proj", None) is not None else "q_proj"
    groups = [ScaleGroup([_join(attn, q_in), _join(attn, "kv_a_proj_with_mqa")], norm, kind)]
    if q_in == "q_a_proj":
        groups.append(ScaleGroup([_join(attn, "q_b_proj")], _join(attn, "q_a_layernorm"), kind))
    groups.append(ScaleGroup([_join(attn, "kv_b_proj")], _join(attn, "kv_a_layernorm"), kind))
    return groups


def mla_groups(arch: Architecture, layer: nn.Module) -> list[ScaleGroup]:
    """MLA attention (mla_attention_groups) and the record's dense MLP (standard_groups)."""
    kind = "gemma_norm" if arch.norm_offset == 1.0 else "norm"
    a = arch.attn
    mlp = [g for g in standard_groups(arch, layer) if not any(n.startswith(f"{a}.") for n in g.linears)]
    return mla_attention_groups(layer, a, arch.attn_norm, kind) + mlp
