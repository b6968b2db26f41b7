"""Triton W4A16 kernels on the AWQ "GEMM" layout: dequantize, and a GEMM for every M.

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
def awq_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, G,
    stride_xm, stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr = False,
):
    # x [M, K] · qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8] -> out [M, N]
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
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = t * BLOCK_K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
        words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * n8 + offs_w[None, :], mask=mask_w[None, :], other=0)
        g = k0 // G
        zw = tl.load(qz_ptr + g * n8 + offs_w, mask=mask_w, other=0)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        q = _unpack_cols(words, BLOCK_N)
        z = tl.reshape(_unpack_cols(zw[None, :], BLOCK_N), (BLOCK_N,))
        # One rounding of the exact (q - z) * s to the activations' dtype, as in a dequantized
        # weight matrix. (Multiplying in fp32 also sidesteps the interpreter's broken bf16 math.)
        b = ((q - z[None, :]).to(tl.float32) * s[None, :].to(tl.float32)).to(a.dtype)
        if DOT_FP32:
            # Only under TRITON_INTERPRET with bf16: the interpreter's bf16 tl.dot is wrong.
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Workspace [SPLIT_K, M, N] fp32: each split writes its partial, the last to arrive sums.
        tile = pid_m * num_pid_n + pid_n
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=out_mask)
        # acq_rel: the partial above is published before the count; the last arrival sees all.
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(ws_tile + i * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            # Re-arm the counter for the next launch (no memset kernel needed).
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def awq_dequantize_kernel(
    qw_ptr, s_ptr, qz_ptr, out_ptr,
    K, N, G,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
