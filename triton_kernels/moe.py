"""Triton W4A16 mixture-of-experts: a grouped GEMM over all experts in one launch per projection.

Rows are (token, slot) assignments, flat index f = t * k + j. Each program owns BLOCK_M rows that
share one expert and a tile of output columns, so an expert's weight tile is read once per block
instead of once per token. Two ways to form blocks:
- sorted (prefill, batched decode): assignments sorted by expert into per-expert blocks padded to
  BLOCK_M (moe_align: one Triton program, or torch ops for large batches; sizes fixed by T, k and
  E, no host sync, so it captures in a CUDA graph);
- one assignment per block (decode with few assignments per expert): no sort at all, and each
  block reads one expert's weights, exactly what the assignment needs.
w13 computes gate and up tiles side by side and writes act(gate) * up; w2 scales each row by its
routing weight and writes it at its flat index, then the k rows of a token are summed. Where few
programs would each stream a long K, either splits K: w13 adds its gate and up partial sums into a
zeroed fp32 [T * k, 2I] atomically (w2 then applies act(gate) * up as it loads them), w2 adds into
an fp32 [T, H] atomically.
Decode (each expert one or two assignments) has a third form without tl.dot: moe_gemv_kernel, one
program per (assignment, run of words of a row, K split) on CUDA cores, reading 128 contiguous
bytes of each weight row, fp32 atomics into zeroed outputs; the tuner also times the tl.dot form.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .awq import _dequant, _packed_tile_ld, _unpack_cols
from .launch import _interpreting
from .pdl import launch_options, pdl_enter
from .workspace import WORKSPACE

logger = logging.getLogger(__name__)

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, n_assign, BLOCK_M: tl.constexpr, NAIVE: tl.constexpr):
    """The expert of block pid_b and its rows' flat assignment indices (valid: a real row)."""
    offs = tl.arange(0, BLOCK_M)
    if NAIVE:
        expert = tl.load(ids_ptr + pid_b).to(tl.int64)
        flat = pid_b + offs
        valid = offs == 0
    else:
        expert = tl.load(bexp_ptr + pid_b).to(tl.int64)
        flat = tl.load(sorted_ptr + pid_b * BLOCK_M + offs)
        valid = flat < n_assign
    return expert, flat.to(tl.int64), valid


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        y = g * tl.sigmoid(g)
    elif ACT == 1:
        y = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        # tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = g * tl.sigmoid(2.0 * u)
    return y


