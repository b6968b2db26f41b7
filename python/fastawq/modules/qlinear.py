"""The quantized linear layer: the AWQ GEMM checkpoint tensors and a reshape around one op."""
from __future__ import annotations

import torch
from torch import nn

from fastawq import ops, reference


class WQLinear(nn.Module):
    """4-bit linear in the AWQ "GEMM" layout, named and shaped as AutoAWQ's WQLinear_GEMM.

    qweight [K, N // 8] int32 · qzeros [K // G, N // 8] int32 · scales [K // G, N] · bias [N]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The validated, dispatched call is cached per activation device/dtype and per identity and
        # version of the buffers (a .to(), a load or an in-place edit makes a new plan).
        key = (
            x.device, x.dtype, x.shape[-1], self.backend,
            # Offload hooks load the buffers per call, as inference tensors: they have no version.
            *((t.data_ptr(), -1 if t.is_inference() else t._version)
              for t in (self.qweight, self.scales, self.qzeros, self.bias) if t is not None),
        )
        if self._plan_key != key:
            self._plan = ops.awq_gemm_plan(
                x, self.qweight, self.scales, self.qzeros, self.group_size, self.bias, backend=self.backend
            )
            self._plan_key = key
        return self._plan(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, w_bit={self.w_bit}, group_size={self.group_size}"
        )


WQLinear_GEMM = WQLinear  # AutoAWQ's name
