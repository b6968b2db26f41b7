"""Fused decoder layers for Llama-like W4 models: one QKV GEMM, rope + KV-cache write in one
kernel, split-K decode attention, gate/up in one GEMM with act*mul fused, add + RMSNorm fused.

`fuse_model` swaps a transformers causal LM's decoder layers in place; `FusedRuntime` (attached to
the model as `model.fastawq_runtime`) runs prefill and decode steps, the latter as CUDA-graph
replays on GPU. Sequences of one batch share their length (no padding inside the cache).

Architectures: every record in fastawq.models whose fused_blocker is None (Llama-shaped:
RMSNorm, full rotary, gated MLP), e.g. llama, mistral (max_seq_len <= sliding window), qwen3
(q/k norms fused into the rope kernel), gemma (1 + w norms); paths and names come from the record.
Others are refused with the record's reason.
Kernels: every piece is an op of fastawq.ops, chosen by backend.select_backend (`backend=` on
fuse_model reaches the norms, rope, attention and every WQLinear); prefill attention is torch
SDPA. The fused model's device is fixed at fuse time.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from fastawq import ops
from fastawq.models import Architecture, architecture_of
from fastawq.models.base import get_submodule, set_submodule
from fastawq.models.moe import ExpertList, MoESpec, moe_spec_of
from fastawq.modules.moe import WQExperts
from fastawq.modules.qlinear import WQLinear

log = logging.getLogger(__name__)

# fuse_model's default prefill chunk: at most this many tokens over the batch's rows a chunk (a batch
# of B prompts goes DEFAULT_PREFILL_CHUNK // B positions a chunk). Each chunk pays every projection's
# setup again (on the packed layout a prefill GEMM dequantizes the layer's weights for cuBLAS: ~1.6
# ms a chunk for 8 Llama-3-8B layers on an H100), so chunks of 1024 took a 2,048-token prompt from
# 1.07x to 0.92x the fp16 model's prefill speed (RESULTS.md session 33). At 4096 tokens a chunk's
# activations (Llama-3-8B: gate/up 4096 x 28672 x 2 bytes) stay ~0.5 GiB at any batch size.
DEFAULT_PREFILL_CHUNK = 4096


class CacheOverflowError(ValueError):
    """A request does not fit the preallocated KV cache (max_seq_len or batch_size)."""


@dataclass(frozen=True)
class FusedConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    norm_offset: float
    act: str
    scale: float
    qk_norm: bool
    max_seq_len: int
    batch_size: int


def concat_wqlinear(layers: list[WQLinear]) -> WQLinear:
    """One WQLinear computing the given layers side by side (their outputs concatenated along N).

    The packed columns concatenate exactly: qweight/qzeros pack 8 output columns per int32 and every
    N here is a multiple of 8; scales are per column."""
    first = layers[0]
    if len(layers) == 1 and isinstance(first, WQLinear):
        return first
    for lin in layers:
        if not isinstance(lin, WQLinear):
            raise TypeError(f"fusing needs WQLinear layers, got {type(lin).__name__}")
        if lin.in_features != first.in_features or lin.group_size != first.group_size:
            raise ValueError(
                f"cannot concatenate WQLinear(K={lin.in_features}, G={lin.group_size}) with "
                f"WQLinear(K={first.in_features}, G={first.group_size})"
            )
    has_bias = any(lin.bias is not None for lin in layers)
    n = sum(lin.out_features for lin in layers)
    dev = first.qweight.device
    out = WQLinear(first.in_features, n, first.group_size, has_bias, device="meta", dtype=first.scales.dtype)
    out.qweight = torch.cat([lin.qweight for lin in layers], dim=1)
    out.qzeros = torch.cat([lin.qzeros for lin in layers], dim=1)
    out.scales = torch.cat([lin.scales for lin in layers], dim=1)
    if has_bias:
        out.bias = torch.cat([
            lin.bias if lin.bias is not None else torch.zeros(lin.out_features, dtype=first.scales.dtype, device=dev)
            for lin in layers
        ])
    out.backend = first.backend
    return out


class FusedAttention(nn.Module):
    def __init__(self, attn: nn.Module, cfg: FusedConfig, dtype: torch.dtype, device: torch.device,
                 arch: Architecture):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = concat_wqlinear([get_submodule(attn, n) for n in arch.qkv])
        self.o_proj = get_submodule(attn, arch.o_proj)
        if cfg.qk_norm:
            self.q_norm_weight = get_submodule(attn, arch.qk_norm[0]).weight
            self.k_norm_weight = get_submodule(attn, arch.qk_norm[1]).weight
        else:
            self.q_norm_weight = self.k_norm_weight = None
        # Zero-filled: the torch fallback masks (rather than skips) positions past the length.
        shape = (cfg.batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    # x [B, L, H] · positions [B, L] int32 · lens [B] int32 (decode) -> [B, L, H]
    def forward(
        self, x: torch.Tensor | None, positions: torch.Tensor, start: int, lens: torch.Tensor | None,
        max_len: int, backend: str | None, qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """qkv: the projection already made (norm_linear); x is then unused."""
        if qkv is None:
            qkv = self.qkv_proj(x)
        return self.o_proj(self.attend(qkv, positions, start, lens, max_len, backend))

    # qkv [B, L, (HQ + 2 HKV) D] -> the attention's output [B, L, HQ D], before o_proj
    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, start: int, lens: torch.Tensor | None,
               max_len: int, backend: str | None) -> torch.Tensor:
        c = self.cfg
        b, seq, _ = qkv.shape
        if lens is not None:
            # A decode step: rope, the cache write and attention (one compiled launch where it
            # serves, else rope_kv_cache and decode_attention).
            o = ops.rope_decode_attention(
                qkv, positions, self.rope_cos, self.rope_sin, self.k_cache, self.v_cache, lens,
                c.num_heads, c.num_kv_heads, c.head_dim, c.scale, self.q_norm_weight, self.k_norm_weight, c.eps,
                max_len=max_len, backend=backend,
            )
        else:
            q = ops.rope_kv_cache(
                qkv, positions, self.rope_cos, self.rope_sin, self.k_cache, self.v_cache,
                c.num_heads, c.num_kv_heads, c.head_dim, self.q_norm_weight, self.k_norm_weight, c.eps,
                backend=backend,
            )
            o = ops.prefill_attention(q, self.k_cache, self.v_cache, start, c.scale)
        return o.reshape(b, seq, c.num_heads * c.head_dim)


def _prologue_gemv_fits(flag: str, op: str, x: torch.Tensor, width: int, lin: WQLinear, backend: str | None) -> bool:
    """Whether the packed GEMV with an input prologue (compiled `op`, switched by backend.`flag`)
    serves x [..., width] into `lin` for this call."""
    from fastawq import backend as backend_mod

    rows = x.numel() // max(x.shape[-1], 1)
    return (getattr(backend_mod, flag) and x.shape[-1] == width
            and _gemv_form_fits(op, rows, x.dtype, x.device, lin, backend))


def _compiled_form_fits(op: str, kernel: str, rows: int, dtype: torch.dtype, device: torch.device, lin: WQLinear,
                        backend: str | None) -> bool:
    """Whether the compiled op `op` serves `rows` rows of `dtype` on `device` into `lin`: the layer is
    packed and its own dispatch picks the compiled `kernel` (backend.packed_kernel) for these rows."""
    from fastawq import _ext
    from fastawq import backend as backend_mod

    if not _ext.has_op(op) or lin.layout != "packed":
        return False
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or rows < 1:
        return False
    if backend_mod.packed_kernel(rows, device) != kernel or lin.group_size % 32 or lin.in_features % 32:
        return False
    try:
        return backend_mod.select_backend("packed_gemm", device, backend=backend or lin.backend, m=rows) == "cuda"
    except Exception:  # a forced backend that cannot run here: the usual path says why
        return False


def _gemv_form_fits(op: str, rows: int, dtype: torch.dtype, device: torch.device, lin: WQLinear,
                    backend: str | None) -> bool:
    """Whether the compiled packed-GEMV form `op` (M <= 2) serves `rows` rows into `lin`."""
    return rows <= 2 and _compiled_form_fits(op, "gemv", rows, dtype, device, lin, backend)


def _wgmma_sums_fits(rows: int, dtype: torch.dtype, device: torch.device, lin: WQLinear,
                     backend: str | None) -> bool:
    """Whether awq_wgmma_packed_sums serves `rows` rows of `dtype` into `lin` (wgmma_sums_out on, the
    layer's dispatch picks awq_wgmma_packed for these rows, and the op runs on this device)."""
    if not wgmma_sums_out() or lin.out_features % 8 \
            or not _compiled_form_fits("awq_wgmma_packed_sums", "wgmma", rows, dtype, device, lin, backend):
        return False
    return not torch.ops.fastawq.awq_wgmma_packed_declines()


def _sums_beside(x: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 sums shaped like x and a later projection's [rows, width] after them in one buffer, so one
    norm launch zeroes both: (the sums like x, the later ones, the whole buffer as [rows, H + width])."""
    h = x.shape[-1]
    buf = torch.empty(rows * (h + width), dtype=torch.float32, device=x.device)
    return buf[:rows * h].view(x.shape), buf[rows * h:].view(rows, width), buf.view(rows, h + width)


def _add_into_sums(lin: WQLinear, x2: torch.Tensor, sums: torch.Tensor, dtype: torch.dtype,
                   zero: torch.Tensor | None = None) -> None:
    """sums += lin(x2) (+ its bias) for x2 [rows, K]: awq_gemv_packed_sums at the GEMV's rows (which also
    zeroes `zero`), awq_wgmma_packed_sums at the wgmma's (the callers checked which serves)."""
    from fastawq import backend as backend_mod

    wp, sz, bias = _packed_operands(lin, dtype)
    if backend_mod.packed_kernel(x2.shape[0], x2.device) == "gemv":
        torch.ops.fastawq.awq_gemv_packed_sums(x2, wp, sz, lin.out_features, lin.group_size, bias, sums, zero)
        return
    assert zero is None, "awq_wgmma_packed_sums zeroes no other buffer"
    torch.ops.fastawq.awq_wgmma_packed_sums(x2, wp, sz, lin.out_features, lin.group_size, bias, sums)


def act_gemv_fits(gate_up: torch.Tensor, act: str, down: WQLinear, backend: str | None = None) -> bool:
    """Whether act_linear runs as fastawq::awq_gemv_packed_act for this call."""
    return act in ("silu", "gelu_pytorch_tanh", "gelu") and _prologue_gemv_fits(
        "ACT_GEMV_FUSED", "awq_gemv_packed_act", gate_up, 2 * down.in_features, down, backend)


def _packed_operands(lin: WQLinear, dtype: torch.dtype):
    sz = lin.szpacked if lin.szpacked.dtype == dtype else lin.szpacked.to(dtype)
    bias = lin.bias if lin.bias is None or lin.bias.dtype == dtype else lin.bias.to(dtype)
    return lin.wpacked, sz, bias


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float, lin: WQLinear,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lin(RMSNorm(x + residual) * (weight + offset)), x + residual): one launch
    (awq_gemv_packed_norm) where backend.NORM_GEMV_FUSED and the packed GEMV serve these rows, else
    add_rms_norm's launch and the projection."""
    fits = _prologue_gemv_fits("NORM_GEMV_FUSED", "awq_gemv_packed_norm", x, lin.in_features, lin, backend)
    if fits and weight.dtype == x.dtype and (residual is None or residual.shape == x.shape):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        r2 = None if residual is None else residual.reshape(x2.shape).contiguous()
        wp, sz, bias = _packed_operands(lin, x2.dtype)
        y, r = torch.ops.fastawq.awq_gemv_packed_norm(x2, r2, weight.contiguous(), eps, offset, wp, sz,
                                                      lin.out_features, lin.group_size, bias)
        return y.reshape(*lead, lin.out_features), (x if residual is None else r.reshape(x.shape))
    h, r = ops.add_rms_norm(x, residual, weight, eps, offset, backend=backend)
    return lin(h), r