@triton.jit
def _weight_tile(qw, qz, sc, k0, offs_k, offs_w, offs_n, mask_w, mask_n, n8, ncols, G, a,
                 BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows k0.. of one expert's packed matrix (n8 words and ncols scales a row), dequantized to the
    [BLOCK_K, BLOCK_N] tile tl.dot takes with `a`. BLOCK_K divides G: one group per tile."""
    words = tl.load(qw + (k0 + offs_k)[:, None] * n8 + offs_w[None, :], mask=mask_w[None, :], other=0)
    g = k0 // G
    zw = tl.load(qz + g * n8 + offs_w, mask=mask_w, other=0)
    s = tl.load(sc + g * ncols + offs_n, mask=mask_n, other=0.0)
    return _dequant(_unpack_cols(words, BLOCK_N), _unpack_cols(zw[None, :], BLOCK_N), s[None, :], a, INTERPRET)


@triton.jit
def _packed_weight_tile(wp, sz, k0, K, LD, ncols, pid_n, SZ_LD, G, offs_n, mask_n, a,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """_weight_tile on the packed layout (PACKED): rows k0.. of the ncols columns at wp of one
    expert's wpacked (rows of 8 K rows LD words apart), their (scale, zero) pairs at sz (group rows
    SZ_LD elements apart), dequantized to the [BLOCK_K, BLOCK_N] tile of column tile pid_n."""
    q = _packed_tile_ld(wp, k0, K, ncols, LD, pid_n, BLOCK_N, BLOCK_K)
    pair = tl.load(sz + (k0 // G) * SZ_LD + 2 * offs_n[:, None] + tl.arange(0, 2)[None, :], mask=mask_n[:, None],
                   other=0.0)
    s, z = tl.split(pair)
    return _dequant(q, z[None, :], s[None, :], a, INTERPRET)


@triton.jit
def moe_w13_kernel(
    x_ptr, ids_ptr, sorted_ptr, bexp_ptr, qw_ptr, s_ptr, qz_ptr, h_ptr,
    n_assign, E, H, I, G, TOPK, stride_xm, split_k,
    ACT: tl.constexpr,
    NAIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr = False,
    INTERPRET: tl.constexpr = False,
    PACKED: tl.constexpr = False,
):
    # x [T, H] · w13 qweight [E, H, 2I // 8] · scales [E, H // G, 2I] · qzeros [E, H // G, 2I // 8]
    # -> h [T * k, I] = act(x w_gate) * (x w_up) for each row's expert, or with ATOMIC, the K split
    # over program_id(2) and both sums added into a zeroed fp32 h [T * k, 2I] (gate | up).
    # PACKED: the experts in the packed layout, wpacked [E, H // 8, 2I] (qw_ptr) and szpacked
    # [E, H // G, 4I] (s_ptr); qz_ptr unused.
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, flat, valid = _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, n_assign, BLOCK_M, NAIVE)
    if expert >= E:  # a padding block past the last expert's
        return
    tok = flat // TOPK
    n8 = I // 4  # words per row of w13 (2I columns)
    i8 = I // 8  # the up columns start this many words in
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < I
    mask_w = offs_w < i8
    if PACKED:
        qw = qw_ptr + expert * (H // 8) * (2 * I)
        sc = s_ptr + expert * (H // G) * (4 * I)
    else:
        qw = qw_ptr + expert * H * n8
        sc = s_ptr + expert * (H // G) * (2 * I)
    qz = qz_ptr + expert * (H // G) * n8
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, H, split_k * BLOCK_K):
        a = tl.load(x_ptr + tok[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
        if PACKED:
            # The up columns start I words (2I elements of the pairs) after the gate columns of a row.
            bg = _packed_weight_tile(qw, sc, k0, H, 2 * I, I, pid_n, 4 * I, G, offs_n, mask_n, a, BLOCK_N, BLOCK_K,
                                     INTERPRET)
            bu = _packed_weight_tile(qw + I, sc + 2 * I, k0, H, 2 * I, I, pid_n, 4 * I, G, offs_n, mask_n, a, BLOCK_N,
                                     BLOCK_K, INTERPRET)
        else:
            # The up columns start I // 8 words (I scales) after the gate columns of the same row.
            bg = _weight_tile(qw, qz, sc, k0, offs_k, offs_w, offs_n, mask_w, mask_n, n8, 2 * I, G, a, BLOCK_N,
                              INTERPRET)
            bu = _weight_tile(qw + i8, qz + i8, sc + I, k0, offs_k, offs_w, offs_n, mask_w, mask_n, n8, 2 * I, G, a,
                              BLOCK_N, INTERPRET)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    mask = valid[:, None] & mask_n[None, :]
    if ATOMIC:
        # Few programs would otherwise stream a long K each (Mixtral decode: H = 4096 for two rows).
        gu = h_ptr + flat[:, None] * (2 * I) + offs_n[None, :]
        tl.atomic_add(gu, acc_g, mask=mask, sem="relaxed")
        tl.atomic_add(gu + I, acc_u, mask=mask, sem="relaxed")
    else:
        hval = _act(acc_g, ACT) * acc_u
        tl.store(h_ptr + flat[:, None] * I + offs_n[None, :], hval.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_w2_kernel(
    h_ptr, ids_ptr, sorted_ptr, bexp_ptr, tw_ptr, qw_ptr, s_ptr, qz_ptr, out_ptr,
    n_assign, E, H, I, G, TOPK, split_k,
    NAIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    GATE_UP: tl.constexpr = False,
    ACT: tl.constexpr = 0,
    BF16: tl.constexpr = False,
    INTERPRET: tl.constexpr = False,
    PACKED: tl.constexpr = False,
):
    # PACKED: w2 wpacked [E, I // 8, H] (qw_ptr) and szpacked [E, I // G, 2H] (s_ptr); qz_ptr unused.
    # h [T * k, I] · w2 qweight [E, I, H // 8] · scales [E, I // G, H] · qzeros [E, I // G, H // 8]
    # -> out [T * k, H] = topk_weight * (h w2) for each row's expert, or with ATOMIC, added into
    # a zeroed fp32 out [T, H] (the sum over k done here, and K split over program_id(2)).
    # GATE_UP: h is w13's fp32 [T * k, 2I] (gate | up) sums; act(gate) * up is formed here, rounded
    # to the activations' dtype (bf16 with BF16) as w13 would have stored it.
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, flat, valid = _block_rows(pid_b, ids_ptr, sorted_ptr, bexp_ptr, n_assign, BLOCK_M, NAIVE)
    if expert >= E:
        return
    n8 = H // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < H
    mask_w = offs_w < n8
    qw = qw_ptr + expert * I * n8  # (also the packed offset: I // 8 rows of H words)
    qz = qz_ptr + expert * (I // G) * n8
    sc = s_ptr + expert * (I // G) * H * (2 if PACKED else 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, I, split_k * BLOCK_K):
        if GATE_UP:
            gu = h_ptr + flat[:, None] * (2 * I) + (k0 + offs_k)[None, :]
            gate = tl.load(gu, mask=valid[:, None], other=0.0)
            up = tl.load(gu + I, mask=valid[:, None], other=0.0)
            a = _act(gate, ACT) * up
            a = a.to(tl.bfloat16) if BF16 else a.to(tl.float16)
        else:
            a = tl.load(h_ptr + flat[:, None] * I + (k0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
        if PACKED:
            b = _packed_weight_tile(qw, sc, k0, I, H, H, pid_n, 2 * H, G, offs_n, mask_n, a, BLOCK_N, BLOCK_K,
                                    INTERPRET)
        else:
            b = _weight_tile(qw, qz, sc, k0, offs_k, offs_w, offs_n, mask_w, mask_n, n8, H, G, a, BLOCK_N, INTERPRET)
        acc = tl.dot(a, b, acc)
    w = tl.load(tw_ptr + flat, mask=valid, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    if ATOMIC:
        # Few programs would otherwise stream a long K each (Mixtral decode: I = 14336).
        tl.atomic_add(out_ptr + (flat // TOPK)[:, None] * H + offs_n[None, :], acc,
                      mask=valid[:, None] & mask_n[None, :], sem="relaxed")
    else:
        tl.store(out_ptr + flat[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _gemv_step(acc, xk, qw, qz, sc, k0, offs_k, offs_w, mask_w, col, n8, N, G):
    """acc [BW, 8] += the K tile k0.. of one expert's packed matrix times xk [BK] (fp32), on the
    nibbles where they lie (word w, nibble i = column col[w, i]). BLOCK_K divides G, so the group's
    scale and zero apply after the K sum: sum_k (q - z) s x_k = s (sum_k q x_k - z sum_k x_k)."""
    nib = tl.arange(0, 8)
    words = tl.load(qw + (k0 + offs_k)[:, None] * n8 + offs_w[None, :], mask=mask_w[None, :], other=0)
    nibbles = (words[:, :, None] >> (nib * 4)[None, None, :]) & 0xF
    # int -> fp32 through the exponent field (2^23 + q, exact), cheaper than a conversion.
    qf = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    g = k0 // G
    zw = tl.load(qz + g * n8 + offs_w, mask=mask_w, other=0)
    z = ((zw[:, None] >> (nib * 4)[None, :]) & 0xF).to(tl.float32)
    s = tl.load(sc + g * N + col, mask=mask_w[:, None], other=0.0).to(tl.float32)
    return acc + s * (tl.sum(qf * xk[:, None, None], axis=0) - z * tl.sum(xk, axis=0))


@triton.jit
def moe_gemv_kernel(
    a_ptr, ids_ptr, tw_ptr, qw_ptr, s_ptr, qz_ptr, out_ptr,
    E, K, N, G, TOPK, stride_am, split_k,
    W13: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Decode (a few assignments): one program per (assignment, BLOCK_W words of a row, K split),
    # CUDA cores, fp32 partial sums added atomically into zeroed fp32 outputs. No sort, no tl.dot,
    # and each program reads contiguous runs of BLOCK_W words of every row of its expert.
    # W13: x [T, H] · w13 [E, H, 2I // 8] -> gu [T * k, 2I] fp32 (gate | up), K = H, N = 2I.
    # else: gu -> act(gate) * up [T * k, I] · w2 [E, I, H // 8], times the routing weight, summed
    #       into out [T, H] fp32, K = I, N = H.
    f = tl.program_id(0)
    pid_w = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + f).to(tl.int64)
    if expert >= E:
        return
    n8 = N // 8
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    nib = tl.arange(0, 8)
    col = offs_w[:, None] * 8 + ((nib % 4) * 2 + nib // 4)[None, :]  # [BW, 8] output columns
    offs_k = tl.arange(0, BLOCK_K)
    mask_w = offs_w < n8
    qw = qw_ptr + expert * K * n8
    qz = qz_ptr + expert * (K // G) * n8
    sc = s_ptr + expert * (K // G) * N
    acc = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, split_k):
        k0 = t * BLOCK_K
        if W13:
            xk = tl.load(a_ptr + (f // TOPK) * stride_am + k0 + offs_k).to(tl.float32)
        else:
            gate = tl.load(a_ptr + f * 2 * K + k0 + offs_k)
            xk = _act(gate, ACT) * tl.load(a_ptr + f * 2 * K + K + k0 + offs_k)
        acc = _gemv_step(acc, xk, qw, qz, sc, k0, offs_k, offs_w, mask_w, col, n8, N, G)
    if W13:
        tl.atomic_add(out_ptr + f * N + col, acc, mask=mask_w[:, None], sem="relaxed")
    else:
        w = tl.load(tw_ptr + f).to(tl.float32)
        tl.atomic_add(out_ptr + (f // TOPK) * N + col, acc * w, mask=mask_w[:, None], sem="relaxed")


@triton.jit
def moe_align_kernel(
    ids_ptr, sorted_ptr, bexp_ptr,
    n, E, max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program: the torch version of moe_align in one launch instead of about thirty small
    # kernels, which at decode sizes cost more than the sort itself. Chunks of CHUNK assignments
    # against all experts at once ([CHUNK, E_PAD] one-hot): counts, then stable ranks.
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        hit = ((ids[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    row_start = (block_end - blocks) * BLOCK_M
    total = max_blocks * BLOCK_M
    for p0 in range(0, total, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=offs < total)
    end_real = tl.where(experts < E, block_end, 2**30)
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        ex = tl.sum((end_real[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(bexp_ptr + b, ex, mask=b < max_blocks)
    tl.debug_barrier()  # the padding fill above lands before the rows below overwrite it
    running = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        hit = ((ids[:, None] == experts[None, :]) & (experts < E)[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit
        dest = tl.sum((before + running[None, :] + row_start[None, :]) * hit, axis=1)
        # An id outside [0, E) hits no expert: its row is dropped rather than written anywhere.
        tl.store(sorted_ptr + dest, offs, mask=(offs < n) & (tl.sum(hit, axis=1) > 0))
        running += tl.sum(hit, axis=0)


@triton.jit
def _choose_topk(x, offs, mask, bias_ptr, w_ptr, ids_ptr, row, scale,
                 K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SOFTMAX: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    # x [E_PAD] fp32 logits of one token (-inf past E) -> topk_weights[row] fp32 · topk_ids[row].
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
    else:
        p = tl.sigmoid(x)
    choice = p
    if HAS_BIAS:  # the bias only chooses; the weights stay the unbiased scores
        choice += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    choice = tl.where(mask, choice, float("-inf"))
    ks = tl.arange(0, K_PAD)
    wv = tl.zeros((K_PAD,), dtype=tl.float32)
    iv = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, offs, E_PAD), axis=0)  # the lowest index among ties
        wv = tl.where(ks == j, tl.sum(tl.where(offs == idx, p, 0.0), axis=0), wv)
        iv = tl.where(ks == j, idx, iv)
        choice = tl.where(offs == idx, float("-inf"), choice)
    if RENORM:
        wv = wv / tl.maximum(tl.sum(wv, axis=0), 1e-20)
    tl.store(w_ptr + row * K + ks, wv * scale, mask=ks < K)
    tl.store(ids_ptr + row * K + ks, iv, mask=ks < K)


@triton.jit
def topk_route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    E, stride_l, scale,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr,
):
    # router_logits [T, E] -> topk_weights [T, K] fp32 · topk_ids [T, K]; one program per token.
    # Routing in torch is four or five kernels (softmax, topk, sum, divide) per layer per step.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    _choose_topk(x, offs, mask, bias_ptr, w_ptr, ids_ptr, row, scale, K, K_PAD, E_PAD, SOFTMAX, HAS_BIAS, RENORM)


@triton.jit
def route_kernel(
    x_ptr, rw_ptr, logit_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, res_ptr, nw_ptr, h_ptr, res_out_ptr,
    H, E, stride_x, scale, eps, offset,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, EB: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    # x [T, H] · router weight [E, H] -> topk_weights [T, K] fp32 · topk_ids [T, K]: the router
    # GEMM and the routing in one launch. Program (token, part) takes experts part*EB .. +EB; with
    # SPLITS > 1 parts publish their logits (fp32 [T, E_PAD] scratch) and the last to arrive for
    # the token chooses, then re-arms its counter (no memset in a captured step).
    # NORM: x is a block's output and the routed input is h = RMSNorm(x + residual) * (w + offset),
    # the sum and h each rounded to x's dtype as add_rms_norm rounds them; part 0 of each token
    # writes h [T, H] and the new residual x + residual [T, H] (contiguous rows).
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs_e = part * EB + tl.arange(0, EB)
    me = offs_e < E
    if NORM:  # a first pass over the row for its mean square
        ss = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mh = offs_h < H
            r = tl.load(x_ptr + row * stride_x + offs_h, mask=mh, other=0.0) + \
                tl.load(res_ptr + row * H + offs_h, mask=mh, other=0.0)
            rf = r.to(tl.float32)
            ss += rf * rf
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
    acc = tl.zeros((EB, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mh = offs_h < H
        xv = tl.load(x_ptr + row * stride_x + offs_h, mask=mh, other=0.0)
        if NORM:
            r = xv + tl.load(res_ptr + row * H + offs_h, mask=mh, other=0.0)
            nw = tl.load(nw_ptr + offs_h, mask=mh, other=0.0).to(tl.float32) + offset
            xv = (r.to(tl.float32) * rstd * nw).to(x_ptr.dtype.element_ty)
            if part == 0:
                tl.store(h_ptr + row * H + offs_h, xv, mask=mh)
                tl.store(res_out_ptr + row * H + offs_h, r, mask=mh)
        # x in the router's dtype first, as the unfused F.linear(x.to(W.dtype), W) rounds it.
        xv = xv.to(rw_ptr.dtype.element_ty)
        wt = tl.load(rw_ptr + offs_e[:, None].to(tl.int64) * H + offs_h[None, :], mask=me[:, None] & mh[None, :],
                     other=0.0)
        acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
    # Logits rounded to the router's dtype, as the unfused path hands them to the routing.
    logit = tl.sum(acc, axis=1).to(rw_ptr.dtype.element_ty).to(tl.float32)
    if SPLITS == 1:
        _choose_topk(tl.where(me, logit, float("-inf")), offs_e, me, bias_ptr, w_ptr, ids_ptr, row, scale,
                     K, K_PAD, E_PAD, SOFTMAX, HAS_BIAS, RENORM)
    else:
        tl.store(logit_ptr + row * E_PAD + offs_e, logit, mask=me)
        # acq_rel: the logits above are published before the count; the last arrival sees them all
        # (read past L1, ".cg", where another SM's writes would not be).
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            offs = tl.arange(0, E_PAD)
            mask = offs < E
            x = tl.load(logit_ptr + row * E_PAD + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            _choose_topk(x, offs, mask, bias_ptr, w_ptr, ids_ptr, row, scale, K, K_PAD, E_PAD, SOFTMAX, HAS_BIAS,
                         RENORM)
            tl.atomic_xchg(cnt_ptr + row, 0)


# --- launch ---


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # > 1: K split over programs, fp32 partials added atomically (module doc)

    def label(self) -> str:
        split = f"s{self.split_k}" if self.split_k > 1 else ""
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}p{self.num_stages}{split}"


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per block; sorted mode only (one assignment per block otherwise)
    naive: bool  # one assignment per block, no sort
    w13: KernelConfig
    w2: KernelConfig
    gemv: bool = False  # naive mode on CUDA cores (moe_gemv_kernel); block_n = 8 x words per program

    def label(self) -> str:
        mode = "gemv" if self.gemv else "naive" if self.naive else f"m{self.block_m}"
        return f"{mode} w13 {self.w13.label()} w2 {self.w2.label()}"


def _block_k(g: int, k: int, most: int = 128) -> int:
    for bk in (128, 64, 32, 16):
        if bk <= most and g % bk == 0 and k % bk == 0:
            return bk
    return 0


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flat assignments by expert into blocks of block_m rows, each block one expert.

    Returns sorted_ids [max_blocks * block_m] int32 (flat index per row, n = T * k marks padding)
    and block_expert [max_blocks] int32 (num_experts marks an unused block). Sizes depend only on
    n, E and block_m, never on the routing, so the whole thing captures in a CUDA graph.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    max_blocks = max_blocks_for(n, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (block_end - blocks)[sorted_e] * block_m + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=dev), right=True)
    return sorted_ids, block_expert.to(torch.int32)


# Above this many assignments the one-program kernel's serial chunks cost more than the torch ops.
ALIGN_KERNEL_MAX = 4096


def max_blocks_for(n: int, num_experts: int, block_m: int) -> int:
    # sum_e ceil(c_e / bm) <= #non-empty experts + floor(n / bm)
    return min(num_experts, n) + n // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_torch's result (same sizes, same stable order), in one launch for small batches."""
    n = topk_ids.numel()
    if n > ALIGN_KERNEL_MAX:
        return moe_align_torch(topk_ids, num_experts, block_m)
    max_blocks = max_blocks_for(n, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=topk_ids.device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, n, num_experts, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, 8192 // e_pad), num_warps=8,
    )
    return sorted_ids, block_expert


