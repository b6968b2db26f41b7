"""Mixture-of-experts layout: where a family keeps its router, experts and shared expert, and the
per-expert container the quantizer and the loader put in place of transformers' fused experts.

transformers 5.x stores experts as 3-D parameters (gate_up_proj [E, 2I, H] and down_proj [E, H, I],
or Llama 4's transposed [E, H, 2I] / [E, I, H]). AWQ checkpoints (AutoAWQ, vLLM) name every expert's
linears separately, `<block>.experts.{e}.<gate|up|down>.qweight`, so the experts are unfused into an
`ExpertList` of per-expert MLPs with plain nn.Linear (then WQLinear) layers that keep the call
signature of the module they replace.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from fastawq.models.base import Architecture, GroupsFn

CALLS = ("topk", "dense")
LAYOUTS = ("out_in", "in_out")


@dataclass(frozen=True)
class MoESpec:
    """Names are relative to the decoder layer (block) or to the block (the rest)."""

    block: str = "mlp"
    experts: str = "experts"
    # Full precision; reads the same normed input as the experts, so it takes their input scale.
    router: str = "gate"
    # The names of each expert's linears as checkpoints spell them: gate, up, down.
    proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Fused gate_up_proj [E, 2I, H] ("out_in", nn.Linear's orientation) or [E, H, 2I] ("in_out").
    layout: str = "out_in"
    # "topk": experts(x [T, H], top_k_index [T, k], top_k_weights [T, k]); "dense": experts(x [E*T, H])
    # with every token pre-multiplied by its routing score (Llama 4; zero rows for unrouted tokens).
    call: str = "topk"
    shared: str | None = None
    shared_gate: str | None = None
    norm: str = "post_attention_layernorm"
    # The block's name in checkpoints when transformers renames it (Mixtral: block_sparse_moe -> mlp).
    checkpoint_block: str | None = None
    # Routing as the fused engine runs it (softmax over the router logits, top-k): the config
    # attributes giving k and whether the k weights are renormalised to sum to 1 (a config
    # without the flag renormalises: Mixtral's router always does).
    top_k_attr: str = "num_experts_per_tok"
    renorm_attr: str = "norm_topk_prob"

    def __post_init__(self) -> None:
        if self.call not in CALLS or self.layout not in LAYOUTS:
            raise ValueError(f"MoESpec: call={self.call!r} must be one of {CALLS}, layout={self.layout!r} of {LAYOUTS}")

    def block_of(self, layer: nn.Module) -> nn.Module | None:
        """The layer's MoE block, or None for a dense layer (DeepSeek's first layers, Llama 4's
        interleaved ones)."""
        block = getattr(layer, self.block, None)
        return block if block is not None and hasattr(block, self.experts) else None

    def routing(self, config: object) -> tuple[int, bool]:
        """(k, renormalize) of the softmax top-k router for this config."""
        return int(getattr(config, self.top_k_attr)), bool(getattr(config, self.renorm_attr, True))

    def float_consumers(self) -> list[str]:
        """Full-precision modules (relative to the block) that read the experts' input."""
        return [self.router] + ([self.shared_gate] if self.shared_gate else [])