def act_linear(gate_up: torch.Tensor, act: str, down: WQLinear, backend: str | None = None) -> torch.Tensor:
    """down(act_mul(gate_up)): one launch (awq_gemv_packed_act) where backend.ACT_GEMV_FUSED and the
    packed-layout GEMV serve these rows, else act_mul's launch and the projection."""
    if act_gemv_fits(gate_up, act, down, backend):
        lead = gate_up.shape[:-1]
        gu = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        wp, sz, bias = _packed_operands(down, gu.dtype)
        y = torch.ops.fastawq.awq_gemv_packed_act(gu, wp, sz, down.out_features, down.group_size, bias, act)
        return y.reshape(*lead, down.out_features)
    return down(ops.act_mul(gate_up, act, backend=backend))


class FusedMLP(nn.Module):
    """gate/up in one GEMM, act * mul fused, then down (a dense MLP or an MoE's shared expert)."""

    def __init__(self, mlp: nn.Module, act: str, gate_up: tuple[str, ...] = ("gate_proj", "up_proj"),
                 down: str = "down_proj"):
        super().__init__()
        self.gate_up_proj = concat_wqlinear([get_submodule(mlp, n) for n in gate_up])
        self.down_proj = get_submodule(mlp, down)
        self.act = act

    def forward(self, x: torch.Tensor | None, backend: str | None, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up: the projection already made (norm_linear); x is then unused."""
        return act_linear(self.gate_up_proj(x) if gate_up is None else gate_up, self.act, self.down_proj, backend)


def _wq_experts(experts: nn.Module, where: str) -> WQExperts:
    """The block's experts as the grouped-GEMM module (stacked from per-expert WQLinear if needed)."""
    if isinstance(experts, WQExperts):
        return experts
    if isinstance(experts, ExpertList):
        triples = [e.linears() for e in experts]
        if all(isinstance(m, WQLinear) for t in triples for m in t):
            act = experts[0].act_fn
            if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
                return WQExperts.from_experts(triples, proj_names=experts[0].names)
            raise NotImplementedError(f"{where}: experts with activation {type(act).__name__} are not fused (SiLU only)")
    raise TypeError(f"{where} is {type(experts).__name__}, not packed W4 experts: quantize the model before fusing")


def moe_sums_out() -> bool:
    """FASTAWQ_MOE_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting it
    was captured with): an MoE block without a shared expert hands its one-token output to the next
    add_rms_norm as fp32 sums (WQExperts.sums). H100, session 22: decode at batch 1 Qwen3-30B-A3B
    449.1 -> 467.0 tok/s (with FASTAWQ_MOE_H_PARTIALS), Mixtral-8x7B 276.5 -> 281.1."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_MOE_SUMS") != "0"


class FusedMoE(nn.Module):
    """A mixture-of-experts block: the router in full precision, top-k routing, the routed experts
    in one grouped W4 op (WQExperts -> ops.moe_w4), and the shared expert with its sigmoid gate
    where the architecture has one. Every step has shapes fixed by the token count and no host
    sync, so a decode step captures in a CUDA graph."""

    def __init__(self, block: nn.Module, spec: MoESpec, config: object, act: str, where: str):
        super().__init__()
        self.router_weight = get_submodule(block, spec.router).weight  # [E, H], never quantized
        self.experts = _wq_experts(get_submodule(block, spec.experts), f"{where}.{spec.experts}")
        self.top_k, self.renormalize = spec.routing(config)
        if not 1 <= self.top_k <= self.experts.num_experts:
            raise ValueError(f"{where}: top-k {self.top_k} for {self.experts.num_experts} experts")
        self.shared = None
        if spec.shared is not None:
            self.shared = FusedMLP(get_submodule(block, spec.shared), act)
        self.shared_gate_weight = get_submodule(block, spec.shared_gate).weight if spec.shared_gate else None  # [1, H]

    def set_backend(self, backend: str | None) -> None:
        self.experts.backend = backend

    # x [B, L, H] -> [B, L, H]
    def forward(self, x: torch.Tensor, backend: str | None) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = ops.route(h, self.router_weight, self.top_k, self.renormalize, backend=backend)
        return self.run(h, weights, ids, backend).reshape(x.shape)

    # a [B, L, H] (the attention output), residual [B, L, H] -> (block output, a + residual); the block
    # output may be fp32 sums (run's sums_ok): the next add_rms_norm takes them
    def forward_normed(self, a: torch.Tensor, residual: torch.Tensor, norm: nn.Module, eps: float, offset: float,
                       backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on add_rms_norm(a, residual, norm) with the norm in the routing launch."""
        shape = a.shape
        h, residual, weights, ids = ops.add_rms_norm_route(
            a.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), norm.weight, eps, offset, self.router_weight,
            self.top_k, self.renormalize, backend=backend)
        return self.run(h, weights, ids, backend, sums_ok=True).reshape(shape), residual.reshape(shape)

    # h [T, H] routed to (weights, ids) -> [T, H]: the experts, plus the shared expert where there is one;
    # sums_ok (a caller whose output goes to add_rms_norm): one token may come back as fp32 sums
    def run(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, backend: str | None,
            sums_ok: bool = False) -> torch.Tensor:
        if sums_ok and self.shared is None and moe_sums_out():
            # One token on the compiled kernel: the experts' sum stays fp32 (no conversion pass at
            # the end of the block); the next add_rms_norm rounds it to the activation dtype.
            sums = self.experts.sums(h, ids, weights)
            if sums is not None:
                return sums
        out = self.experts(h, ids, weights)
        if self.shared is not None:
            s = self.shared(h, backend)
            if self.shared_gate_weight is not None:
                s = torch.sigmoid(nn.functional.linear(h, self.shared_gate_weight.to(h.dtype))) * s
            out = out + s
        return out