def use_naive(t: int, topk: int, num_experts: int) -> bool:
    # One token's k experts are distinct, so one assignment per block reads each expert once; with
    # more assignments than about E / 4, experts repeat and sorting saves the re-reads.
    return t == 1 or t * topk <= num_experts // 4


def heuristic_config(t: int, topk: int, e: int, h: int, i: int, g13: int, g2: int, sms: int) -> MoeConfig:
    n = t * topk
    naive = use_naive(t, topk, e)
    per_expert = n / min(e, n)
    bm = 16 if naive or per_expert <= 8 else 32 if per_expert <= 32 else 64
    blocks = n if naive else max_blocks_for(n, e, bm)
    interp = _interpreting()

    def kernel(cols: int, g: int, k: int, w2: bool) -> KernelConfig:
        # Memory-bound at small M: enough programs to cover the SMs twice beats wide tiles, down to
        # 64 columns (32 bytes of packed weights per row, one DRAM sector); the tuner may go below.
        if interp:  # fewest programs: the interpreter's cost is per program and per op
            return KernelConfig(min(128, triton.next_power_of_2(cols)), _block_k(g, k), 4, 1)
        bn = 128 if blocks * triton.cdiv(cols, 128) >= 2 * sms else 64
        # Register budget (ptxas for sm_90, 3 stages): w13 dequantizes two [BK, BN] tiles per step;
        # past 16 x 64 (w13) or 16 x 128 (w2) a 128-deep K step spills, and 32+ rows by 128
        # columns spill on 4 warps.
        bk = _block_k(g, k, 128 if bm == 16 and (bn == 64 or w2) else 64)
        warps = 8 if bm >= 32 and bn == 128 else 4
        programs, split = blocks * triton.cdiv(cols, bn), 1
        # Split K until the programs cover the SMs twice, each split keeping 4+ K tiles.
        while programs * split < 2 * sms and k // (bk * split * 2) >= 4:
            split *= 2
        return KernelConfig(bn, bk, warps, 3, split)

    return MoeConfig(bm, naive, kernel(i, g13, h, False), kernel(h, g2, i, True))


