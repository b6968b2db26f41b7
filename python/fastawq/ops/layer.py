"""The decoder-layer ops: add + RMSNorm, act(gate) * up, rope + KV-cache write, decode and prefill
attention, with their torch.library schemas and fake impls.

Each wrapper validates its inputs (the message names the shapes), asks backend.select_backend
once, and calls one op: the compiled decode attention of fastawq._C, or a Python custom op
(`fastawq::rms_norm`, `add_rms_norm`, `act_mul`, `rope_kv_cache`, `decode_attention_into`) whose
impl runs the chosen Triton kernel (triton_kernels/) or the torch reference (reference.py). The
backend travels as a string argument, so torch.compile sees one op and opcheck covers each path;
eager calls run the impl without the dispatcher round trip (see _call).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastawq import _ext, reference
from fastawq import backend as _backend
from fastawq.backend import select_backend
from fastawq.ops._common import HALF, check_same_device
from fastawq.ops._common import call_op as _call
from fastawq.ops._common import triton_module as _triton

ACTIVATIONS = reference.ACTIVATIONS


# --- add + RMSNorm ---------------------------------------------------------------------------


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, backend: str) -> torch.Tensor:
    x = x.contiguous()
    if backend == "triton":
        return _triton().add_rms_norm(x, None, weight, eps, offset)[0]
    return reference.rms_norm(x, weight, eps, offset)


_rms_norm_op = torch.library.custom_op("fastawq::rms_norm", _rms_norm_impl, mutates_args=())


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, backend):
    torch._check(weight.shape == (x.shape[-1],), lambda: f"norm weight {tuple(weight.shape)} vs x {tuple(x.shape)}")
    return x.new_empty(x.shape)


def _add_rms_norm_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    if backend == "triton":
        return _triton().add_rms_norm(x, residual, weight, eps, offset)
    return reference.add_rms_norm(x, residual, weight, eps, offset)


_add_rms_norm_op = torch.library.custom_op("fastawq::add_rms_norm", _add_rms_norm_impl, mutates_args=())


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, offset, backend):
    torch._check(residual.shape == x.shape, lambda: f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
    torch._check(weight.shape == (x.shape[-1],), lambda: f"norm weight {tuple(weight.shape)} vs x {tuple(x.shape)}")
    return residual.new_empty(x.shape), residual.new_empty(x.shape)


def _add_rms_norm_zero_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, backend: str,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":  # the zeroing rides in the norm's own launch
        return _triton().add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps, offset, zero=zero)
    zero.zero_()
    return _add_rms_norm_impl(x, residual, weight, eps, offset, backend)


_add_rms_norm_zero_op = torch.library.custom_op(
    "fastawq::add_rms_norm_zero", _add_rms_norm_zero_impl, mutates_args=("zero",)
)


@_add_rms_norm_zero_op.register_fake
def _(x, residual, weight, eps, offset, backend, zero):
    return _add_rms_norm_fake(x, residual, weight, eps, offset, backend)


# x [..., H] · residual [..., H] or None · weight [H]  ->  (y [..., H], residual' = x + residual)
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    *,
    backend: str | None = None,
    zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) * (weight + offset), and the new residual stream (x + residual; x
    itself when residual is None). offset is 1.0 for Gemma's (1 + weight) norms. With a residual, x
    may be fp32 beside a half-precision residual (an MoE block's unconverted sums, WQExperts.sums,
    or a projection's, awq_gemv_packed_sums): it is rounded to the residual's dtype first, and both
    outputs take that dtype. zero (with a residual): a contiguous fp32 tensor [rows, Z] (rows those of
    x, any width Z: o_proj's sums of x's shape, or those beside the QKV projection's), filled with
    zeros in the same launch, for later projections' sums to be added into."""
    h = x.shape[-1]
    if tuple(weight.shape) != (h,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {h} of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and x.dtype != residual.dtype and x.dtype != torch.float32:
        raise ValueError(f"x is {x.dtype} and the residual {residual.dtype}: x must have the residual's dtype, "
                         "or be fp32 sums")
    device = check_same_device(x=x, residual=residual, weight=weight)
    be = select_backend("add_rms_norm", device, backend=backend)
    if zero is not None:
        rows = x.numel() // h if h else 0
        if (residual is None or zero.dtype != torch.float32 or not zero.is_contiguous() or zero.dim() < 1
                or zero.shape[-1] < 1 or zero.numel() != rows * zero.shape[-1]):
            raise ValueError(f"zero must be a contiguous fp32 tensor [rows={rows}, Z] (x {tuple(x.shape)}) beside a "
                             f"residual, got {zero.dtype} {tuple(zero.shape)}")
        check_same_device(x=x, zero=zero)
        return _call(torch.ops.fastawq.add_rms_norm_zero, _add_rms_norm_zero_impl, x, residual, weight, eps, offset,
                     be, zero)
    if residual is None:
        return _call(torch.ops.fastawq.rms_norm, _rms_norm_impl, x, weight, eps, offset, be), x
    y, r = _call(torch.ops.fastawq.add_rms_norm, _add_rms_norm_impl, x, residual, weight, eps, offset, be)
    return y, r


# --- act(gate) * up ----------------------------------------------------------------------------


def _act_mul_impl(gate_up: torch.Tensor, act: str, backend: str) -> torch.Tensor:
    if backend == "triton":
        return _triton().act_mul(gate_up, act)
    return reference.act_mul(gate_up, act).contiguous()


_act_mul_op = torch.library.custom_op("fastawq::act_mul", _act_mul_impl, mutates_args=())


@_act_mul_op.register_fake
def _(gate_up, act, backend):
    torch._check(gate_up.shape[-1] % 2 == 0, lambda: f"gate_up {tuple(gate_up.shape)} needs an even last dim")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# gate_up [..., 2I] (gate columns, then up columns)  ->  act(gate) * up [..., I]
def act_mul(gate_up: torch.Tensor, act: str = "silu", *, backend: str | None = None) -> torch.Tensor:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not fused; supported: {ACTIVATIONS}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must have an even last dimension")
    be = select_backend("act_mul", gate_up.device, backend=backend)
    return _call(torch.ops.fastawq.act_mul, _act_mul_impl, gate_up, act, be)


def act_mul_sums(gu_sums: torch.Tensor, act: str, dtype: torch.dtype, *, backend: str | None = None) -> torch.Tensor:
    """act(gate) * up in `dtype` from a gate_up projection's fp32 sums [..., 2I] (FASTAWQ_WGMMA_GU_SUMS):
    gate and up rounded to `dtype` first, as the projection's own conversion would have stored them,
    so the result equals act_mul of the rounded sums; on Triton in one launch."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not fused; supported: {ACTIVATIONS}")
    if gu_sums.dtype != torch.float32 or gu_sums.dim() < 1 or gu_sums.shape[-1] % 2:
        raise ValueError(f"gu_sums must be fp32 with an even last dimension, got {gu_sums.dtype} "
                         f"{tuple(gu_sums.shape)}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"act_mul_sums: dtype must be float16 or bfloat16, got {dtype}")
    if select_backend("act_mul", gu_sums.device, backend=backend) == "triton":
        return _triton().act_mul(gu_sums, act, out_dtype=dtype)
    return reference.act_mul(gu_sums.to(dtype), act)


# --- rotary embedding + KV-cache write --------------------------------------------------------


def _rope_kv_cache_impl(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    backend: str,
) -> torch.Tensor:
    impl = _triton().rope_kv_cache if backend == "triton" else reference.rope_kv_cache
    return impl(
        qkv, positions, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
        eps,
    ).contiguous()


_rope_kv_cache_op = torch.library.custom_op(
    "fastawq::rope_kv_cache", _rope_kv_cache_impl, mutates_args=("k_cache", "v_cache")
)


@_rope_kv_cache_op.register_fake
def _(qkv, positions, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim, qn, kn, eps, backend):
    torch._check(qkv.dim() == 3, lambda: f"qkv {tuple(qkv.shape)} must be [B, L, (HQ + 2 HKV) D]")
    torch._check(
        qkv.shape[-1] == (num_heads + 2 * num_kv_heads) * head_dim,
        lambda: f"qkv {tuple(qkv.shape)} vs {num_heads}+2x{num_kv_heads} heads of {head_dim}",
    )
    torch._check(positions.shape == qkv.shape[:2], lambda: f"positions {tuple(positions.shape)} vs qkv")
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], num_heads, head_dim))


# qkv [B, L, (HQ + 2 HKV) D] · positions [B, L] int32 · cos/sin [S, D] fp32 · caches [B', S, HKV, D]
def rope_kv_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate q, k; write k, v into the caches at `positions`; return q [B, L, HQ, D]."""
    if qkv.dim() != 3 or qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads of {head_dim}")
    if tuple(positions.shape) != tuple(qkv.shape[:2]):
        raise ValueError(f"positions {tuple(positions.shape)} must be {tuple(qkv.shape[:2])} to match qkv")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must be "
            f"[B, S, {num_kv_heads}, {head_dim}]"
        )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    device = check_same_device(qkv=qkv, positions=positions, cos=cos, k_cache=k_cache, v_cache=v_cache)
    be = select_backend("rope_kv_cache", device, backend=backend)
    return _call(
        torch.ops.fastawq.rope_kv_cache, _rope_kv_cache_impl,
        qkv, positions, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
        eps, be,
    )