class FusedDecoderLayer(nn.Module):
    def __init__(self, layer: nn.Module, cfg: FusedConfig, dtype: torch.dtype, device: torch.device,
                 arch: Architecture, moe: MoESpec | None = None, config: object = None, where: str = "layer"):
        super().__init__()
        self.cfg = cfg
        self.self_attn = FusedAttention(get_submodule(layer, arch.attn), cfg, dtype, device, arch)
        block = moe.block_of(layer) if moe is not None else None
        if block is not None:
            self.mlp = FusedMoE(block, moe, config, cfg.act, f"{where}.{moe.block}")
        else:
            self.mlp = FusedMLP(get_submodule(layer, arch.mlp), cfg.act, arch.gate_up, arch.down_proj)
        self.input_layernorm = get_submodule(layer, arch.attn_norm)
        self.post_attention_layernorm = get_submodule(layer, arch.mlp_norm)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, start: int,
        lens: torch.Tensor | None, max_len: int, backend: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous block's output (or the embeddings when residual is None); it and the
        returned output may be fp32 sums (dense_sums_out, WQExperts.sums), which add_rms_norm takes."""
        if isinstance(self.mlp, FusedMLP) and residual is not None and dense_sums_out():
            out = self._forward_sums(x, residual, positions, start, lens, max_len, backend)
            if out is not None:
                return out
        if isinstance(self.mlp, FusedMoE) and residual is not None and moe_o_sums_out():
            out = self._forward_moe_o_sums(x, residual, positions, start, lens, max_len, backend)
            if out is not None:
                return out
        c = self.cfg
        # The norm and the projection after it: one launch where norm_linear's fused GEMV serves.
        qkv, residual = norm_linear(
            x, residual, self.input_layernorm.weight, c.eps, c.norm_offset, self.self_attn.qkv_proj, backend
        )
        a = self.self_attn(None, positions, start, lens, max_len, backend, qkv=qkv)
        if isinstance(self.mlp, FusedMoE):
            return self.mlp.forward_normed(a, residual, self.post_attention_layernorm, c.eps, c.norm_offset, backend)
        gate_up, residual = norm_linear(
            a, residual, self.post_attention_layernorm.weight, c.eps, c.norm_offset, self.mlp.gate_up_proj, backend
        )
        return self.mlp(None, backend, gate_up=gate_up), residual

    def _forward_sums(
        self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, start: int,
        lens: torch.Tensor | None, max_len: int, backend: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dense layer with o_proj and down adding into fp32 sums (awq_gemv_packed_sums /
        _act_sums) that the norm before each zeroes in its own launch and the norm after each reads:
        neither projection ends with a fence, arrival count and conversion pass. None where the
        compiled GEMV forms do not serve these rows and, with wgmma_sums_out, neither does
        awq_wgmma_packed_sums (then the usual path; at the wgmma's rows act_mul keeps its launch). With
        dense_gu_sums_out, gate_up adds into fp32 sums too at the GEMV's rows (zeroed by o_proj's
        launch), which the down projection's act prologue rounds as it reads them."""
        c, attn, mlp = self.cfg, self.self_attn, self.mlp
        h = x.shape[-1]
        rows, dtype = x.numel() // h, residual.dtype
        if mlp.act not in ("silu", "gelu_pytorch_tanh", "gelu") or attn.o_proj.out_features != h \
                or mlp.down_proj.out_features != h:
            return None
        gemv = _gemv_form_fits("awq_gemv_packed_sums", rows, dtype, x.device, attn.o_proj, backend) \
            and _gemv_form_fits("awq_gemv_packed_act_sums", rows, dtype, x.device, mlp.down_proj, backend)
        if not gemv and not (_wgmma_sums_fits(rows, dtype, x.device, attn.o_proj, backend)
                             and _wgmma_sums_fits(rows, dtype, x.device, mlp.down_proj, backend)):
            return None
        gu = mlp.gate_up_proj
        gu_sums = None
        gu_pairs = gu.out_features == 2 * mlp.down_proj.in_features  # [gate, up] for the down projection
        if gemv and dense_gu_sums_out() and gu_pairs \
                and _gemv_form_fits("awq_gemv_packed_sums", rows, dtype, x.device, gu, backend):
            gu_sums = torch.empty((rows, gu.out_features), dtype=torch.float32, device=x.device)
        # The wgmma's rows with wgmma_gu_sums_out: gate_up's fp32 sums after the down projection's in
        # one buffer, which the post-attention norm zeroes in its launch.
        gu_wgmma = not gemv and wgmma_gu_sums_out(rows) and gu_pairs \
            and _wgmma_sums_fits(rows, dtype, x.device, gu, backend)
        o_sums, residual = self._attention_sums(x, residual, positions, start, lens, max_len, backend, gu_sums)
        if gu_wgmma:
            d_sums, gu_sums, zero = _sums_beside(x, rows, gu.out_features)
        else:
            d_sums = zero = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        h2, residual = ops.add_rms_norm(o_sums, residual, self.post_attention_layernorm.weight, c.eps, c.norm_offset,
                                        backend=backend, zero=zero)
        if gu_wgmma:
            _add_into_sums(gu, h2.reshape(rows, -1).contiguous(), gu_sums, dtype)
            a = ops.act_mul_sums(gu_sums, mlp.act, dtype, backend=backend)
            _add_into_sums(mlp.down_proj, a, d_sums.view(rows, h), dtype)
            return d_sums, residual
        if gu_sums is not None:
            wp, sz, bias = _packed_operands(gu, dtype)
            torch.ops.fastawq.awq_gemv_packed_sums(h2.reshape(rows, -1).contiguous(), wp, sz, gu.out_features,
                                                   gu.group_size, bias, gu_sums)
            gate_up = gu_sums
        else:
            gate_up = gu(h2)
        if gemv:
            wp, sz, bias = _packed_operands(mlp.down_proj, dtype)
            torch.ops.fastawq.awq_gemv_packed_act_sums(gate_up.reshape(rows, -1).contiguous(), wp, sz, h,
                                                       mlp.down_proj.group_size, bias, mlp.act, d_sums.view(rows, h))
        else:  # the wgmma's rows: act_mul's launch, then the down projection adds into the sums
            a = ops.act_mul(gate_up, mlp.act, backend=backend)
            _add_into_sums(mlp.down_proj, a.reshape(rows, -1).contiguous(), d_sums.view(rows, h), dtype)
        return d_sums, residual

    def _forward_moe_o_sums(
        self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, start: int,
        lens: torch.Tensor | None, max_len: int, backend: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MoE layer with o_proj adding into fp32 sums (awq_gemv_packed_sums) that the input norm
        zeroes in its own launch and the compiled router's add + RMSNorm reads (moe_route on fp32 x):
        o_proj ends without its fence, arrival count and conversion pass. None where the compiled
        GEMV form or the cluster router does not serve these rows (then the usual path)."""
        c, attn, moe = self.cfg, self.self_attn, self.mlp
        h = x.shape[-1]
        rows, dtype = x.numel() // h, residual.dtype
        if attn.o_proj.out_features != h \
                or not _gemv_form_fits("awq_gemv_packed_sums", rows, dtype, x.device, attn.o_proj, backend):
            return None
        if not self._router_takes_sums(rows, h, dtype, x.device, backend):
            return None
        o_sums, residual = self._attention_sums(x, residual, positions, start, lens, max_len, backend)
        return moe.forward_normed(o_sums, residual, self.post_attention_layernorm, c.eps, c.norm_offset, backend)

    def _attention_sums(
        self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, start: int,
        lens: torch.Tensor | None, max_len: int, backend: str | None, zero: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (zeroing the fp32 sums o_proj adds into), QKV, attention and o_proj as
        awq_gemv_packed_sums (which also zeroes `zero`, a later projection's sums; at the wgmma's rows
        awq_wgmma_packed_sums, _add_into_sums): (o_proj's fp32
        sums shaped like x, x + residual). The callers checked that the compiled form serves. With
        qkv_sums_out, a decode step's QKV projection adds into fp32 sums too (beside o_proj's in one
        buffer, which the norm zeroes in its launch), which the compiled rope attention rounds as it
        reads them: the projection ends without its fence, arrival count and conversion pass."""
        c, attn = self.cfg, self.self_attn
        h = x.shape[-1]
        rows, dtype = x.numel() // h, residual.dtype
        qkv_lin = attn.qkv_proj
        if lens is not None and qkv_sums_out() and self._qkv_takes_sums(rows, h, dtype, x.device, backend):
            wq = qkv_lin.out_features
            o_sums, qkv_sums, both = _sums_beside(x, rows, wq)
            h1, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, c.eps, c.norm_offset,
                                            backend=backend, zero=both)
            _add_into_sums(qkv_lin, h1.reshape(rows, h).contiguous(), qkv_sums, dtype)
            qkv = qkv_sums.view(*x.shape[:-1], wq)
        else:
            o_sums = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            h1, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, c.eps, c.norm_offset,
                                            backend=backend, zero=o_sums)
            qkv = qkv_lin(h1)
        o = attn.attend(qkv, positions, start, lens, max_len, backend)
        _add_into_sums(attn.o_proj, o.reshape(rows, -1).contiguous(), o_sums.view(rows, h), residual.dtype, zero)
        return o_sums, residual

    def _qkv_takes_sums(self, rows: int, h: int, dtype: torch.dtype, device: torch.device,
                        backend: str | None) -> bool:
        """Whether a decode step of `rows` rows runs the QKV projection as awq_gemv_packed_sums (or, at
        the wgmma's rows with wgmma_sums_out, awq_wgmma_packed_sums) into fp32 sums that the compiled
        rope attention reads (ops.layer.rope_attention_fused on fp32 qkv), asked once per (rows,
        dtype, backend, switch) rather than every step."""
        key = (rows, dtype, backend, wgmma_sums_out())
        cache = self.__dict__.setdefault("_qkv_sums_cache", {})
        if key not in cache:
            from fastawq.ops.layer import rope_attention_fused

            c, attn, lin = self.cfg, self.self_attn, self.self_attn.qkv_proj
            wq = lin.out_features
            ok = h % 8 == 0 and wq % 8 == 0 and (
                _gemv_form_fits("awq_gemv_packed_sums", rows, dtype, device, lin, backend)
                or _wgmma_sums_fits(rows, dtype, device, lin, backend))
            if ok:
                # Shapes and dtypes only (no fill: this may run under a graph's capture).
                probe = torch.empty((rows, 1, wq), dtype=torch.float32, device=device)
                lens = torch.empty(rows, dtype=torch.int32, device=device)
                positions = torch.empty((rows, 1), dtype=torch.int32, device=device)
                ok = attn.k_cache.dtype == dtype and rope_attention_fused(
                    probe, attn.k_cache, lens, c.num_heads, backend, positions=positions, cos=attn.rope_cos,
                    sin=attn.rope_sin, q_norm_weight=attn.q_norm_weight, k_norm_weight=attn.k_norm_weight)
            cache[key] = ok
        return cache[key]

    def _router_takes_sums(self, rows: int, h: int, dtype: torch.dtype, device: torch.device,
                           backend: str | None) -> bool:
        """Whether the MoE block's add_rms_norm_route runs fp32 sums [rows, h] on the compiled router
        (ops.moe.norm_route_takes_sums), asked once per (rows, dtype, backend) rather than every step."""
        key = (rows, dtype, backend)
        cache = self.__dict__.setdefault("_router_sums_cache", {})
        if key not in cache:
            from fastawq.ops import moe as ops_moe

            norm, moe = self.post_attention_layernorm.weight, self.mlp
            probe = torch.empty((rows, h), dtype=torch.float32, device=device)
            cache[key] = norm.dtype == dtype and ops_moe.norm_route_takes_sums(
                probe, norm, moe.router_weight, moe.top_k, "softmax", None, backend)
        return cache[key]


