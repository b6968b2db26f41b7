"""Triton W4A16 kernels: dequantize, and a GEMM for every M, on the AWQ "GEMM" layout and on the
packed layout of fastawq/ops/repack.py (the GEMM's PACKED variant, packed_dequantize_kernel).

The GEMM unpacks 4-bit weights in registers and feeds tl.dot with fp32 accumulation. Small M is
memory-bound: one row cannot fill 132 SMs from N tiles alone, so K is split across programs; the
partial sums meet in a fp32 workspace and the last program of each tile (a per-tile arrival
counter) reduces them and writes the output, so split-K costs no extra launch. Large M is compute-
bound: whichever is faster of the fused kernel and dequantize + torch.matmul (cuBLAS) serves it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack_cols(words, BLOCK_N: tl.constexpr):
    """[R, BLOCK_N // 8] packed words -> [R, BLOCK_N] nibbles in column order."""
    # Repeat each word 8 times along the row (w0 w0 ... w0 w1 ...), then shift each copy by the
    # position of its column's nibble: column c of a group lives in nibble (c % 2) * 4 + c // 2.
    w = tl.interleave(words, words)
    w = tl.interleave(w, w)
    w = tl.interleave(w, w)
    c = tl.arange(0, BLOCK_N) % 8
    shifts = ((c % 2) * 4 + c // 2) * 4
    return (w >> shifts[None, :]) & 0xF


@triton.jit
def _word_nibbles(w):
    """[KB, C4] words -> [KB, C4, r, c_lo, c_hi]: nibble r of byte c = 2 c_hi + c_lo (bits 8c + 4r)."""
    t0 = tl.join(w & 0xF, (w >> 4) & 0xF)
    t1 = tl.join((w >> 8) & 0xF, (w >> 12) & 0xF)
    t2 = tl.join((w >> 16) & 0xF, (w >> 20) & 0xF)
    t3 = tl.join((w >> 24) & 0xF, (w >> 28) & 0xF)
    return tl.join(tl.join(t0, t1), tl.join(t2, t3))


@triton.jit
def _packed_tile(w_ptr, k0, K, N, pid_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """wpacked [K/8, N] -> the [BLOCK_K, BLOCK_N] nibbles of rows k0 .. k0 + BLOCK_K, columns of tile pid_n."""
    return _packed_tile_ld(w_ptr, k0, K, N, N, pid_n, BLOCK_N, BLOCK_K)


@triton.jit
def _packed_tile_ld(w_ptr, k0, K, N, LD, pid_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_packed_tile of the N columns starting at w_ptr of a packed matrix whose rows (of 8 K rows)
    are LD words apart (the MoE kernels' gate or up half of w13: N = I, LD = 2I).

    Word (kb, 4 c4 + j) holds rows 8kb + 2j (even nibbles) and 8kb + 2j + 1 (odd) of columns
    4c4 .. 4c4+3 (byte c). A thread loads the 4 words of one (kb, c4) (16 bytes) and expands them
    with joins, so its 8 rows x 4 columns stay in its own registers: the final permutation moves
    no data between threads, and the dequantized tile is stored to shared memory in vectors."""
    KB: tl.constexpr = BLOCK_K // 8
    C4: tl.constexpr = BLOCK_N // 4
    kb = k0 // 8 + tl.arange(0, KB)
    c4 = pid_n * C4 + tl.arange(0, C4)
    ptrs = w_ptr + kb[:, None, None] * LD + (4 * c4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    mask = (kb < K // 8)[:, None, None] & (c4 < N // 4)[None, :, None]
    words = tl.load(ptrs, mask=mask, other=0)  # [kb, c4, j]: as in memory
    w_even, w_odd = tl.split(tl.reshape(words, (KB, C4, 2, 2)))  # j = 2 j_hi + j_lo: j_lo = 0, 1
    w0, w2 = tl.split(w_even)
    w1, w3 = tl.split(w_odd)
    t = tl.join(tl.join(_word_nibbles(w0), _word_nibbles(w1)), tl.join(_word_nibbles(w2), _word_nibbles(w3)))
    # [kb, c4, r, c_lo, c_hi, j_lo, j_hi] -> [kb, j_hi, j_lo, r | c4, c_hi, c_lo]: row 8kb + 2j + r, column 4c4 + c
    return tl.reshape(tl.permute(t, (0, 6, 5, 2, 1, 4, 3)), (BLOCK_K, BLOCK_N))


@triton.jit
def _dequant(q, z, s, a, INTERPRET: tl.constexpr):
    """(q - z) * s in a's dtype (fp32 under the interpreter): nibbles q, zeros z (ints or exact
    floats) and scales s, already broadcastable against q."""
    if INTERPRET:
        # The interpreter's bf16 conversions and bf16 tl.dot are wrong: stay in fp32 there.
        return (q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
    # int4 -> half through the exponent field: (MAGIC | q) is OFFSET + q exactly, and OFFSET + z
    # likewise, so their difference is the exact small integer q - z; one rounding in the multiply
    # by s, as in a dequantized weight matrix of x's dtype.
    if a.dtype == tl.float16:
        qh = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        if z.dtype == tl.int32:
            zh = (z | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            zh = (z.to(tl.float32) + 1024.0).to(tl.float16)
    else:
        qh = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if z.dtype == tl.int32:
            zh = (z | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            zh = (z.to(tl.float32) + 128.0).to(tl.bfloat16)
    return (qh - zh) * s.to(a.dtype)


@triton.jit
def awq_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, G, split_k,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr = False,
    PACKED: tl.constexpr = False,
):
    # AWQ:    x [M, K] · qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8] -> out [M, N]
    # PACKED: x [M, K] · wpacked [K // 8, N] (qw_ptr) · szpacked [K // G, 2N] (s_ptr; qz_ptr unused)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row-tiles share each weight tile while it sits in L2.
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    n8 = N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_w = offs_w < n8

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # BLOCK_K divides G, so each K tile lies inside one quantization group.
    for t in range(pid_k, K // BLOCK_K, split_k):
        k0 = t * BLOCK_K
        g = k0 // G
        if PACKED:
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            q = _packed_tile(qw_ptr, k0, K, N, pid_n, BLOCK_N, BLOCK_K)
            # (scale, zero) pairs: one contiguous [BLOCK_N, 2] load, split in registers.
            sz = tl.load(s_ptr + g * 2 * N + 2 * offs_n[:, None] + tl.arange(0, 2)[None, :], mask=mask_n[:, None],
                         other=0.0)
            s, z = tl.split(sz)
            b = _dequant(q, z[None, :], s[None, :], a, INTERPRET)
        else:
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
            words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * n8 + offs_w[None, :], mask=mask_w[None, :], other=0)
            zw = tl.load(qz_ptr + g * n8 + offs_w, mask=mask_w, other=0)
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)
            b = _dequant(_unpack_cols(words, BLOCK_N), _unpack_cols(zw[None, :], BLOCK_N), s[None, :], a, INTERPRET)
        if INTERPRET:
            acc = tl.dot(a.to(tl.float32), b, acc)
        else:
            acc = tl.dot(a, b, acc)

    tile = pid_m * num_pid_n + pid_n
    _store_split_k(acc, offs_m, offs_n, M, N, pid_k, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr, stride_om,
                   split_k, HAS_BIAS, SPLIT)


@triton.jit
def _store_split_k(acc, offs_m, offs_n, M, N, pid_k, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr, stride_om,
                   split_k, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Write a [BM, BN] fp32 tile; with split-K, through the workspace and the last arrival."""
    mask_n = offs_n < N
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & mask_n[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Workspace [split_k, M, N] fp32: each split writes its partial, the last to arrive sums.
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=out_mask)
        # acq_rel: the partial above is published before the count; the last arrival sees all.
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for i in range(split_k):
                total += tl.load(ws_tile + i * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            # Re-arm the counter for the next launch (no memset kernel needed).
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def awq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    N, K, G, split_k,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
    DEFER: tl.constexpr = False,
):
    # x [1, K] · qweight [K, N // 8] -> out [1, N]. No tensor cores: one row, memory-bound.
    # Works on nibbles where they lie: tile [BLOCK_K, BLOCK_W words, 8 nibbles]; nibble i of word w
    # is column 8w + (0, 2, 4, 6, 1, 3, 5, 7)[i], so scales, zeros and outputs are addressed through
    # that permutation instead of un-interleaving the weights.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n8 = N // 8
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    nib = tl.arange(0, 8)
    col = offs_w[:, None] * 8 + ((nib % 4) * 2 + nib // 4)[None, :]  # [BW, 8] output columns
    shifts = (nib * 4)[None, None, :]
    offs_k = tl.arange(0, BLOCK_K)
    mask_w = offs_w < n8
    acc = tl.zeros((BLOCK_W, 8), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_K, BLOCK_W, 8), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, split_k):
        k0 = t * BLOCK_K
        xk = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * n8 + offs_w[None, :], mask=mask_w[None, :], other=0)
        nibbles = (words[:, :, None] >> shifts) & 0xF
        # int -> fp32 through the exponent field (2^23 + q, exact), cheaper than a conversion.
        qf = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        g = k0 // G
        zw = tl.load(qz_ptr + g * n8 + offs_w, mask=mask_w, other=0)
        z = ((zw[:, None] >> (nib * 4)[None, :]) & 0xF).to(tl.float32)
        s = tl.load(s_ptr + g * N + col, mask=mask_w[:, None], other=0.0).to(tl.float32)
        if DEFER:
            # Keep one partial per (row, column) in registers and reduce over K once at the end:
            # no cross-thread reduction in the loop, at the price of the scale per element.
            acc3 += (qf * s[None, :, :] - (z * s)[None, :, :]) * xk[:, None, None]
        else:
            # BLOCK_K divides G: the group's scale and zero apply to the whole tile after the K
            # sum: sum_k (q - z) s x_k = s (sum_k q x_k - z sum_k x_k).
            part = tl.sum(qf * xk[:, None, None], axis=0)
            acc += s * (part - z * tl.sum(xk, axis=0))
    if DEFER:
        acc = tl.sum(acc3, axis=0)
    offs_m = tl.arange(0, 1)
    _store_split_k(tl.reshape(acc, (1, BLOCK_W * 8)), offs_m, tl.reshape(col, (BLOCK_W * 8,)), 1, N, pid_k,
                   pid_n, bias_ptr, out_ptr, ws_ptr, lock_ptr, N, split_k, HAS_BIAS, SPLIT)


@triton.jit
def awq_dequantize_kernel(
    qw_ptr, s_ptr, qz_ptr, out_ptr,
    K, N, G,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8] -> out [K, N]
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    n8 = N // 8
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    mask_k = offs_k < K
    mask_n = offs_n < N
    mask_w = offs_w < n8
    words = tl.load(qw_ptr + offs_k[:, None] * n8 + offs_w[None, :], mask=mask_k[:, None] & mask_w[None, :], other=0)
    g = offs_k // G
    zw = tl.load(qz_ptr + g[:, None] * n8 + offs_w[None, :], mask=mask_k[:, None] & mask_w[None, :], other=0)
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    q = _unpack_cols(words, BLOCK_N)
    z = _unpack_cols(zw, BLOCK_N)
    w = (q - z).to(tl.float32) * s.to(tl.float32)
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_k[:, None] & mask_n[None, :])


@triton.jit
def packed_dequantize_kernel(
    w_ptr, sz_ptr, out_ptr,
    K, N, G,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # wpacked [K // 8, N] int32 · szpacked [K // G, 2N] -> out [K, N]; BLOCK_K divides G (a tile is in one group)
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    rows = k0 + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K)[:, None] & (offs_n < N)[None, :]
    q = _packed_tile(w_ptr, k0, K, N, pid_n, BLOCK_N, BLOCK_K)
    sz = sz_ptr + (k0 // G) * 2 * N + 2 * offs_n[:, None] + tl.arange(0, 2)[None, :]
    s, z = tl.split(tl.load(sz, mask=(offs_n < N)[:, None], other=0.0).to(tl.float32))
    w = (q.to(tl.float32) - z[None, :]) * s[None, :]
    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