# --- decode attention --------------------------------------------------------------------------


def _decode_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    max_len: int,
    backend: str,
    out: torch.Tensor,
) -> None:
    if backend == "triton":
        _triton().decode_attention(q, k_cache, v_cache, lens, scale, out=out)
    else:
        out.copy_(reference.decode_attention(q, k_cache, v_cache, lens, scale, max_len if max_len >= 0 else None))


_decode_attention_op = torch.library.custom_op(
    "fastawq::decode_attention_into", _decode_attention_impl, mutates_args=("out",)
)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, lens, scale, max_len, backend, out):
    torch._check(out.shape == q.shape, lambda: f"out {tuple(out.shape)} vs q {tuple(q.shape)}")
    torch._check(q.shape[-1] == k_cache.shape[-1], lambda: f"q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def cuda_decode_declines(q: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor,
                         q_sums: bool = False) -> str | None:
    """None when the compiled decode-attention kernel takes these shapes and dtypes, else why not.
    q_sums: q is the QKV projection's fp32 sums, read in the caches' dtype (the rope form only)."""
    d, hq, hkv = q.shape[-1], q.shape[-2], k_cache.shape[-2]
    q_dtype = k_cache.dtype if q_sums and q.dtype == torch.float32 else q.dtype
    if q_dtype not in HALF or k_cache.dtype != q_dtype:
        return f"q {q.dtype} / cache {k_cache.dtype}: the kernel takes fp16 or bf16"
    if d not in (64, 128, 256):
        return f"head_dim {d} (the kernel takes 64, 128, 256)"
    if hq % hkv or hq // hkv > 8:
        return f"{hq} query heads over {hkv} KV heads (at most 8 per KV head)"
    if lens.dtype != torch.int32:
        return f"lens is {lens.dtype}, not int32"
    if not (_aligned(q) and _aligned(k_cache)):
        return "q or the caches are not 16-byte aligned rows"
    return None