def qkv_sums_out() -> bool:
    """FASTAWQ_QKV_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting it
    was captured with): in the sums layers (dense_sums_out, moe_o_sums_out) a decode step's QKV
    projection adds into fp32 sums that the input norm zeroes and the compiled rope attention rounds
    as it reads them (FusedDecoderLayer._attention_sums). H100, session 27: decode +0.9 % / +1.9 %
    Llama-3-8B shape at batch 1 / 2, +3.3 % / +5.7 % Qwen3-30B-A3B (with the MoE o_proj's sums)."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_QKV_SUMS") != "0"


def moe_o_sums_out() -> bool:
    """FASTAWQ_MOE_O_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting
    it was captured with): an MoE layer's o_proj at one or two rows adds into fp32 sums that the
    input norm zeroes and the compiled router's norm reads (FusedDecoderLayer._forward_moe_o_sums).
    H100, session 27: Qwen3-30B-A3B decode +2.4 % / +1.3 % at batch 1 / 2."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_MOE_O_SUMS") != "0"


def dense_gu_sums_out() -> bool:
    """FASTAWQ_DENSE_GU_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting
    it was captured with): in the dense-sums layer (dense_sums_out) gate_up also adds into fp32
    sums, which o_proj's launch zeroes and the down projection's act prologue rounds as it reads
    them: gate_up's launch ends without its fence, arrival count and conversion pass, as o_proj's
    and down's do. H100, session 27: Llama-3-8B shape decode +1.9 % / +3.0 % at batch 1 / 2."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_DENSE_GU_SUMS") != "0"


def wgmma_sums_out() -> bool:
    """FASTAWQ_WGMMA_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting it
    was captured with): the dense-sums layer (dense_sums_out) serves the rows that awq_wgmma_packed
    takes on sm_90 too (decode batches 9-64): QKV, o_proj and the down projection add into fp32 sums
    through awq_wgmma_packed_sums, so none ends with the split-K arrival count and conversion pass;
    the norms after them round the sums as at batch 1. Session 35 (H200, Llama-3-8B shape, same run):
    batch 9 / 16 / 32 decode 2,543.4 / 4,240.1 / 6,949.4 tok/s off, 2,641.1 / 4,475.4 / 7,515.6 on
    (1.038x / 1.055x / 1.081x)."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_WGMMA_SUMS") != "0"


