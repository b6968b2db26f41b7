"""The routed experts of a MoE layer as one module: stacked AWQ tensors and one op.

In memory the experts are stacked per projection (what the grouped kernel reads), in the AWQ layout
or, after set_layout("packed"), in the packed one (ops/repack.py: what the compiled decode kernels
read fastest); in a state dict they are per expert, in the AWQ layout whatever the memory holds,
``{e}.{gate_proj|up_proj|down_proj}.{qweight,qzeros,scales}`` under the module's prefix, the names
AutoAWQ checkpoints and vLLM's AWQ MoE loader use.
"""
from __future__ import annotations

import torch
from torch import nn

from fastawq import reference
from fastawq.backend import experts_layout
from fastawq.ops import moe as ops_moe
from fastawq.modules.qlinear import WQLinear, unpacked_for_state_dict

_PARTS = ("qweight", "qzeros", "scales")
_AWQ_BUFFERS = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")
_PACKED_BUFFERS = ("w13_wpacked", "w13_szpacked", "w2_wpacked", "w2_szpacked")
LAYOUTS = ("awq", "packed")


class WQExperts(nn.Module):
    """E experts down_e(act(gate_e(x)) * up_e(x)), 4-bit AWQ GEMM layout stacked on dim 0.

    w13_qweight [E, H, 2I // 8] int32 · w13_scales [E, H // G, 2I] · w13_qzeros [E, H // G, 2I // 8]
    w2_qweight  [E, I, H // 8]  int32 · w2_scales  [E, I // G, H]  · w2_qzeros  [E, I // G, H // 8]
    (w13 columns: gate then up.)
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        group_size: int,
        act: str = "silu",
        proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        *,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        if e < 1:
            raise ValueError(f"num_experts must be >= 1, got {e}")
        if h % reference.PACK or i % reference.PACK:
            raise ValueError(f"hidden_size={h} and intermediate_size={i} must be multiples of 8")
        g13 = reference.resolve_group_size(group_size, h)
        g2 = reference.resolve_group_size(group_size, i)
        if h % g13 or i % g2:
            raise ValueError(f"hidden_size={h} and intermediate_size={i} must be divisible by group_size={group_size}")
        if act not in reference.MOE_ACTS:
            raise ValueError(f"act must be one of {reference.MOE_ACTS}, got {act!r}")
        if len(proj_names) != 3 or len(set(proj_names)) != 3:
            raise ValueError(f"proj_names must name gate, up and down distinctly, got {proj_names}")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.group_size = group_size
        self.act = act
        self.proj_names = tuple(proj_names)
        # Forces one backend (triton | torch); None lets dispatch decide.
        self.backend: str | None = None
        self._plan = None
        self._plan_key = None
        self._sums_ok = False
        self._sums_key = None
        self.layout = "awq"
        i32 = dict(dtype=torch.int32, device=device)
        self.register_buffer("w13_qweight", torch.zeros(e, h, 2 * i // 8, **i32))
        self.register_buffer("w13_scales", torch.zeros(e, h // g13, 2 * i, dtype=dtype, device=device))
        self.register_buffer("w13_qzeros", torch.zeros(e, h // g13, 2 * i // 8, **i32))
        self.register_buffer("w2_qweight", torch.zeros(e, i, h // 8, **i32))
        self.register_buffer("w2_scales", torch.zeros(e, i // g2, h, dtype=dtype, device=device))
        self.register_buffer("w2_qzeros", torch.zeros(e, i // g2, h // 8, **i32))
        self.register_state_dict_post_hook(_per_expert_state_dict)

    # hidden_states [..., H] · topk_ids [..., k] int · topk_weights [..., k]  ->  [..., H]
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[-1]
        x, ids, w = hidden_states.reshape(-1, self.hidden_size), topk_ids.reshape(-1, k), topk_weights.reshape(-1, k)
        buffers = self._layout_buffers()
        packed = self.layout == "packed"
        if torch.compiler.is_compiling():  # traced: the custom op, with dispatch inside it
            op = ops_moe.moe_w4_packed if packed else ops_moe.moe_w4
            out = op(x, ids, w, *buffers, self.group_size, self.act, backend=self.backend)
            return out.reshape(hidden_states.shape)
        # Validated and dispatched once per activation device/dtype and per identity and version of
        # the buffers (a .to(), a load or an in-place edit makes a new plan), as WQLinear does.
        key = self._call_key(x, buffers)
        if self._plan_key != key:
            plan = ops_moe.moe_w4_packed_plan if packed else ops_moe.moe_w4_plan
            self._plan = plan(x, *buffers, self.group_size, self.act, backend=self.backend)
            self._plan_key = key
        return self._plan(x, ids, w).reshape(hidden_states.shape)

    def _call_key(self, x: torch.Tensor, buffers: tuple) -> tuple:
        """What a cached plan depends on: x's device and dtype, the forced backend, and the identity
        and version of each buffer."""
        return (x.device, x.dtype, self.backend, self.layout, *((t.data_ptr(), t._version) for t in buffers))

    def _layout_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers of the layout held: check_moe_shapes' order, or check_moe_packed_shapes'."""
        return tuple(getattr(self, n) for n in (_PACKED_BUFFERS if self.layout == "packed" else _AWQ_BUFFERS))

    def _awq_buffers(self) -> tuple[torch.Tensor, ...]:
        """The stacked AWQ tensors (check_moe_shapes' order), exact, in either layout (computed when packed)."""
        if self.layout == "awq":
            return self._layout_buffers()
        return ops_moe.experts_unpack(*self._layout_buffers(), self.group_size)

    def set_layout(self, layout: str) -> None:
        """Convert the experts in place to `layout` ("awq", "packed", or "auto": the one
        backend.experts_layout picks for a model converted to the packed layout on this device).
        Exact both ways; the old layout's tensors are freed (one layer holds both while it converts)."""
        if layout == "auto":
            layout = experts_layout("packed", self._layout_buffers()[0].device)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or 'auto', got {layout!r}")
        if layout == self.layout:
            return
        from fastawq.ops import repack

        if layout == "packed":
            tensors = repack.awq_experts_repack(*self._layout_buffers(), self.group_size)
            names, old = _PACKED_BUFFERS, _AWQ_BUFFERS
        else:
            tensors = self._awq_buffers()
            names, old = _AWQ_BUFFERS, _PACKED_BUFFERS
        for name in old:
            del self._buffers[name]
        for name, t in zip(names, tensors):
            self.register_buffer(name, t)
        self.layout = layout
        self._plan = self._plan_key = self._sums_key = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _AWQ_BUFFERS and self.__dict__.get("layout") == "packed":
                raise AttributeError(
                    f"these WQExperts hold the packed layout ({', '.join(_PACKED_BUFFERS)}), not {name}: call "
                    f"set_layout('awq') first, or read state_dict()"
                ) from None
            raise

    # hidden_states [T, H] · topk_ids [T, k] · topk_weights [T, k]  ->  [T, H] fp32, or None
    def sums(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' weighted sum in fp32, before its rounding to x's dtype, where the
        compiled one-token kernel serves the call (fastawq::moe_gemv_w4_sums: the MoE block then ends
        without its arrival and conversion pass, and the next add_rms_norm rounds the sums as it reads
        them); None where it does not (a batch, another backend, a traced call): use forward."""
        if torch.compiler.is_compiling() or hidden_states.dim() != 2 or hidden_states.shape[0] != 1:
            return None
        x = hidden_states
        buffers = self._layout_buffers()
        packed = self.layout == "packed"
        key = (topk_ids.shape[-1], *self._call_key(x, buffers))
        if self._sums_key != key:
            serves = ops_moe.packed_sums_kernel_serves if packed else ops_moe.sums_kernel_serves
            self._sums_ok = serves(x, topk_ids.shape[-1], buffers, self.group_size, self.act, self.backend)
            self._sums_key = key
        if not self._sums_ok:
            return None
        run = ops_moe.moe_w4_packed_sums if packed else ops_moe.moe_w4_sums
        return run(x, topk_ids, topk_weights, *buffers, self.group_size, self.act)

    @classmethod
    def from_experts(
        cls,
        experts: list[tuple[WQLinear, WQLinear, WQLinear]],
        act: str = "silu",
        proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> "WQExperts":
        """Stack per-expert (gate, up, down) WQLinear layers; exact (the packed words are copied)."""
        if not experts:
            raise ValueError("from_experts needs at least one (gate, up, down) triple")
        gate0, _, down0 = experts[0]
        h, i = gate0.in_features, gate0.out_features
        # WQLinear keeps the resolved group size: one group over each K is group_size -1 here.
        group = -1 if gate0.group_size == h and down0.group_size == i else gate0.group_size
        for e, (gate, up, down) in enumerate(experts):
            for name, lin, k, n in (("gate", gate, h, i), ("up", up, h, i), ("down", down, i, h)):
                if (lin.in_features, lin.out_features) != (k, n):
                    raise ValueError(f"expert {e} {name}: expected {k} -> {n}, got {lin.in_features} -> {lin.out_features}")
                if lin.bias is not None:
                    raise ValueError(f"expert {e} {name} has a bias; MoE experts here have none")
                if lin.group_size != reference.resolve_group_size(group, k):
                    raise ValueError(f"expert {e} {name}: group_size {lin.group_size}, expert 0's gate has {group}")
        mod = cls(len(experts), h, i, group, act, proj_names, dtype=gate0.scales.dtype, device=gate0.qweight.device)
        with torch.no_grad():
            for part in _PARTS:
                getattr(mod, f"w13_{part}").copy_(
                    torch.stack([torch.cat([getattr(gt, part), getattr(up, part)], dim=1) for gt, up, _ in experts])
                )
                getattr(mod, f"w2_{part}").copy_(torch.stack([getattr(dn, part) for _, _, dn in experts]))
        return mod

    def expert_tensors(self, e: int,
                       stacked: dict[str, torch.Tensor] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Views of expert e's AWQ tensors: {proj_name: {qweight, qzeros, scales}}; of `stacked`
        ({"w13_qweight": ..., ...}) when given, else of the module's (unpacked copies when packed)."""
        if stacked is None:
            stacked = dict(zip(_AWQ_BUFFERS, self._awq_buffers()))
        i8, i = self.intermediate_size // 8, self.intermediate_size
        gate, up, down = self.proj_names
        cut = {"qweight": i8, "qzeros": i8, "scales": i}
        return {
            gate: {p: stacked[f"w13_{p}"][e, :, :cut[p]] for p in _PARTS},
            up: {p: stacked[f"w13_{p}"][e, :, cut[p]:] for p in _PARTS},
            down: {p: stacked[f"w2_{p}"][e] for p in _PARTS},
        }

    def to_experts(self) -> list[tuple[WQLinear, WQLinear, WQLinear]]:
        """Per-expert (gate, up, down) WQLinear layers holding copies of this module's tensors."""
        h, i, g = self.hidden_size, self.intermediate_size, self.group_size
        stacked = dict(zip(_AWQ_BUFFERS, self._awq_buffers()))
        out = []
        for e in range(self.num_experts):
            layers = []
            for name, (k, n) in zip(self.proj_names, ((h, i), (h, i), (i, h))):
                lin = WQLinear(k, n, g, False, dtype=stacked["w13_scales"].dtype, device=stacked["w13_qweight"].device)
                with torch.no_grad():
                    for p, t in self.expert_tensors(e, stacked)[name].items():
                        getattr(lin, p).copy_(t)
                layers.append(lin)
            out.append(tuple(layers))
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.layout == "awq":
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        # The checkpoint format is AWQ GEMM whatever the layout held in memory.
        for name, t in zip(_AWQ_BUFFERS, unpacked_for_state_dict(self._awq_buffers())):
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.layout == "packed":  # load the AWQ tensors, then repack: the packed layout is never read from disk
            self.set_layout("awq")
            try:
                return self._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                  unexpected_keys, error_msgs)
            finally:
                self.set_layout("packed")
        # Per-expert names are stacked into the buffers; the stacked names load as they are.
        assign = local_metadata.get("assign_to_params_buffers", False)
        consumed = set()
        for proj, stacked in (("w13", self.proj_names[:2]), ("w2", self.proj_names[2:])):
            for part in _PARTS:
                buf_name = f"{proj}_{part}"
                key = prefix + buf_name
                if key in state_dict:
                    self._load_one(buf_name, state_dict[key], assign, key, error_msgs)
                    consumed.add(key)
                    continue
                keys = [[f"{prefix}{e}.{name}.{part}" for name in stacked] for e in range(self.num_experts)]
                absent = [k for row in keys for k in row if k not in state_dict]
                consumed.update(k for row in keys for k in row)
                if absent:
                    missing_keys.extend(absent)
                    continue
                rows = [torch.cat([state_dict[k] for k in row], dim=1) if len(row) > 1 else state_dict[row[0]]
                        for row in keys]
                try:
                    value = torch.stack(rows)
                except RuntimeError as err:
                    error_msgs.append(f"{prefix}*.{'/'.join(stacked)}.{part}: per-expert shapes differ ({err})")
                    continue
                self._load_one(buf_name, value, assign, f"{prefix}{{e}}.{'/'.join(stacked)}.{part}", error_msgs)
        # (Module.load_state_dict always passes strict=True here and filters by its own strict.)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in consumed)

    def _load_one(self, name: str, value: torch.Tensor, assign: bool, key: str, error_msgs: list[str]) -> None:
        buf = getattr(self, name)
        if tuple(value.shape) != tuple(buf.shape):
            error_msgs.append(f"size mismatch for {key}: checkpoint has {tuple(value.shape)}, "
                              f"the module expects {tuple(buf.shape)}")
            return
        if value.is_floating_point() != buf.is_floating_point():
            error_msgs.append(f"dtype mismatch for {key}: checkpoint {value.dtype}, module {buf.dtype}")
            return
        with torch.no_grad():
            if assign:
                setattr(self, name, value.to(device=buf.device if buf.device.type != "meta" else value.device))
            else:
                buf.copy_(value)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, group_size={self.group_size}, act={self.act}"
            + (", layout=packed" if self.layout == "packed" else "")
        )


def _per_expert_state_dict(module: WQExperts, state_dict, prefix, local_metadata) -> None:
    """Replace the stacked buffers by per-expert views, in the checkpoint naming.

    Views, not copies: a state_dict() taken only for names and shapes (as checkpoint loading
    does) must not duplicate the experts. The gate and up views are strided (columns of w13), so
    a saver calls .contiguous() on them, as checkpoint.py does for every tensor.
    """
    stacked = {name: state_dict.pop(prefix + name) for name in _AWQ_BUFFERS if prefix + name in state_dict}
    if len(stacked) != len(_AWQ_BUFFERS):  # (a state_dict filtered by its caller: nothing to replace)
        return
    for e in range(module.num_experts):
        for proj, parts in module.expert_tensors(e, stacked).items():
            for part, t in parts.items():
                state_dict[f"{prefix}{e}.{proj}.{part}"] = t