def decode_attention_backend(
    q: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor, backend: str | None = None, q_sums: bool = False
) -> str:
    """"cuda", "triton" or "torch" for one decode_attention call (compiled > Triton > torch); q_sums
    as cuda_decode_declines."""
    return select_backend(
        "decode_attention", q.device, backend=backend,
        shapes_ok=lambda b: cuda_decode_declines(q, k_cache, lens, q_sums) if b == "cuda" else None,
    )


# q [B, HQ, D] · caches [B', S, HKV, D] · lens [B] int32  ->  [B, HQ, D]
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    max_len: int | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row over its first lens[b] cached positions, into `out` if given.

    The torch path needs `max_len` (a host int >= every lens[b]) to bound the keys it reads
    (None: lens.max(), a device sync); the CUDA and Triton kernels read lens on the device
    (CUDA-graph safe)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} must be [B, HQ, D] and k_cache {tuple(k_cache.shape)} / v_cache "
            f"{tuple(v_cache.shape)} [B', S, HKV, D]"
        )
    b, hq, d = q.shape
    if k_cache.shape[-1] != d or k_cache.shape[0] < b or hq % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not match k_cache {tuple(k_cache.shape)}")
    if tuple(lens.shape) != (b,):
        raise ValueError(f"lens {tuple(lens.shape)} must be ({b},)")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, lens=lens, out=out)
    be = decode_attention_backend(q, k_cache, lens, backend)
    if be == "cuda":
        if out is None:
            return torch.ops.fastawq.decode_attention(q, k_cache, v_cache, lens, scale)
        torch.ops.fastawq.decode_attention_out(q, k_cache, v_cache, lens, scale, out)
        return out
    if out is None:
        out = torch.empty_like(q)
    _call(
        torch.ops.fastawq.decode_attention_into, _decode_attention_impl,
        q, k_cache, v_cache, lens, scale, -1 if max_len is None else max_len, be, out,
    )
    return out