def wgmma_gu_sums_out(rows: int) -> bool:
    """FASTAWQ_WGMMA_GU_SUMS ("1" on, "0" off; unset: on except at 17-32 rows; read at each call, so a
    captured graph keeps the setting it was captured with): at the rows awq_wgmma_packed_sums serves,
    gate_up adds into fp32 sums too (zeroed by the post-attention norm's launch with the down
    projection's, one buffer), which act_mul_sums rounds as it reads them: gate_up, the step's largest
    projection, ends without its split-K fence, arrival count and last block's conversion pass
    (session 36, H100: that tail's barrier, fence and conversion held ~20 % of the 16-token tile's
    stall samples at 4096 x 28672). Session 38 (H100, Llama-3-8B shape, bench_ab.py --compare
    env:FASTAWQ_WGMMA_GU_SUMS=0,1, same call): decode 1.012x / 1.024x / 1.043x / 1.026x at batch 9 / 16 /
    32 / 64. Since session 39 the plain op's K splits meet in a cluster instead of that tail (at 4096
    x 28672 and 32 tokens 41.8 us against 61.4), and on the 32-token tile (2 splits) gate_up plain then
    act_mul decoded 1.030x at batch 20 and 1.031-1.034x at 32 against the sums (batch 16: 0.984x; H100,
    bench_ab.py --compare env:FASTAWQ_WGMMA_GU_SUMS=1,0, two calls)."""
    from fastawq import backend as backend_mod

    v = backend_mod.env_switch(b"FASTAWQ_WGMMA_GU_SUMS")
    if v not in ("0", "1"):
        return not 16 < rows <= 32
    return v == "1"


