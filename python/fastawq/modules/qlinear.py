"""The quantized linear layer: the AWQ GEMM checkpoint tensors and a reshape around one op."""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from fastawq import ops, reference
from fastawq.backend import preferred_layout, tensor_version

LAYOUTS = ("awq", "packed")
_AWQ_TENSORS = ("qweight", "qzeros", "scales")
# Rows of K converted at once between the layouts: the conversion's int32 temporaries take
# 2 x rows x N x 4 bytes, 16x what the rows hold packed (one Llama-3-8B gate/up in one piece:
# 0.9 GiB on top of the weights at load), so a layer converts in slices of about this many bytes.
_CONVERT_BYTES = 64 << 20


def _row_slices(k: int, n: int, g: int) -> list[tuple[int, int]]:
    """(a, b) rows of K, each a multiple of the group size G, with a x N int32 below _CONVERT_BYTES."""
    rows = max(g, _CONVERT_BYTES // (4 * n) // g * g)
    return [(a, min(k, a + rows)) for a in range(0, k, rows)]


# Where a packed layer's state_dict() puts the AWQ tensors it unpacks (None: the layer's device).
_UNPACK_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("unpack_device", default=None)


@contextlib.contextmanager
def unpack_to(device: torch.device | str):
    """Within it, layers held in the packed layout (WQLinear, WQExperts) put the AWQ tensors their
    state_dict() unpacks on `device`, one layer at a time: save_quantized unpacks to the CPU, so a
    model on the GPU never holds a second copy of all its weights while it is saved."""
    token = _UNPACK_DEVICE.set(torch.device(device))
    try:
        yield
    finally:
        _UNPACK_DEVICE.reset(token)


def unpacked_for_state_dict(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A packed layer's unpacked AWQ tensors, moved where unpack_to says (as they are outside it)."""
    device = _UNPACK_DEVICE.get()
    return tensors if device is None else tuple(t.to(device) for t in tensors)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8]  ->  wpacked [K // 8, N] · szpacked [K // G, 2N]
def _repack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, g)
    slices = _row_slices(k, n, g)
    if len(slices) == 1:
        return ops.awq_gemv_repack(qweight, scales, qzeros, g)
    # Exact by slices: the packed layout permutes within 8 rows of K and keeps groups whole.
    wpacked = torch.empty(k // 8, n, dtype=torch.int32, device=qweight.device)
    szpacked = torch.empty(k // g, 2 * n, dtype=scales.dtype, device=scales.device)
    for a, b in slices:
        w, sz = ops.awq_gemv_repack(qweight[a:b], scales[a // g:b // g], qzeros[a // g:b // g], g)
        wpacked[a // 8:b // 8].copy_(w)
        szpacked[a // g:b // g].copy_(sz)
    return wpacked, szpacked


# wpacked [K // 8, N] int32 · szpacked [K // G, 2N]  ->  qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8]
def _unpack(wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, n, g = reference.check_packed_shapes(wpacked, szpacked, n, g)
    slices = _row_slices(k, n, g)
    if len(slices) == 1:
        return ops.awq_gemv_unpack(wpacked, szpacked, n, g)
    qweight = torch.empty(k, n // 8, dtype=torch.int32, device=wpacked.device)
    scales = torch.empty(k // g, n, dtype=szpacked.dtype, device=szpacked.device)
    qzeros = torch.empty(k // g, n // 8, dtype=torch.int32, device=szpacked.device)
    for a, b in slices:
        parts = ops.awq_gemv_unpack(wpacked[a // 8:b // 8], szpacked[a // g:b // g], n, g)
        for out, part in zip((qweight[a:b], scales[a // g:b // g], qzeros[a // g:b // g]), parts):
            out.copy_(part)
    return qweight, scales, qzeros


class WQLinear(nn.Module):
    """4-bit linear in the AWQ "GEMM" layout, named and shaped as AutoAWQ's WQLinear_GEMM.

    layout "awq":    qweight [K, N // 8] int32 · qzeros [K // G, N // 8] int32 · scales [K // G, N] · bias [N]
    layout "packed": wpacked [K // 8, N] int32 · szpacked [K // G, 2N] · bias [N] (ops/repack.py; the
                     same weight, converted exactly in place by set_layout, in slices of K: one copy
                     is held, plus one layer's new layout while it converts)
    state_dict() always holds the AWQ tensors, bit for bit, whatever the layout.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool,
        *,
        w_bit: int = 4,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        if w_bit != 4:
            raise ValueError(f"packed AWQ layers are 4-bit, got w_bit={w_bit}")
        g = reference.resolve_group_size(group_size, in_features)
        if in_features % g != 0:
            raise ValueError(f"in_features={in_features} is not divisible by group_size={g}")
        if out_features % reference.PACK != 0:
            raise ValueError(f"out_features={out_features} is not divisible by 8")
        self.in_features = in_features
        self.out_features = out_features
        self.w_bit = w_bit
        self.group_size = g
        # Forces one backend for this layer (cuda | triton | cpu | torch); None lets dispatch decide.
        self.backend: str | None = None
        self.layout = "awq"
        self._plan = None
        self._plan_key = None
        groups = in_features // g
        self.register_buffer(
            "qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32, device=device)
        )
        self.register_buffer("qzeros", torch.zeros(groups, out_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int,
        *,
        zero_point: bool = True,
        scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
    ) -> "WQLinear":
        """Pack an nn.Linear. With `scales` [N, K // G] and `zeros` [N, K // G] given (from the AWQ
        search), the weight is rounded on that grid; otherwise plain round-to-nearest."""
        w = linear.weight.data
        dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16
        layer = cls(
            linear.in_features, linear.out_features, group_size, linear.bias is not None,
            device=w.device, dtype=dtype,
        )
        if scales is None:
            q, s, z = reference.quantize_groupwise(w, layer.group_size, 4, zero_point)
        else:
            g = layer.group_size
            n, k = w.shape
            s = scales.to(torch.float32)
            z = zeros.to(torch.float32)
            wg = w.to(torch.float32).reshape(n, k // g, g)
            q = (torch.round(wg / s.unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15).reshape(n, k).to(torch.int32)
            z = z.to(torch.int32)
        qweight, packed_scales, qzeros = reference.pack_awq(q, s, z, dtype)
        layer.qweight.copy_(qweight)
        layer.qzeros.copy_(qzeros)
        layer.scales.copy_(packed_scales)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.data.to(dtype))
        return layer

    def set_backend(self, backend: str | None) -> None:
        """Force one backend for this layer (None: dispatch decides); the next call re-plans."""
        self.backend = backend
        self._plan, self._plan_key = None, None

    def set_layout(self, layout: str) -> None:
        """Convert the weight in place to `layout` ("awq", "packed", or "auto": the faster one on
        this device, backend.preferred_layout). Exact both ways; the old layout's tensors are freed."""
        if layout == "auto":
            layout = preferred_layout(self._buffers["wpacked" if self.layout == "packed" else "qweight"].device)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or 'auto', got {layout!r}")
        if layout == self.layout:
            return
        if layout == "packed":
            wpacked, szpacked = _repack(self.qweight, self.scales, self.qzeros, self.group_size)
            for name in _AWQ_TENSORS:
                del self._buffers[name]
            self.register_buffer("wpacked", wpacked)
            self.register_buffer("szpacked", szpacked)
        else:
            tensors = self._awq_tensors()
            del self._buffers["wpacked"], self._buffers["szpacked"]
            for name, t in zip(_AWQ_TENSORS, tensors):
                self.register_buffer(name, t)
            if "bias" in self._buffers:  # the original order, so state_dict() lists what it did
                self._buffers["bias"] = self._buffers.pop("bias")
        self.layout = layout
        self._plan, self._plan_key = None, None

    def _awq_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, qzeros, scales), exact, in either layout (computed when packed)."""
        if self.layout == "awq":
            return self.qweight, self.qzeros, self.scales
        qweight, scales, qzeros = _unpack(self.wpacked, self.szpacked, self.out_features, self.group_size)
        return qweight, qzeros, scales

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.layout == "awq":
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        # The checkpoint format is AWQ GEMM whatever the layout held in memory.
        for name, t in zip(_AWQ_TENSORS, unpacked_for_state_dict(self._awq_tensors())):
            destination[prefix + name] = t
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.layout == "awq":
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # Load the AWQ tensors, then repack them: the packed layout is never read from disk.
        self.set_layout("awq")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.set_layout("packed")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _AWQ_TENSORS and self.__dict__.get("layout") == "packed":
                raise AttributeError(
                    f"this WQLinear holds the packed layout (wpacked, szpacked), not {name}: call "
                    f"set_layout('awq') first, or read state_dict()"
                ) from None
            raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The validated, dispatched call is cached per activation device/dtype and per identity and
        # version of the buffers (a .to(), a load or an in-place edit makes a new plan).
        key = (
            x.device, x.dtype, x.shape[-1], self.backend, self.layout,
            *((t.data_ptr(), tensor_version(t)) for t in self._buffers.values() if t is not None),
        )
        if self._plan_key != key:
            if self.layout == "packed":
                self._plan = ops.packed_gemm_plan(
                    x, self.wpacked, self.szpacked, self.out_features, self.group_size, self.bias, backend=self.backend
                )
            else:
                self._plan = ops.awq_gemm_plan(
                    x, self.qweight, self.scales, self.qzeros, self.group_size, self.bias, backend=self.backend
                )
            self._plan_key = key
        return self._plan(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, w_bit={self.w_bit}, group_size={self.group_size}"
            + (", layout=packed" if self.layout == "packed" else "")
        )


def set_layout(model: nn.Module, layout: str) -> int:
    """Convert every WQLinear of `model` to `layout` ("awq", "packed" or "auto"), in place; returns
    how many there are. For an engine that fuses layers (concatenating AWQ tensors), call it after
    fusing: the fused WQLinear modules are converted like the others. Routed experts (WQExperts)
    follow into the packed layout where backend.experts_layout says so, and back to "awq"."""
    from fastawq.backend import experts_layout
    from fastawq.modules.moe import WQExperts

    layers = [m for m in model.modules() if isinstance(m, WQLinear)]
    for m in layers:
        m.set_layout(layout)
    for m in model.modules():
        if isinstance(m, WQExperts):
            device = m._layout_buffers()[0].device
            want = layout if layout != "auto" else preferred_layout(device)
            m.set_layout(experts_layout(want, device) if want == "packed" else "awq")
    return len(layers)


WQLinear_GEMM = WQLinear  # AutoAWQ's name