def gemv_config(t: int, topk: int, h: int, i: int, g13: int, g2: int, sms: int) -> MoeConfig:
    """The decode config on CUDA cores: 256-column programs (32 words, 128 contiguous bytes of
    every row), K split until about four programs per SM."""
    n = t * topk

    def kernel(cols: int, g: int, k: int) -> KernelConfig:
        bk = _block_k(g, k, 32)
        programs = n * triton.cdiv(cols, 256)
        split = max(1, min(k // bk // 2, triton.cdiv(4 * sms, programs)))
        return KernelConfig(256, bk, 4, 1, split)

    return MoeConfig(16, True, kernel(2 * i, g13, h), kernel(h, g2, i), gemv=True)


def default_config(t: int, topk: int, e: int, h: int, i: int, g13: int, g2: int, sms: int) -> MoeConfig:
    """Untuned: CUDA cores where each expert gets one or two assignments (decode), else tl.dot."""
    if use_naive(t, topk, e):
        return gemv_config(t, topk, h, i, g13, g2, sms)
    return heuristic_config(t, topk, e, h, i, g13, g2, sms)


def _gemv_variants(base: MoeConfig) -> list[MoeConfig]:
    out = [base]
    for field in ("w13", "w2"):
        kc = getattr(base, field)
        for change in ({"block_n": 128}, {"block_n": 512}, {"num_warps": 8}, {"split_k": max(1, kc.split_k // 2)},
                       {"split_k": kc.split_k * 2}, {"block_k": 16}):
            out.append(replace(base, **{field: replace(kc, **change)}))
    return list(dict.fromkeys(out))


def _variants(base: KernelConfig, bm: int) -> list[KernelConfig]:
    """Tile widths and warp counts around base (its stages and split kept; its K step too, but
    for 256-column tiles, which take 32 K rows at most to stay in registers)."""
    out = [base]
    for bn in (64, 128, 256):
        for warps in (4, 8):
            bk = base.block_k if bn <= 128 else min(base.block_k, 32)
            out.append(replace(base, block_n=bn, block_k=bk, num_warps=warps))
    return list(dict.fromkeys(out))


def _launch(cfg: MoeConfig, x, topk_ids, topk_weights, w13, w2, g13, g2, act, packed=False):
    """packed: w13 and w2 are (wpacked, szpacked, szpacked) in the packed layout (tl.dot forms only)."""
    t, h = x.shape
    topk = topk_ids.shape[1]
    e = w13[0].shape[0]
    i = w2[0].shape[1] * (8 if packed else 1)
    n = t * topk
    ids = topk_ids.reshape(-1)
    if cfg.gemv:
        return _launch_gemv(cfg, x, ids, topk_weights.reshape(-1), w13, w2, g13, g2, act, topk)
    if cfg.naive:
        sorted_ids, bexp, blocks, bm = ids, ids, n, 16
    else:
        bm = cfg.block_m
        sorted_ids, bexp = moe_align(topk_ids, e, bm)
        blocks = bexp.numel()
    split13, split = cfg.w13.split_k, cfg.w2.split_k
    # The fp32 buffers the atomic adds land in, zeroed by one memset.
    size = n * 2 * i * (split13 > 1) + t * h * (split > 1)
    acc = torch.zeros(size, dtype=torch.float32, device=x.device) if size else None
    hbuf = acc[:n * 2 * i].view(n, 2 * i) if split13 > 1 else torch.empty((n, i), dtype=x.dtype, device=x.device)
    out = acc[acc.numel() - t * h:].view(t, h) if split > 1 else torch.empty((n, h), dtype=x.dtype, device=x.device)
    interp = _interpreting()
    moe_w13_kernel[(blocks, triton.cdiv(i, cfg.w13.block_n), split13)](
        x, ids, sorted_ids, bexp, *w13, hbuf,
        n, e, h, i, g13, topk, x.stride(0), split13,
        ACT=ACTS[act], NAIVE=cfg.naive, BLOCK_M=bm, BLOCK_N=cfg.w13.block_n, BLOCK_K=cfg.w13.block_k,
        ATOMIC=split13 > 1, INTERPRET=interp, PACKED=packed, num_warps=cfg.w13.num_warps,
        num_stages=cfg.w13.num_stages,
    )
    moe_w2_kernel[(blocks, triton.cdiv(h, cfg.w2.block_n), split)](
        hbuf, ids, sorted_ids, bexp, topk_weights.reshape(-1), *w2, out,
        n, e, h, i, g2, topk, split,
        NAIVE=cfg.naive, BLOCK_M=bm, BLOCK_N=cfg.w2.block_n, BLOCK_K=cfg.w2.block_k, ATOMIC=split > 1,
        GATE_UP=split13 > 1, ACT=ACTS[act], BF16=x.dtype == torch.bfloat16,
        INTERPRET=interp, PACKED=packed, num_warps=cfg.w2.num_warps, num_stages=cfg.w2.num_stages,
    )
    if split > 1:
        return out.to(x.dtype)
    if topk == 1:
        return out
    return out.view(t, topk, h).sum(dim=1)


def _launch_gemv(cfg: MoeConfig, x, ids, tw, w13, w2, g13, g2, act, topk):
    t, h = x.shape
    e, i = w13[0].shape[0], w2[0].shape[1]
    n = ids.numel()
    # gate/up sums and the output, fp32, zeroed by one memset.
    acc = torch.zeros(n * 2 * i + t * h, dtype=torch.float32, device=x.device)
    gu, out = acc[:n * 2 * i].view(n, 2 * i), acc[n * 2 * i:].view(t, h)
    for w, kc, a, dst, k, cols, g, stride in ((w13, cfg.w13, x, gu, h, 2 * i, g13, x.stride(0)),
                                              (w2, cfg.w2, gu, out, i, h, g2, 0)):
        bw = kc.block_n // 8
        moe_gemv_kernel[(n, triton.cdiv(cols // 8, bw), kc.split_k)](
            a, ids, tw, *w, dst, e, k, cols, g, topk, stride, kc.split_k,
            W13=dst is gu, ACT=ACTS[act], BLOCK_W=bw, BLOCK_K=kc.block_k, num_warps=kc.num_warps,
        )
    return out.to(x.dtype)


_TUNED: dict[tuple, MoeConfig] = {}


def _time(cfg: MoeConfig, args) -> float:
    try:
        return triton.testing.do_bench(lambda: _launch(cfg, *args), warmup=2, rep=10, return_mode="median")
    except Exception as err:  # a config the compiler rejects on this GPU (e.g. shared memory)
        logger.debug("moe config %s failed: %s", cfg.label(), err)
        return float("inf")


def _tune(key, base: MoeConfig, args) -> MoeConfig:
    """Coordinate descent from the heuristic, twice over (a wide tile may only win once K is split,
    and the reverse): each projection's tile, then each one's K split; then the block rows. About
    50 distinct timings, where the full product would be thousands."""
    time_once = functools.cache(lambda cfg: _time(cfg, args))
    best = base
    for _ in range(2):
        for field in ("w13", "w2"):
            cands = [replace(best, **{field: kc}) for kc in _variants(getattr(best, field), best.block_m)]
            best = min([best, *cands], key=time_once)
            # One more stage in flight, then shorter K steps (more loads per byte of smem).
            for change in ({"num_stages": 4}, {"block_k": getattr(best, field).block_k // 2}):
                cfg = replace(best, **{field: replace(getattr(best, field), **change)})
                if getattr(cfg, field).block_k >= 16:
                    best = min(best, cfg, key=time_once)
        for field in ("w13", "w2"):
            kc = getattr(best, field)
            best = min([best, *(replace(best, **{field: replace(kc, split_k=s)}) for s in (1, 2, 4, 8))],
                       key=time_once)
    if not best.naive:
        best = min([best, *(replace(best, block_m=bm) for bm in (best.block_m // 2, best.block_m * 2)
                            if 16 <= bm <= 64)], key=time_once)
    logger.info("moe_w4 %s -> %s (%.1f us)", key, best.label(), time_once(best) * 1e3)
    return best


def _tune_gemv(key, base: MoeConfig, dot: MoeConfig, args) -> MoeConfig:
    """Decode: two steps of single-field changes around the CUDA-core config, against the tl.dot
    heuristic's config (about 25 timings)."""
    time_once = functools.cache(lambda cfg: _time(cfg, args))
    best = min(_gemv_variants(base), key=time_once)
    best = min([*_gemv_variants(best), dot], key=time_once)
    logger.info("moe_w4 %s -> %s (%.1f us)", key, best.label(), time_once(best) * 1e3)
    return best


def choose_config(x, topk_ids, w13, w2, g13: int, g2: int, args, packed: bool = False) -> MoeConfig:
    """packed: the experts in the packed layout, which only the tl.dot forms read."""
    t, h = x.shape
    topk = topk_ids.shape[1]
    e, i = w13[0].shape[0], w2[0].shape[1] * (8 if packed else 1)
    untuned = heuristic_config if packed else default_config
    if _interpreting() or x.device.type != "cuda":
        return untuned(t, topk, e, h, i, g13, g2, sms=4)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    bucket = 1 << max(0, (t - 1).bit_length())
    key = (x.device, bucket, topk, e, h, i, g13, g2, x.dtype, use_naive(t, topk, e), packed)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if os.environ.get("FASTAWQ_TRITON_TUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        return untuned(t, topk, e, h, i, g13, g2, sms)
    if packed:
        _TUNED[key] = _tune(key, heuristic_config(t, topk, e, h, i, g13, g2, sms), args)
    elif use_naive(t, topk, e):
        _TUNED[key] = _tune_gemv(key, gemv_config(t, topk, h, i, g13, g2, sms),
                                 heuristic_config(t, topk, e, h, i, g13, g2, sms), args)
    else:
        best = _tune(key, heuristic_config(t, topk, e, h, i, g13, g2, sms), args)
        if t * topk <= 2 * e:
            # Two or fewer assignments per expert on average (Qwen3 batched decode): reading an
            # expert once per assignment on CUDA cores may beat one tl.dot block per expert.
            gemv = gemv_config(t, topk, h, i, g13, g2, sms)
            if _time(gemv, args) < _time(best, args):
                best = gemv
        _TUNED[key] = best
    return _TUNED[key]


# x [T, H] fp16/bf16 · topk_ids [T, k] int · topk_weights [T, k]
# w13_qweight [E, H, 2I // 8] · w13_scales [E, H // G, 2I] · w13_qzeros [E, H // G, 2I // 8]
# w2_qweight [E, I, H // 8] · w2_scales [E, I // G, H] · w2_qzeros [E, I // G, H // 8]  ->  [T, H]
def moe_w4(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros,
           group_size: int, act: str = "silu", *, config: MoeConfig | None = None) -> torch.Tensor:
    t, h = x.shape
    i = w2_qweight.shape[1]
    g13 = h if group_size == -1 else group_size
    g2 = i if group_size == -1 else group_size
    if x.stride(-1) != 1:
        x = x.contiguous()
    # The kernels index everything else as dense arrays (no-ops when they already are).
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    w13 = (w13_qweight.contiguous(), w13_scales.contiguous(), w13_qzeros.contiguous())
    w2 = (w2_qweight.contiguous(), w2_scales.contiguous(), w2_qzeros.contiguous())
    if t == 0:
        return x.new_empty((0, h))
    args = (x, topk_ids, topk_weights, w13, w2, g13, g2, act)
    cfg = config or choose_config(x, topk_ids, w13, w2, g13, g2, args)
    return _launch(cfg, *args)


# x [T, H] fp16/bf16 · topk_ids [T, k] int · topk_weights [T, k]
# w13_wpacked [E, H // 8, 2I] · w13_szpacked [E, H // G, 4I]
# w2_wpacked [E, I // 8, H] · w2_szpacked [E, I // G, 2H]  ->  [T, H]
def moe_w4_packed(x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size: int,
                  act: str = "silu", *, config: MoeConfig | None = None) -> torch.Tensor:
    """moe_w4 on experts in the packed layout (fastawq.ops.repack.awq_experts_repack), tl.dot forms only."""
    t, h = x.shape
    i = w2_wpacked.shape[1] * 8
    g13 = h if group_size == -1 else group_size
    g2 = i if group_size == -1 else group_size
    if x.stride(-1) != 1:
        x = x.contiguous()
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    w13_szpacked, w2_szpacked = w13_szpacked.contiguous(), w2_szpacked.contiguous()
    w13 = (w13_wpacked.contiguous(), w13_szpacked, w13_szpacked)  # (the qzeros slot is unused)
    w2 = (w2_wpacked.contiguous(), w2_szpacked, w2_szpacked)
    if t == 0:
        return x.new_empty((0, h))
    args = (x, topk_ids, topk_weights, w13, w2, g13, g2, act, True)
    cfg = config or choose_config(x, topk_ids, w13, w2, g13, g2, args, packed=True)
    if cfg.gemv:
        raise ValueError(f"moe_w4_packed: config {cfg.label()} is the CUDA-core form, which reads the AWQ layout only")
    return _launch(cfg, *args)


def moe_w4_fits(h: int, i: int, group_size: int, act: str) -> str | None:
    g13 = h if group_size == -1 else group_size
    g2 = i if group_size == -1 else group_size
    if i % 8:
        return f"intermediate size I={i} must be a multiple of 8 for the Triton MoE kernels"
    if not _block_k(g13, h) or not _block_k(g2, i):
        return f"group_size={group_size}, H={h} and I={i} must be multiples of 16 for the Triton MoE kernels"
    if act not in ACTS:
        return f"no Triton activation {act!r}; choose one of {tuple(ACTS)}"
    return None


# router_logits [T, E]  ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64
def topk_route(router_logits, k: int, renormalize: bool = True, scoring: str = "softmax", *,
               correction_bias=None, scale: float = 1.0):
    t, e = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((t, k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    topk_route_kernel[(t,)](
        router_logits, bias, weights, ids, e, router_logits.stride(0), float(scale),
        K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(e), SOFTMAX=scoring == "softmax",
        HAS_BIAS=correction_bias is not None, RENORM=renormalize, num_warps=4 if e <= 256 else 8,
        **launch_options(router_logits.device),
    )
    return weights, ids


# x [T, H] · router_weight [E, H]  ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64
def route(x, router_weight, k: int, renormalize: bool = True, scoring: str = "softmax", *,
          correction_bias=None, scale: float = 1.0):
    """topk_route(x.to(W.dtype) @ W.T rounded to W's dtype, ...) in one launch."""
    return _route(x, router_weight, k, renormalize, scoring, correction_bias, scale, None)[:2]


# x [T, H] · residual [T, H] · norm_weight [H] · router_weight [E, H]
#   ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64 · h [T, H] · x + residual [T, H]
def norm_route(x, residual, norm_weight, eps: float, offset: float, router_weight, k: int, renormalize: bool = True,
               scoring: str = "softmax", *, correction_bias=None, scale: float = 1.0):
    """add_rms_norm(x, residual, ...) and route(h, ...) in one launch."""
    return _route(x, router_weight, k, renormalize, scoring, correction_bias, scale,
                  (residual, norm_weight, float(eps), float(offset)))


def _route(x, router_weight, k, renormalize, scoring, correction_bias, scale, norm):
    t, h = x.shape
    e = router_weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = router_weight.contiguous()
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=x.device)
    if norm is not None:
        residual, norm_weight, eps, offset = norm
        residual, norm_weight = residual.contiguous(), norm_weight.contiguous()
        hbuf, res_out = torch.empty((t, h), dtype=x.dtype, device=x.device), torch.empty_like(residual)
    else:
        residual = norm_weight = hbuf = res_out = x  # unread and unwritten (NORM=False)
        eps, offset = 0.0, 0.0
    if t == 0:
        return weights, ids, hbuf, res_out
    e_pad = triton.next_power_of_2(e)
    block_h = min(triton.next_power_of_2(h), 2048)
    eb = max(1, min(e_pad, _ROUTE_TILE // block_h))  # ~16K weights per program: one pass of loads
    splits = triton.cdiv(e, eb)
    if splits > 1:
        logits = torch.empty((t, e_pad), dtype=torch.float32, device=x.device)
        # Per-token arrival counters: the last part to arrive chooses, then re-arms it.
        counters = WORKSPACE.get(x.device, "route_counters", t, torch.int32, zeroed=True, minimum=1024)
    else:
        logits = counters = weights  # unread (SPLITS == 1)
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    route_kernel[(t, splits)](
        x, w, logits, counters, bias, weights, ids, residual, norm_weight, hbuf, res_out,
        h, e, x.stride(0), float(scale), eps, offset,
        K=k, K_PAD=triton.next_power_of_2(k), E_PAD=e_pad, EB=eb, BLOCK_H=block_h, SPLITS=splits,
        SOFTMAX=scoring == "softmax", HAS_BIAS=correction_bias is not None, RENORM=renormalize,
        NORM=norm is not None, num_warps=8 if eb * block_h > 8192 else 4, **launch_options(x.device),
    )
    return weights, ids, hbuf, res_out


# Router weights one program reads per pass (EB experts x BLOCK_H columns).
_ROUTE_TILE = 16384


def topk_route_fits(e: int, num_groups: int, scoring: str) -> str | None:
    if num_groups > 1:
        return "group-limited routing (num_groups > 1) has no Triton kernel"
    if scoring not in ("softmax", "sigmoid"):
        return f"scoring {scoring!r} has no Triton kernel"
    if e > 4096:
        return f"{e} experts exceed the one-program Triton router (4096)"
    return None