def dense_sums_out() -> bool:
    """FASTAWQ_DENSE_SUMS (on unless "0"; read at each call, so a captured graph keeps the setting
    it was captured with): a dense layer's o_proj and down projection at one or two rows add into
    fp32 sums that the next add_rms_norm rounds (FusedDecoderLayer._forward_sums). H100, session 22:
    Llama-3-8B shape decode 392.9 -> 408.2 tok/s at batch 1, 716.0 -> 753.3 at batch 2."""
    from fastawq import backend as backend_mod

    return backend_mod.env_switch(b"FASTAWQ_DENSE_SUMS") != "0"


class _DecodeGraph:
    """Static buffers and one captured decode step for one batch size."""

    def __init__(self, runtime: "FusedRuntime", batch: int, device: torch.device):
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.int32, device=device)
        self.lens = torch.ones(batch, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.runtime = runtime

    def _step(self) -> torch.Tensor:
        r = self.runtime
        return r._forward(self.ids, self.positions, 0, self.lens, r.cfg.max_seq_len)

    def capture(self) -> None:
        # Warm-up runs compile and autotune every kernel outside the capture; their cache writes
        # land on the position the first replay writes again. Warm-up and capture run on the
        # current stream (the runtime's own, FusedRuntime._on_stream), not torch.cuda.graph's
        # default side stream: cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has
        # run on, for the life of the process, and the prefill's lm_head made this stream's already.
        for _ in range(2):
            self._step()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=torch.cuda.current_stream()):
            self.logits = self._step()


def _external_workspaces() -> tuple:
    """Addresses of the Triton GEMM's split-K scratch buffers (reused across calls, regrown on
    demand): a graph captured over one of them must not outlive it."""
    import sys

    launch = sys.modules.get("fastawq.triton_kernels.launch")
    ws = getattr(launch, "_WORKSPACE", None)
    bufs = getattr(ws, "buffers", None)
    if not isinstance(bufs, dict):
        return ()
    return tuple((str(d), tuple(t.data_ptr() for t in v if t is not None)) for d, v in bufs.items())


