"""Inference-only CPU linears on the CPU backend's repacked weights (fastawq/cpu.py), and
`convert_model`, which swaps them in for a loaded model's WQLinear layers."""
from __future__ import annotations

import torch
from torch import nn

from fastawq import cpu, reference
from fastawq.modules.qlinear import WQLinear


class CPUInt4Linear(nn.Module):
    """Inference-only CPU linear holding just the repacked weight: one kernel call per forward.

    WQLinear's forward goes through ops.awq_gemm's cached plan and this module's awq_gemm (kernel
    choice, cache lookup): about 10-30 us per call on this project's 2-core CPU, a large part of
    SmolLM2-135M's decode step. This module skips all of it. It keeps no AWQ tensors (so no
    state_dict to save) and stays on the CPU; convert a loaded model with `convert_model`.
    """

    def __init__(self, packed: cpu.FastPacked | cpu.PackedInt4, bias: torch.Tensor | None, act: str | None = None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.k, packed.n
        self.bias_fp32 = None if bias is None else bias.detach().to(torch.float32)
        # fastawq's kernel: activation mode (cpu.act_isa); torch's kernel computes in bf16 anyway.
        self.isa = cpu.act_isa(act) if packed.kernel == cpu.FASTAWQ else "auto"

    @classmethod
    def from_wqlinear(cls, layer: WQLinear, kernel: str | None = None, act: str | None = None) -> "CPUInt4Linear":
        """From a WQLinear on the CPU."""
        return cls(cpu.repack(layer.qweight, layer.scales, layer.qzeros, layer.group_size, kernel), layer.bias, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        flat = x.dim() == 2  # [M, K] as the kernel takes it: no reshapes (a few us each)
        x2 = x if flat else x.reshape(-1, p.k)
        if p.kernel == cpu.FASTAWQ and x2.dtype != torch.float16:
            out = torch.ops.fastawq.awq_cpu_gemm(x2, p.w, p.scales, p.zeros16, p.group, p.n, self.bias_fp32, self.isa)
        else:
            out = cpu.mm(x2, p, self.bias_fp32)
        return out if flat else out.view(*x.shape[:-1], p.n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_fp32 is not None}, kernel={self.packed.kernel}")


class CPUInt8Linear(nn.Module):
    """Inference-only 8-bit linear (round-to-nearest, asymmetric, per group of K) on fastawq's
    4-bit kernel, for layers AWQ keeps in float, such as a large tied lm_head.

    An 8-bit code is two nibbles, q = 16 hi + lo, and (q - z) s = (hi - z_hi) 16 s + (lo - z_lo) s
    with z = 16 z_hi + z_lo. So x @ W = [x, x] @ W4, where W4 stacks the hi nibbles (scales 16 s)
    on the lo nibbles (scales s): a 4-bit layer of depth 2K, exact in the kernel's arithmetic.
    """

    def __init__(self, packed: cpu.FastPacked, in_features: int, bias: torch.Tensor | None, act: str | None = None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = in_features, packed.n
        self.bias_fp32 = None if bias is None else bias.detach().to(torch.float32)
        self.isa = cpu.act_isa(act)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64, act: str | None = None) -> "CPUInt8Linear":
        why = cpu.fast_kernel_available()
        if why is not None:
            raise RuntimeError(f"CPUInt8Linear needs fastawq's CPU kernel: {why}")
        with torch.no_grad():
            q, s, z = reference.quantize_groupwise(linear.weight, group_size, 8, True)
            q4 = torch.cat([q >> 4, q & 15], dim=1)  # [N, 2K]
            s4 = torch.cat([s * 16, s], dim=1)  # fp32, exact
            z4 = torch.cat([z >> 4, z & 15], dim=1)
            qweight, scales, qzeros = reference.pack_awq(q4, s4, z4, torch.float32)
        g = reference.resolve_group_size(group_size, linear.in_features)
        return cls(cpu.repack_fast(qweight, scales, qzeros, g), linear.in_features, linear.bias, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype == torch.float16:
            x2 = x2.float()
        out = torch.ops.fastawq.awq_cpu_gemm(torch.cat([x2, x2], dim=1), p.w, p.scales, p.zeros16, p.group, p.n,
                                              self.bias_fp32, self.isa)
        return out.to(x.dtype).view(*x.shape[:-1], p.n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_fp32 is not None}, bits=8, group_size={self.packed.group}")


def convert_model(model: nn.Module, kernel: str | None = None, *, lm_head_bits: int | None = None,
                  lm_head_group_size: int = 64, act: str | None = None) -> int:
    """Replace every CPU WQLinear that a CPU kernel takes by a CPUInt4Linear; return how many.

    Layers no kernel takes stay WQLinear and keep working through dispatch. `lm_head_bits=8`
    also replaces a float `model.lm_head` by a CPUInt8Linear (group `lm_head_group_size`): not
    AWQ's recipe, which keeps it in float, but on the CPU the float head of a small model costs
    as much as all its quantized layers (benchmarks/CPU_RESULTS.md gives speed and perplexity).
    `lm_head_bits=4` makes it a round-to-nearest CPUInt4Linear instead. `act`: the activation
    mode of fastawq's kernel (cpu.act_isa: exact, int8 or auto; default FASTAWQ_CPU_ACT, else
    auto: int8 on AVX2-only CPUs)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, WQLinear) and child.qweight.device.type == "cpu"):
                continue
            qweight = child.qweight
            chosen = kernel or cpu.weight_kernel(qweight, child.group_size)
            if chosen is not None and cpu.weight_fits(chosen, qweight, child.group_size) is None:
                setattr(parent, name, CPUInt4Linear.from_wqlinear(child, chosen, act))
                count += 1
    head = getattr(model, "lm_head", None)
    if lm_head_bits is not None and type(head) is nn.Linear and head.weight.device.type == "cpu":
        if lm_head_bits == 8:
            model.lm_head = CPUInt8Linear.from_linear(head, lm_head_group_size, act)
        elif lm_head_bits == 4:
            with torch.no_grad():
                q, s, z = reference.quantize_groupwise(head.weight, lm_head_group_size, 4, True)
                qw, sc, qz = reference.pack_awq(q, s, z, torch.float32)
            g = reference.resolve_group_size(lm_head_group_size, head.in_features)
            model.lm_head = CPUInt4Linear(cpu.repack(qw, sc, qz, g, kernel), head.bias, act)
        else:
            raise ValueError(f"lm_head_bits must be 4, 8 or None, got {lm_head_bits}")
    return count