def rope_attention_fused(
    qkv: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor, num_heads: int, backend: str | None = None, *,
    positions: torch.Tensor | None = None, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
) -> bool:
    """Whether rope_decode_attention runs as the one compiled launch for these inputs: a one-token
    step the compiled decode attention serves, int32 positions, fp32 [S, D] tables and norm
    weights in qkv's dtype (anything else takes rope_kv_cache's launch, which converts). qkv may be
    the QKV projection's fp32 sums (FASTAWQ_QKV_SUMS) beside fp16 / bf16 caches: the kernel rounds
    them to the caches' dtype as it reads them, and the norm weights take that dtype."""
    if not (_backend.ROPE_ATTENTION_FUSED and _ext.has_op("rope_decode_attention")):
        return False
    sums = qkv.dtype == torch.float32
    dtype = k_cache.dtype if sums else qkv.dtype
    if qkv.dim() != 3 or qkv.shape[1] != 1 or k_cache.dim() != 4:
        return False
    d = k_cache.shape[3]
    if qkv.shape[-1] != (num_heads + 2 * k_cache.shape[2]) * d:
        return False
    if positions is not None and (positions.dtype != torch.int32 or positions.numel() != qkv.shape[0]
                                  or not positions.is_contiguous()):
        return False
    for table in (cos, sin):
        if table is not None and (table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != d
                                  or not table.is_contiguous() or table.data_ptr() % 16):
            return False
    for w in (q_norm_weight, k_norm_weight):
        if w is not None and (w.dtype != dtype or w.shape != (d,) or not w.is_contiguous() or w.data_ptr() % 16):
            return False
    q = qkv[:, 0, : num_heads * d].unflatten(-1, (num_heads, d))
    return decode_attention_backend(q, k_cache, lens, backend, q_sums=sums) == "cuda"