class FusedRuntime:
    """Runs a fused model: prefill (eager, SDPA) and decode (CUDA-graph replay on GPU)."""

    def __init__(self, model: nn.Module, cfg: FusedConfig, use_cuda_graphs: bool = True, backend: str | None = None,
                 prefill_chunk: int | None = None):
        self.model = model
        # The modules a step runs, found once through the architecture record.
        arch = architecture_of(model)
        self.embed = get_submodule(model, arch.embed_path)
        self.layers = get_submodule(model, arch.layers_path)
        self.final_norm = get_submodule(model, arch.final_norm_path)
        self.lm_head = get_submodule(model, arch.lm_head_path)
        self.prefill_chunk = prefill_chunk
        self.cfg = cfg
        self.use_cuda_graphs = use_cuda_graphs
        self.backend = backend
        self.length = 0  # tokens in the cache (all rows share it)
        self.batch = 0
        self._graphs: dict[int, _DecodeGraph] = {}
        self._workspaces: tuple = ()
        self._stream: torch.cuda.Stream | None = None
        self.cpu_step = None  # fused_cpu.CPUDecodeStep where it serves the model (set by fuse_model)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @contextlib.contextmanager
    def _on_stream(self):
        """Run the block on the runtime's own CUDA stream (no-op off CUDA), ordered after the
        caller's stream on entry and before it on exit. Prefill, warm-up, capture and replay all
        share it, so cuBLAS keeps one workspace for the engine (torch.cuda.graph's own capture
        stream would hold a second 32 MiB one) and capture never runs on the legacy default stream."""
        if self.device.type != "cuda":
            yield None
            return
        if self._stream is None or self._stream.device != self.device:
            self._stream = torch.cuda.Stream(self.device)
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._stream):
                yield caller
        finally:
            caller.wait_stream(self._stream)

    def check_fits(self, batch: int, total_len: int) -> None:
        c = self.cfg
        if batch > c.batch_size:
            raise CacheOverflowError(f"batch {batch} exceeds the fused cache's batch_size={c.batch_size}")
        if total_len > c.max_seq_len:
            raise CacheOverflowError(
                f"{total_len} tokens (prompt + generation) exceed the fused cache's max_seq_len={c.max_seq_len}"
            )

    def reset(self) -> None:
        self.length = 0

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, start: int, lens: torch.Tensor | None,
        max_len: int, keep: int = 1,
    ) -> torch.Tensor | None:
        """Logits [B, keep, V] of the last `keep` positions (None when keep is 0)."""
        x = self.embed(ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, start, lens, max_len, self.backend)
        c = self.cfg
        if keep <= 0:
            return None
        if keep < x.shape[1]:
            x, residual = x[:, -keep:], residual[:, -keep:]
        h, _ = ops.add_rms_norm(x, residual, self.final_norm.weight, c.eps, c.norm_offset, backend=self.backend)
        return self.lm_head(h)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, start: int = 0, last_only: bool = True,
                logits_to_keep: int | None = None) -> torch.Tensor:
        """Logits [B, n, V] of the last n of ids [B, L] placed at positions start..start+L-1: n = 1
        (last_only), L (last_only=False), or logits_to_keep where given (0: all L, as transformers)."""
        if ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(ids.shape)} must be [batch, length]")
        b, seq = ids.shape
        if start != 0 and b != self.batch:
            raise CacheOverflowError(f"continuing a batch of {self.batch} with {b} rows")
        self.check_fits(b, start + seq)
        if start > self.length:
            raise ValueError(f"start={start} is past the {self.length} cached tokens")
        if logits_to_keep is not None and logits_to_keep < 0:
            raise ValueError(f"logits_to_keep={logits_to_keep} must be >= 0")
        ids = ids.to(self.device)
        keep = (1 if last_only else seq) if logits_to_keep is None else min(logits_to_keep or seq, seq)
        # Chunks bound the activations (the gate/up output alone is B x L x 2I) so long prompts and
        # large batches fit the same memory as short ones: prefill_chunk tokens over the batch's rows
        # a chunk. Each chunk attends to the cache written before it.
        chunk = max(1, self.prefill_chunk // b) if self.prefill_chunk else seq
        with self._on_stream() as caller:
            logits = self._prefill_chunks(ids, start, keep, chunk)
            if caller is not None and logits is not None:
                logits.record_stream(caller)  # allocated on the runtime's stream, read on the caller's
        if self._graphs and _external_workspaces() != self._workspaces:
            # A GEMM backend replaced a scratch buffer (regrown, or released after tuning): recapture.
            self._graphs.clear()
        return logits

    def _prefill_chunks(self, ids: torch.Tensor, start: int, keep: int, chunk: int) -> torch.Tensor | None:
        b, seq = ids.shape
        logits = None
        for c0 in range(0, seq, chunk):
            c1 = min(seq, c0 + chunk)
            pos = torch.arange(start + c0, start + c1, dtype=torch.int32, device=ids.device)
            n = max(0, c1 - max(c0, seq - keep))  # this chunk's positions among the kept ones
            out = self._forward(ids[:, c0:c1], pos.expand(b, c1 - c0).contiguous(), start + c0, None,
                                start + c1, n)
            self.batch, self.length = b, start + c1
            if out is None:
                continue
            if n == keep:
                logits = out
            else:
                # Written chunk by chunk into one tensor: a list of chunks and their concatenation
                # would hold every kept logit twice (2 x 0.5 GiB for 2048 positions of 128k vocab).
                if logits is None:
                    logits = out.new_empty((b, keep, out.shape[-1]))
                at = c1 - (seq - keep)
                logits[:, at - n:at].copy_(out)
            del out
        return logits

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one new token per row (ids [B] or [B, 1]) after the cached ones."""
        ids = ids.reshape(-1, 1)
        b = ids.shape[0]
        if b != self.batch or self.length == 0:
            raise ValueError(f"decode of {b} rows needs a prefill of the same batch first (have {self.batch})")
        self.check_fits(b, self.length + 1)
        pos = self.length
        if self.use_cuda_graphs and self.device.type == "cuda":
            with self._on_stream() as caller:
                g = self._graphs.get(b)
                if g is None or g.ids.device != self.device:
                    g = self._graphs[b] = _DecodeGraph(self, b, self.device)
                g.ids.copy_(ids)
                g.positions.fill_(pos)
                g.lens.fill_(pos + 1)
                if g.graph is None:
                    g.capture()
                    self._workspaces = _external_workspaces()
                g.graph.replay()
                logits = g.logits.clone()  # the static output is overwritten by the next replay
                logits.record_stream(caller)
        elif self.cpu_step is not None:
            logits = self.cpu_step(ids, pos)
        else:
            positions = torch.full((b, 1), pos, dtype=torch.int32, device=self.device)
            lens = torch.full((b,), pos + 1, dtype=torch.int32, device=self.device)
            logits = self._forward(ids.to(self.device), positions, pos, lens, pos + 1)
        self.length = pos + 1
        return logits[:, -1]


def _fused_config(model: nn.Module, max_seq_len: int, batch_size: int) -> tuple[FusedConfig, Architecture]:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    arch = architecture_of(model)
    if arch.fused_blocker is not None:
        raise NotImplementedError(
            f"fuse_layers is not implemented for model_type={mt!r}: {arch.fused_blocker} (load with fuse_layers=False)"
        )
    if arch.norm != "rms" or not arch.gated_mlp or arch.rotary_path is None:
        raise NotImplementedError(
            f"{mt}: the fused engine needs RMSNorm, rotary positions and a gated MLP; the record has "
            f"norm={arch.norm!r}, rotary_path={arch.rotary_path!r}, gated_mlp={arch.gated_mlp}"
        )
    if max_seq_len < 1 or batch_size < 1:
        raise ValueError(f"max_seq_len={max_seq_len} and batch_size={batch_size} must be positive")
    # Qwen2-MoE's config says 0 (and Qwen's use_sliding_window=False) for no window.
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) is not False else None
    if window and max_seq_len > window:
        raise NotImplementedError(
            f"{mt} uses sliding-window attention of {window} tokens; fused layers support "
            f"max_seq_len <= {window}, got {max_seq_len}"
        )
    rope = getattr(cfg, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise NotImplementedError(f"{mt}: partial rotary embeddings are not fused (partial_rotary_factor < 1)")
    act = getattr(cfg, arch.act_attr, None) or getattr(cfg, "hidden_act", "silu")
    if act not in ops.ACTIVATIONS:
        raise NotImplementedError(f"{mt}: activation {act!r} is not fused; supported {ops.ACTIVATIONS}")
    attn0 = get_submodule(get_submodule(model, arch.layers_path)[0], arch.attn)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch.qk_norm is not None:
        n = get_submodule(attn0, arch.qk_norm[0]).weight.numel()
        if n != head_dim:
            raise NotImplementedError(f"{mt}: q/k norms over {n} channels (not one head of {head_dim}) are not fused")
    fc = FusedConfig(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        norm_offset=arch.norm_offset,
        act=act,
        scale=float(getattr(attn0, "scaling", head_dim ** -0.5)),
        qk_norm=arch.qk_norm is not None,
        max_seq_len=max_seq_len,
        batch_size=batch_size,
    )
    return fc, arch


def _rope_tables(model: nn.Module, max_seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, head_dim] fp32 from the model's own rotary module (any rope scaling),
    run on a CPU copy of it and moved to `device`: on a GPU its forward's matmul would be the first
    cuBLAS call on the current stream, whose workspace (32 MiB on Hopper) the caching allocator keeps
    for the life of the process beside the engine's own stream's (benchmarks/RESULTS.md session 27:
    it was what put the Llama-3-8B shape's batch-1 peak over 6 GiB). A copy also leaves the module
    as it was where its forward updates its state (dynamic rope). A module under an accelerate hook
    (device_map dispatch, which would move a copy's inputs back to its GPU) runs where it is."""
    rot = get_submodule(model, architecture_of(model).rotary_path)
    run_on = device
    if getattr(rot, "_hf_hook", None) is None:
        rot, run_on = copy.deepcopy(rot).to("cpu"), torch.device("cpu")
    pos = torch.arange(max_seq_len, device=run_on)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32, device=run_on), pos)
    return cos[0].float().contiguous().to(device), sin[0].float().contiguous().to(device)