def moe_spec_of(model: nn.Module) -> MoESpec | None:
    """The mixture-of-experts layout of `model`'s family, None for dense families."""
    from fastawq.models import MOE_SPECS

    return MOE_SPECS.get(getattr(model.config, "model_type", None))


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), linears named as the checkpoint names them."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, act: nn.Module,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = tuple(names)
        for n, m in zip(self.names, (gate, up, down)):
            setattr(self, n, m)
        self.act_fn = act

    def linears(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(getattr(self, n) for n in self.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.linears()
        return down(self.act_fn(gate(x)) * up(x))


class ExpertList(nn.ModuleList):
    """Per-expert MLPs behind the call signature of the fused module they replace."""

    def __init__(self, experts: list[ExpertMLP], call: str = "topk"):
        super().__init__(experts)
        if call not in CALLS:
            raise ValueError(f"ExpertList: call={call!r}, expected one of {CALLS}")
        self.call = call
        self.num_experts = len(experts)

    # topk: x [T, H] · top_k_index [T, k] int · top_k_weights [T, k]  ->  [T, H]
    # dense: x [E * T, H] (rows of expert e at e*T..)  ->  [E * T, H]
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.call == "dense":
            return self._dense(hidden_states)
        if top_k_index is None or top_k_weights is None:
            raise ValueError("ExpertList(call='topk') needs top_k_index and top_k_weights")
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue  # transformers marks dropped slots with index E
            tok, pos = torch.where(top_k_index == e)
            y = self[e](hidden_states[tok]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        xs = x.view(self.num_experts, -1, h)
        out = torch.zeros_like(xs)
        for e in range(self.num_experts):
            # An unrouted token arrives as a zero row, and a bias-free expert maps 0 to 0: skip it.
            rows = torch.nonzero(xs[e].abs().amax(dim=-1) > 0).flatten()
            if rows.numel():
                out[e, rows] = self[e](xs[e, rows]).to(out.dtype)
        return out.view(-1, h)


def _linear(w: torch.Tensor | None, n_in: int, n_out: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free linear holding `w` [n_out, n_in], or weightless (meta) when w is None."""
    lin = nn.Linear(n_in, n_out, bias=False, device="meta", dtype=dtype)
    if w is not None:
        lin.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    return lin


def _split_fused(fused: nn.Module, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """gate [E, I, H], up [E, I, H], down [E, H, I] from a fused experts module (views where possible)."""
    gu, dn = fused.gate_up_proj, fused.down_proj
    if gu.dim() != 3 or dn.dim() != 3:
        raise TypeError(f"{type(fused).__name__}: expected 3-D gate_up_proj/down_proj, got {tuple(gu.shape)}, {tuple(dn.shape)}")
    if layout == "in_out":
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        raise ValueError(f"{type(fused).__name__}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} "
                         f"do not fit layout {layout!r}")
    i = two_i // 2
    return gu[:, :i], gu[:, i:], dn, e, h, i


@torch.no_grad()
def unfuse_experts(block: nn.Module, spec: MoESpec, *, empty: bool = False) -> ExpertList:
    """Replace `block.<experts>` (fused 3-D or already a ModuleList) by an ExpertList of nn.Linear
    experts. empty=True builds weightless (meta) linears for a loader to fill."""
    fused = getattr(block, spec.experts)
    if isinstance(fused, ExpertList):
        return fused
    act = getattr(fused, "act_fn", None) or nn.SiLU()
    if isinstance(fused, nn.ModuleList):
        # Per-expert modules already (transformers 4.x style): keep their linears, rename to the spec's.
        experts = []
        for m in fused:
            lins = [getattr(m, n, None) for n in spec.proj_names]
            if not all(isinstance(x, nn.Module) for x in lins):
                raise TypeError(f"expert {type(m).__name__} lacks linears named {spec.proj_names}")
            experts.append(ExpertMLP(*lins, getattr(m, "act_fn", act), spec.proj_names))
    else:
        gate, up, down, e, h, i = _split_fused(fused, spec.layout)
        dtype = gate.dtype
        experts = []
        for k in range(e):
            # Views of the fused tensor where contiguous: no copy of the layer's experts.
            ws = (None, None, None) if empty else (gate[k], up[k], down[k])
            experts.append(ExpertMLP(
                _linear(ws[0], h, i, dtype=dtype), _linear(ws[1], h, i, dtype=dtype), _linear(ws[2], i, h, dtype=dtype),
                act, spec.proj_names,
            ))
    new = ExpertList(experts, spec.call)
    setattr(block, spec.experts, new)
    return new


def unfuse_model(model: nn.Module, layers_path: str, spec: MoESpec | None, *, empty: bool = False) -> int:
    """Unfuse the experts of every MoE layer (so per-linear passes such as round-to-nearest or
    packing see them); returns how many blocks there were."""
    if spec is None:
        return 0
    n = 0
    for layer in model.get_submodule(layers_path):
        block = spec.block_of(layer)
        if block is not None:
            unfuse_experts(block, spec, empty=empty)
            n += 1
    return n


def experts_of(layer: nn.Module, spec: MoESpec) -> ExpertList | None:
    block = spec.block_of(layer)
    if block is None:
        return None
    ex = getattr(block, spec.experts)
    return ex if isinstance(ex, ExpertList) else None


# ---------------------------------------------------------------- checkpoint names
def checkpoint_renamer(layers_path: str, spec: MoESpec | None) -> tuple[Callable[[str], str], Callable[[str], str]]:
    """(to checkpoint, from checkpoint) name maps: Mixtral's block is `block_sparse_moe` on disk
    (what vLLM and the original checkpoints use) and `mlp` in transformers 5.x."""
    if spec is None or not spec.checkpoint_block or spec.checkpoint_block == spec.block:
        return (lambda k: k), (lambda k: k)
    lp = re.escape(layers_path)
    to_ck = re.compile(rf"^({lp}\.\d+)\.{re.escape(spec.block)}\.")
    from_ck = re.compile(rf"^({lp}\.\d+)\.{re.escape(spec.checkpoint_block)}\.")
    return (lambda k: to_ck.sub(rf"\1.{spec.checkpoint_block}.", k)), (lambda k: from_ck.sub(rf"\1.{spec.block}.", k))


def router_names(model: nn.Module, layers_path: str, spec: MoESpec) -> list[str]:
    """Checkpoint names of every MoE layer's full-precision consumers (routers, shared-expert gates),
    exact per layer: `modules_to_not_convert` is matched as a substring by vLLM and AutoAWQ, and a
    bare "mlp.gate" would also match a dense layer's "mlp.gate_proj"."""
    to_ck, _ = checkpoint_renamer(layers_path, spec)
    out = []
    for i, layer in enumerate(model.get_submodule(layers_path)):
        if spec.block_of(layer) is not None:
            out += [to_ck(f"{layers_path}.{i}.{spec.block}.{n}") for n in spec.float_consumers()]
    return out


# ---------------------------------------------------------------- records
def moe_architecture(
    name: str, family: str, spec: MoESpec, *, groups: GroupsFn | None = None, **fields_: object
) -> Architecture:
    """The Architecture record of the MoE family `name` (also its model_type). The fused engine
    serves its MoE blocks (modules/fused.py FusedMoE) unless fields_ sets a fused_blocker. `groups` defaults to Llama attention's groups plus the
    feed-forward groups of `spec` (attention_groups + mlp_groups)."""
    from fastawq.models.base import Architecture

    def llama_attention_and_moe(layer: nn.Module, config: object) -> list:
        return attention_groups(layer) + mlp_groups(layer, spec)

    return Architecture(name=name, model_types=(name,), family=family, groups=groups or llama_attention_and_moe,
                        **fields_)


# ---------------------------------------------------------------- scale groups
def attention_groups(layer: nn.Module, norm: str = "input_layernorm") -> list:
    """Llama's attention groups: q/k/v behind the input norm, v -> o without grouped-query sharing."""
    from fastawq.models.base import ScaleGroup

    attn = layer.self_attn
    groups = [ScaleGroup(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], norm, "norm")]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup(["self_attn.o_proj"], "self_attn.v_proj", "linear"))
    return groups


def mlp_groups(layer: nn.Module, spec: MoESpec) -> list:
    """The feed-forward groups the generic search handles. A dense layer is Llama's gate/up/down.
    In an MoE layer the experts' and the shared expert's gate/up share one input scale searched by
    quantize/moe.py (it also folds it into the router); only the shared expert's up -> down is
    an ordinary group."""
    from fastawq.models.base import ScaleGroup

    p = spec.block
    mlp = getattr(layer, p)
    if spec.block_of(layer) is None:
        groups = [ScaleGroup([f"{p}.gate_proj", f"{p}.up_proj"], spec.norm, "norm")]
        if mlp.up_proj.weight.shape[0] == mlp.down_proj.weight.shape[1]:
            groups.append(ScaleGroup([f"{p}.down_proj"], f"{p}.up_proj", "linear"))
        return groups
    if spec.shared is None:
        return []
    sh = getattr(mlp, spec.shared)
    if sh.up_proj.weight.shape[0] != sh.down_proj.weight.shape[1]:
        return []
    return [ScaleGroup([f"{p}.{spec.shared}.down_proj"], f"{p}.{spec.shared}.up_proj", "linear")]


# ---------------------------------------------------------------- loading
class _RenamedHandle:
    """A safetensors handle read under another name (the checkpoint's)."""

    def __init__(self, handle, name: str):
        self._h, self._name = handle, name

    def get_tensor(self, _name: str):
        return self._h.get_tensor(self._name)

    def get_slice(self, _name: str):
        return self._h.get_slice(self._name)


def prepare_load(model: nn.Module, layers_path: str, spec: MoESpec, tensors: dict) -> dict:
    """Before a checkpoint's tensors are matched to `model` (built from its config): map their
    names to transformers', and give every MoE block whose experts the checkpoint stores one by
    one an ExpertList of weightless linears to load them into."""
    _, from_ck = checkpoint_renamer(layers_path, spec)
    out = {}
    for k, (f, h) in tensors.items():
        new = from_ck(k)
        out[new] = (f, h) if new == k else (f, _RenamedHandle(h, k))
    unfuse_stored_experts(model, layers_path, spec, out)
    return out


def unfuse_stored_experts(model: nn.Module, layers_path: str, spec: MoESpec, names: Iterable[str]) -> int:
    """Give every MoE block whose experts the checkpoint tensor `names` (in transformers' naming,
    after checkpoint_renamer's from-checkpoint map) store one by one an ExpertList of weightless
    linears to load them into. Returns how many blocks were unfused."""
    # The layer indices whose expert 0 has stored tensors, in one pass over the names (a scan
    # per layer was O(layers x names): DeepSeek-V3 has 61 layers and ~100k tensor names).
    head, tail = f"{layers_path}.", f".{spec.block}.{spec.experts}.0."
    stored = set()
    for k in names:
        if k.startswith(head):
            idx, sep, rest = k[len(head):].partition(".")
            if sep and idx.isdigit() and f".{rest}".startswith(tail):
                stored.add(int(idx))
    n = 0
    for i, layer in enumerate(model.get_submodule(layers_path)):
        block = spec.block_of(layer)
        if block is not None and i in stored:
            unfuse_experts(block, spec, empty=True)
            n += 1
    return n


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def use_fast_experts(model: nn.Module, layers_path: str, spec: MoESpec) -> int:
    """Swap each packed ExpertList for the grouped-GEMM WQExperts module (one launch for all
    experts) where it is available and fits; the per-expert loop stays otherwise. Returns how
    many blocks were swapped."""
    try:
        from fastawq.modules.moe import WQExperts
    except ImportError:
        return 0
    from inspect import signature

    from fastawq.modules import WQLinear

    # WQExperts takes top-k ids and weights; Llama 4 hands its experts pre-scaled dense rows.
    if spec.call != "topk":
        return 0
    takes_names = "proj_names" in signature(WQExperts.from_experts).parameters
    if spec.proj_names != ("gate_proj", "up_proj", "down_proj") and not takes_names:
        return 0
    swapped = 0
    for layer in model.get_submodule(layers_path):
        ex = experts_of(layer, spec)
        if ex is None or not _is_silu(ex[0].act_fn):
            continue
        triples = [e.linears() for e in ex]
        if not all(isinstance(m, WQLinear) for t in triples for m in t):
            continue
        kwargs = {"proj_names": spec.proj_names} if takes_names else {}
        setattr(spec.block_of(layer), spec.experts, WQExperts.from_experts(triples, **kwargs))
        swapped += 1
    return swapped
