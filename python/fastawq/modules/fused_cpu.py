"""The fused engine's decode step on the CPU: one call per layer of awq_cpu_decode_layer (csrc/cpu/
awq_cpu_decode.cpp: norms, rope, cache write, attention and the four GEMMs in C++) where the KV
cache is fp32, else one Python loop over the layers, each a handful of torch calls around
fastawq's CPU kernel; fp32 either way. `act` picks the kernel's activation mode (cpu.act_isa:
auto by default, which is int8 on AVX2-only CPUs and exact elsewhere).

Why a separate step: on the CPU there is no graph replay, so every op call and module hop is paid
per token. The generic step (fused.py) goes through ops.* dispatch, WQLinear plans and the torch
references of rope and decode attention (which read the whole preallocated cache, masked); here
the packed weights are bound once, rope is two multiply-adds on the step's cos/sin row, the new
K/V row is a slice write and attention reads only the filled part of the cache. fp32 is the AVX2
kernel's fastest activation dtype and exact in the kernel's arithmetic; a bf16 or fp16 model keeps
its cache dtype and returns logits in it.

The lm_head: by default an 8-bit round-to-nearest head (group 64) on the same kernel
(cpu_linear.CPUInt8Linear) replaces a float one for prefill and decode alike: on SmolLM2-135M
it costs +0.15% perplexity (benchmarks/CPU_RESULTS.md) and the float head is about a third of a
4-bit decode step. `lm_head_bits=None` keeps the float head.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from fastawq import cpu
from fastawq.modules.cpu_linear import CPUInt8Linear
from fastawq.modules.qlinear import WQLinear

log = logging.getLogger(__name__)

_ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def _packed(lin: nn.Module, isa: str = "auto") -> tuple | None:
    """(w, scales, zeros16, group, n, bias fp32, isa): awq_cpu_gemm's arguments after x, or None."""
    if not isinstance(lin, WQLinear):
        return None
    g = lin.group_size
    if cpu.weight_fits(cpu.FASTAWQ, lin.qweight, g) is not None:
        return None
    p = cpu.prepare(lin.qweight, lin.scales, lin.qzeros, g, cpu.FASTAWQ)
    bias = None if lin.bias is None else lin.bias.detach().to(torch.float32).contiguous()
    return (p.w, p.scales, p.zeros16, p.group, p.n, bias, isa)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Measured faster than F.rms_norm on one fp32 row (about 20 against 35 us on a loaded 2-core EPYC).
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * w


def _norm_weight(w: torch.Tensor, offset: float) -> torch.Tensor:
    return (w.detach().to(torch.float32) + offset).contiguous()