def fuse_model(
    model: nn.Module,
    max_seq_len: int,
    batch_size: int,
    *,
    use_cuda_graphs: bool = True,
    backend: str | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    kernels: str | None = None,
    cpu_lm_head_bits: int | None = 8,
) -> nn.Module:
    """Swap each decoder layer of a W4 (WQLinear) Llama-like causal LM for fused modules, in place.

    Preallocates the KV cache [batch_size, max_seq_len, kv_heads, head_dim] per layer; prompts
    are prefilled in chunks of at most prefill_chunk tokens over the batch's rows (a batch of B
    prompts: prefill_chunk // B positions a chunk; None: in one pass). Afterwards
    `model(input_ids)` runs a fresh prefill, `model.generate(...)` runs fastawq.generate, and
    `model.fastawq_runtime` exposes prefill/decode steps. `backend` (cuda | triton | cpu | torch,
    None: dispatch decides) is forced on every op of the fused model, its WQLinear layers included;
    `kernels` is its deprecated former name. On the CPU, decode runs fused_cpu.CPUDecodeStep where
    it can, with an 8-bit lm_head unless `cpu_lm_head_bits=None`."""
    if kernels is not None:
        if backend is not None and backend != kernels:
            raise ValueError(f"backend={backend!r} and its deprecated alias kernels={kernels!r} disagree")
        warnings.warn("fuse_model(kernels=...) is deprecated; use backend=...", DeprecationWarning, stacklevel=2)
        backend = kernels
    cfg, arch = _fused_config(model, max_seq_len, batch_size)
    emb = get_submodule(model, arch.embed_path).weight
    dtype = emb.dtype  # activations (and so the cache) run in the embeddings' dtype
    device = emb.device
    layers = get_submodule(model, arch.layers_path)
    for i, layer in enumerate(layers):
        for name in (*arch.qkv, arch.o_proj):
            if not isinstance(get_submodule(get_submodule(layer, arch.attn), name), WQLinear):
                raise TypeError(f"layer {i} {arch.attn}.{name} is not a WQLinear: quantize the model before fusing")
    cos, sin = _rope_tables(model, max_seq_len, device)
    moe = moe_spec_of(model)
    fused = []
    for i in range(len(layers)):
        f = FusedDecoderLayer(layers[i], cfg, dtype, device, arch, moe, model.config, f"{arch.layers_path}.{i}")
        # One table shared by all layers (plain attributes, not buffers: the fused model's device
        # is fixed at fuse time, like its cache).
        f.self_attn.rope_cos, f.self_attn.rope_sin = cos, sin
        fused.append(f)
        layers[i] = f  # drop the unfused q/k/v and gate/up as we go
    set_submodule(model, arch.layers_path, nn.ModuleList(fused))
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be positive or None")
    if backend is not None:
        for module in model.modules():
            if isinstance(module, (WQLinear, FusedMoE)):
                module.set_backend(backend)
    runtime = FusedRuntime(model, cfg, use_cuda_graphs=use_cuda_graphs, backend=backend, prefill_chunk=prefill_chunk)
    if device.type == "cpu" and backend in (None, "cpu"):
        from fastawq.modules import fused_cpu

        moe_layers = sum(isinstance(f.mlp, FusedMoE) for f in fused)
        why = f"{moe_layers} mixture-of-experts blocks" if moe_layers else fused_cpu.why_not(runtime)
        if why is None:
            runtime.cpu_step = fused_cpu.CPUDecodeStep(runtime, cpu_lm_head_bits)
        else:
            log.info("fused CPU decode step not used (%s): decoding through the generic ops", why)
    object.__setattr__(model, "fastawq_runtime", runtime)
    model.forward = types.MethodType(_fused_forward, model)
    model.generate = types.MethodType(_fused_generate, model)
    log.info(
        "fused %d layers of %s: KV cache %d x %d x %d x %d %s (%.1f MiB)", len(fused), model.config.model_type,
        batch_size, max_seq_len, cfg.num_kv_heads, cfg.head_dim, dtype,
        2 * len(fused) * batch_size * max_seq_len * cfg.num_kv_heads * cfg.head_dim * emb.element_size() / 2**20,
    )
    return model


def _fused_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   start_pos: int = 0, logits_to_keep: int = 0, **_: object):
    """HF-shaped forward: a prefill at start_pos (0 = a fresh sequence) returning the logits of the
    last logits_to_keep positions (0: every position, as transformers)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("fused layers take unpadded batches (attention_mask must be all ones)")
    if not isinstance(logits_to_keep, int):
        raise NotImplementedError("the fused forward takes logits_to_keep as an int (the last n positions)")
    logits = self.fastawq_runtime.prefill(input_ids, start=start_pos, logits_to_keep=logits_to_keep)
    return CausalLMOutputWithPast(logits=logits)


def _fused_generate(self, input_ids: torch.Tensor | None = None, **kwargs):
    """transformers-style generate() for fused models, served by fastawq.generate."""
    from fastawq.generate import generate_hf_style

    return generate_hf_style(self, input_ids, **kwargs)