# qkv [B, 1, (HQ + 2 HKV) D] · positions [B, 1] int32 · cos/sin [S, D] fp32 · caches · lens [B]
#   -> [B, HQ, D]
def rope_decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    max_len: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """rope_kv_cache, then decode_attention of the rotated q [B, HQ, D]: one compiled launch
    where the CUDA decode attention serves a one-token step (backend.ROPE_ATTENTION_FUSED), else
    the two ops. qkv may be fp32 sums (the QKV projection's, FASTAWQ_QKV_SUMS) beside fp16 / bf16
    caches: rounded to the caches' dtype as read (the compiled launch) or first (the two ops)."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    fused = tuple(positions.shape) == tuple(qkv.shape[:2]) and rope_attention_fused(
        qkv, k_cache, lens, num_heads, backend, positions=positions, cos=cos, sin=sin,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    if fused:
        return torch.ops.fastawq.rope_decode_attention(
            qkv, positions, cos, sin, k_cache, v_cache, lens, q_norm_weight, k_norm_weight, eps, num_heads, scale)
    if qkv.dtype == torch.float32 and k_cache.dtype in HALF:  # fp32 sums: rounded as the launch would
        qkv = qkv.to(k_cache.dtype)
    q = rope_kv_cache(qkv, positions, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                      q_norm_weight, k_norm_weight, eps, backend=backend)
    return decode_attention(q.reshape(qkv.shape[0], num_heads, head_dim), k_cache, v_cache, lens, scale,
                            max_len=max_len, backend=backend)


# q [B, L, HQ, D] · caches [B', S, HKV, D]: queries at positions start .. start+L-1 of every row
def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Causal attention of L new tokens over the cache (SDPA; flash on GPU).

    Built of torch ops only (SDPA picks its own kernel), so it needs no schema of its own. A chunk
    after the first (start > 0) sees every cached key and its own keys causally: on CUDA that is
    torch's lower-right causal bias, which SDPA hands to the flash / memory-efficient kernels. With
    an explicit boolean mask (which flash does not take) a Llama-3-8B prefill of 2048 tokens on an
    H100 ran at 0.62x the one pass in chunks of 1024 and at 0.29x in chunks of 512, each chunk
    after the first costing ~40 ms whatever its length (benchmarks/RESULTS.md, session 32). The CPU
    keeps the mask (its fallback would warn on every call about the kernels it cannot use)."""
    b, seq, hq, d = q.shape
    end = start + seq
    k = k_cache[:b, :end].transpose(1, 2)
    v = v_cache[:b, :end].transpose(1, 2)
    qt = q.transpose(1, 2)
    if hq != k.shape[1]:
        # Expanded K/V (a few MB) rather than enable_gqa, which some SDPA backends do not take:
        # the math fallback would materialise L x L scores per head.
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    if start == 0:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale)
    elif q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=causal_lower_right(seq, end), scale=scale)
    else:
        qpos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _register_fakes() -> None:
    """Output shapes of the compiled attention ops, for torch.compile and opcheck."""
    if _ext.has_op("decode_attention"):

        @torch.library.register_fake("fastawq::decode_attention")
        def _(q, k_cache, v_cache, lens, scale):
            torch._check(q.dim() == 3, lambda: f"q {tuple(q.shape)} must be [B, HQ, D]")
            torch._check(q.shape[-1] == k_cache.shape[-1], lambda: f"q {tuple(q.shape)} vs k_cache")
            return q.new_empty(q.shape)

    if _ext.has_op("decode_attention_out"):

        @torch.library.register_fake("fastawq::decode_attention_out")
        def _(q, k_cache, v_cache, lens, scale, out):
            torch._check(out.shape == q.shape, lambda: f"out {tuple(out.shape)} vs q {tuple(q.shape)}")

    if _ext.has_op("rope_decode_attention"):

        @torch.library.register_fake("fastawq::rope_decode_attention")
        def _(qkv, positions, cos, sin, k_cache, v_cache, lens, q_norm_weight, k_norm_weight, eps, num_heads, scale):
            torch._check(qkv.dim() == 3, lambda: f"qkv {tuple(qkv.shape)} must be [B, 1, W]")
            dtype = k_cache.dtype if qkv.dtype == torch.float32 else qkv.dtype  # fp32 sums: the caches'
            return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[-1]), dtype=dtype)


_register_fakes()
