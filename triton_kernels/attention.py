"""Triton kernels for fused decoding: rotary embedding + KV-cache write, and split-K decode attention.

Both read their positions and lengths from device tensors, never from Python ints, so one CUDA
graph captured for a decode step replays correctly at every position.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter
from .workspace import WORKSPACE


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


@triton.jit
def _rope_kv_cache_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_w_ptr, kn_w_ptr,
    seq_len, stride_qkv, stride_cache_b, stride_cache_s, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr,
    QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    # One program per (token, head); heads [0, HQ) are queries, [HQ, HQ + HKV) keys (+ values).
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = t // seq_len
    pos = tl.load(pos_ptr + t)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    is_q = h < HQ
    col = h * D
    row = qkv_ptr + t * stride_qkv + col
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + offs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        # Qwen3 normalises each head (RMSNorm over D) before the rotation.
        var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
        r = tl.rsqrt(var + eps)
        if is_q:
            w1 = tl.load(qn_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(qn_w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kn_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(kn_w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        # HF rounds the normalised head to the activation dtype before the weight multiply.
        x1 = (x1 * r).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w1
        x2 = (x2 * r).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w2
        x1 = x1.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(qkv_ptr.dtype.element_ty).to(tl.float32)
    c1 = tl.load(cos_ptr + pos * D + offs, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + pos * D + offs, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + pos * D + half + offs, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + pos * D + half + offs, mask=mask, other=0.0)
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    if is_q:
        dst = q_out_ptr + (t * HQ + h) * D
        tl.store(dst + offs, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + offs, o2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kh = h - HQ
        cache_off = b * stride_cache_b + pos * stride_cache_s + kh * D
        tl.store(k_cache_ptr + cache_off + offs, o1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_cache_ptr + cache_off + half + offs, o2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        vrow = qkv_ptr + t * stride_qkv + (HQ + HKV + kh) * D
        v1 = tl.load(vrow + offs, mask=mask, other=0.0)
        v2 = tl.load(vrow + half + offs, mask=mask, other=0.0)
        tl.store(v_cache_ptr + cache_off + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_off + half + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


# qkv [B, L, (HQ + 2 HKV) * D] · positions [B, L] int32 · cos/sin [S, D] fp32 · caches [B', S, HKV, D]
#   -> q [B, L, HQ, D] (rotated); k (rotated) and v written into the caches at `positions`
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
) -> torch.Tensor:
    """Rotate q and k (HF "rotate_half" convention), write k and v into the caches, return q."""
    b, seq, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads of {head_dim}"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embedding")
    if tuple(positions.shape) != (b, seq) or positions.dtype != torch.int32:
        raise ValueError(f"positions {tuple(positions.shape)} {positions.dtype} must be ({b}, {seq}) int32")
    if k_cache.stride(-1) != 1 or k_cache.stride(-2) != head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must be [B, S, HKV, D] with contiguous heads")
    qkv2 = qkv.reshape(b * seq, width)
    if qkv2.stride(-1) != 1:
        qkv2 = qkv2.contiguous()
    q = torch.empty(b, seq, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    qk_norm = q_norm_weight is not None
    grid = (b * seq, num_heads + num_kv_heads)
    _rope_kv_cache_kernel[grid](
        qkv2, positions.reshape(-1), cos, sin, q, k_cache, v_cache,
        q_norm_weight if qk_norm else cos, k_norm_weight if qk_norm else cos,
        seq, qkv2.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, HALF_BLOCK=_pow2(head_dim // 2),
        QK_NORM=qk_norm, num_warps=1, **launch_options(qkv.device),
    )
    return q


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, acc_ptr, ml_ptr, cnt_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_ob, stride_oh, scale,
    HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    # Flash-decoding: each program owns one KV head (all its query heads, as the rows of one
    # dot) over one slice of the sequence, so a batch-1 decode still fills the GPU. The last
    # split to finish combines the partials: one kernel per layer, no separate reduce launch.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    kh = pid % HKV
    n_valid = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(n_valid, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n_valid)

    g = tl.arange(0, GROUP_BLOCK)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gmask = g < GROUP
    dmask = d < D
    gd_mask = gmask[:, None] & dmask[None, :]
    heads = kh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    m_i = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, BLOCK_D], tl.float32)
    base = b * stride_kb + kh * stride_kh
    for s0 in range(start, end, BLOCK_N):
        idx = s0 + n
        nmask = idx < end
        kv_off = base + idx[:, None] * stride_ks + d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(nmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        # Partials: acc [B, HQ, SPLITS, D] fp32 · ml [B, HQ, SPLITS, 2] fp32 (running max, sum)
        rows = (b * HKV * GROUP + heads) * SPLITS
        tl.store(acc_ptr + (rows + split)[:, None] * D + d[None, :], acc, mask=gd_mask)
        tl.store(ml_ptr + (rows + split) * 2, m_i, mask=gmask)
        tl.store(ml_ptr + (rows + split) * 2 + 1, l_i, mask=gmask)
        # acq_rel: the partials above are published before the count; the last arrival sees all
        # (and reads them past L1, ".cg", where another SM's writes would not be).
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            m_max = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
            for s in range(SPLITS):
                m_s = tl.load(ml_ptr + (rows + s) * 2, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                m_max = tl.maximum(m_max, m_s)
            m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # padded rows: no -inf - -inf
            num = tl.zeros([GROUP_BLOCK, BLOCK_D], tl.float32)
            den = tl.zeros([GROUP_BLOCK], tl.float32)
            for s in range(SPLITS):
                m_s = tl.load(ml_ptr + (rows + s) * 2, mask=gmask, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(ml_ptr + (rows + s) * 2 + 1, mask=gmask, other=0.0, cache_modifier=".cg")
                # Empty splits carry m = -inf and weigh exactly zero.
                w = tl.where(m_s > float("-inf"), tl.exp(m_s - m_max), 0.0)
                a_s = tl.load(acc_ptr + (rows + s)[:, None] * D + d[None, :], mask=gd_mask, other=0.0,
                              cache_modifier=".cg")
                num += a_s * w[:, None]
                den += l_s * w
            den = tl.where(den > 0.0, den, 1.0)
            tl.store(out_ptrs, (num / den[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)
            # Re-arm the counter for the next launch (and graph replay): no memset needed.
            tl.atomic_xchg(cnt_ptr + pid, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _num_splits(device: torch.device, programs: int, max_len: int, block_n: int) -> int:
    # One wave of programs: more splits only add partials for the last split to read (64 splits
    # made a separate reduce kernel cost as much as the attention itself on an H200, 2026-11-30).
    want = max(1, _sm_count(device) // max(1, programs))
    cap = max(1, triton.cdiv(max_len, block_n))
    return min(1 << (min(want, cap).bit_length() - 1), 32)


# q [B, HQ, D] · k_cache, v_cache [B', S, HKV, D] (B' >= B) · lens [B] int32  ->  out [B, HQ, D]
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over the first lens[b] (>= 1) cached keys of row b.

    Calls on one device share arrival counters: run them on one stream at a time."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} must be [B, HQ, D] and k_cache {tuple(k_cache.shape)} [B, S, HKV, D]")
    b, hq, d = q.shape
    bc, s_max, hkv, dk = k_cache.shape
    if dk != d or bc < b or hq % hkv != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} does not match k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}"
        )
    if tuple(lens.shape) != (b,) or lens.dtype != torch.int32:
        raise ValueError(f"lens {tuple(lens.shape)} {lens.dtype} must be ({b},) int32")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches need a contiguous last dimension and equal cache strides")
    group = hq // hkv
    block_n = 64 if q.device.type == "cuda" else 16
    splits = num_splits or _num_splits(q.device, b * hkv, s_max, block_n)
    acc = torch.empty(b, hq, splits, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(b, hq, splits, 2, device=q.device, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    # Per-(row, KV head) arrival counters: the last split to arrive reduces, then re-arms it.
    counters = WORKSPACE.get(q.device, "attention_counters", b * hkv, torch.int32, zeroed=True, minimum=1024)
    _decode_attn_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, lens, acc, ml, counters, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), scale if scale is not None else d ** -0.5,
        HKV=hkv, GROUP=group, GROUP_BLOCK=_pow2(group, 16), D=d, BLOCK_D=_pow2(d, 16),
        BLOCK_N=block_n, SPLITS=splits, num_warps=4,
    )
    return out