def why_not(runtime) -> str | None:
    """None when CPUDecodeStep can serve this fused runtime, else why not."""
    if runtime.device.type != "cpu":
        return f"the model is on {runtime.device}"
    why = cpu.fast_kernel_available()
    if why is not None:
        return why
    if runtime.cfg.act not in _ACTS:
        return f"activation {runtime.cfg.act!r}"
    for i, layer in enumerate(runtime.layers):
        for name, lin in (("qkv", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            if not isinstance(lin, WQLinear):
                return f"layer {i} {name} is {type(lin).__name__}, not a WQLinear"
            why = cpu.weight_fits(cpu.FASTAWQ, lin.qweight, lin.group_size)
            if why is not None:
                return f"layer {i} {name}: {why}"
    return None


class CPUDecodeStep:
    """logits [B, 1, V] = step(ids [B, 1], pos) for a fused runtime on the CPU (rows share pos)."""

    def __init__(self, runtime, lm_head_bits: int | None = 8, act: str | None = None):
        why = why_not(runtime)
        if why is not None:
            raise ValueError(f"the CPU decode step cannot serve this model: {why}")
        c = runtime.cfg
        # The kernel's activation mode (cpu.act_isa: FASTAWQ_CPU_ACT, else auto).
        isa = self.isa = cpu.act_isa(act)
        self.runtime = runtime
        self.cfg = c
        self.layers = []
        for layer in runtime.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qn = kn = None
            if c.qk_norm:
                qn, kn = _norm_weight(attn.q_norm_weight, 0.0), _norm_weight(attn.k_norm_weight, 0.0)
            self.layers.append((
                _norm_weight(layer.input_layernorm.weight, c.norm_offset),
                _norm_weight(layer.post_attention_layernorm.weight, c.norm_offset),
                _packed(attn.qkv_proj, isa), _packed(attn.o_proj, isa), _packed(mlp.gate_up_proj, isa),
                _packed(mlp.down_proj, isa),
                attn.k_cache, attn.v_cache, qn, kn,
            ))
        attn0 = runtime.layers[0].self_attn
        self.cos, self.sin = attn0.rope_cos, attn0.rope_sin
        half = c.head_dim // 2
        # rotate_half(x) * sin == x[..., flipped halves] * [-sin_lo, sin_hi]
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=1).contiguous()
        self.final_norm = _norm_weight(runtime.final_norm.weight, c.norm_offset)
        head = runtime.lm_head
        if lm_head_bits == 8 and type(head) is nn.Linear:
            runtime.lm_head = head = CPUInt8Linear.from_linear(head, 64, act)
            log.info("CPU fused engine: 8-bit lm_head (group 64) in place of the float one")
        elif lm_head_bits not in (8, None):
            raise ValueError(f"lm_head_bits must be 8 or None, got {lm_head_bits}")
        self.head = head
        self.embed = runtime.embed
        self.act = _ACTS[c.act]
        self.gemm = torch.ops.fastawq.awq_cpu_gemm.default
        # One C++ call per layer (awq_cpu_decode_layer) where _C has it and the caches are fp32;
        # else the torch loop below (an fp16 / bf16 model's cache, or an older _C).
        self.layer_args = None
        if hasattr(torch.ops.fastawq, "awq_cpu_decode_layer") and all(
                L[6].dtype == torch.float32 and L[6].is_contiguous() and L[7].is_contiguous() for L in self.layers):
            self.layer_op = torch.ops.fastawq.awq_cpu_decode_layer.default
            self.layer_args = []
            for n1, n2, qkv_p, o_p, gu_p, down_p, kc, vc, qn, kn in self.layers:
                packs = (qkv_p, o_p, gu_p, down_p)
                self.layer_args.append((n1, n2, [t for p in packs for t in p[:3]], [p[3] for p in packs],
                                        [p[4] for p in packs], [p[5] for p in packs], kc, vc, qn, kn))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        c, gemm = self.cfg, self.gemm
        b, hq, hkv, d = ids.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qd, kd = hq * d, hkv * d
        eps = c.eps
        cos, sin = self.cos[pos], self.sin_signed[pos]
        end = pos + 1
        x = self.embed(ids.reshape(b)).to(torch.float32)
        if self.layer_args is not None:
            res, x, op, isa = x.contiguous(), None, self.layer_op, self.isa
            cos, sin = cos.contiguous(), sin.contiguous()
            for n1, n2, weights, groups, ns, biases, kc, vc, qn, kn in self.layer_args:
                x = op(res, x, n1, n2, weights, groups, ns, biases, kc, vc, pos, cos, sin, qn, kn, hq, hkv, eps,
                       c.scale, c.act, isa)
            return self._head(res.add_(x), b)
        res = None
        for n1, n2, qkv_p, o_p, gu_p, down_p, kc, vc, qn, kn in self.layers:
            res = x if res is None else res.add_(x)
            t = gemm(_rms(res, n1, eps), *qkv_p)
            if qn is None:
                qk = t[:, :qd + kd].view(b, hq + hkv, d)
            else:
                qk = torch.cat([_rms(t[:, :qd].view(b, hq, d), qn, eps),
                                _rms(t[:, qd:qd + kd].view(b, hkv, d), kn, eps)], dim=1)
            qk = torch.addcmul(qk * cos, qk.view(b, hq + hkv, 2, d // 2).flip(2).view(b, hq + hkv, d), sin)
            kc[:b, pos] = qk[:, hq:]
            vc[:b, pos] = t[:, qd + kd:].view(b, hkv, d)
            k, v = kc[:b, :end].transpose(1, 2), vc[:b, :end].transpose(1, 2)  # [b, hkv, L, d]
            if k.dtype != torch.float32:
                k, v = k.float(), v.float()
            o = F.scaled_dot_product_attention(qk[:, :hq].unsqueeze(2), k, v, scale=c.scale, enable_gqa=hq != hkv)
            res.add_(gemm(o.reshape(b, qd), *o_p))
            gu = gemm(_rms(res, n2, eps), *gu_p)
            inter = gu.shape[1] // 2
            x = gemm(self.act(gu[:, :inter]) * gu[:, inter:], *down_p)
        return self._head(res.add_(x), b)

    def _head(self, res: torch.Tensor, b: int) -> torch.Tensor:
        h = _rms(res, self.final_norm, self.cfg.eps)
        if isinstance(self.head, nn.Linear):
            h = h.to(self.head.weight.dtype)
        return self.head(h).view(b, 1, -1).to(self.embed.weight.dtype)
