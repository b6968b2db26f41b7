"""Load-time repack of AWQ "GEMM" weights for the decode kernel ``awq_gemv_packed``, its exact
inverse, and the op's entry with the fake impl of the compiled kernel.

Layout (csrc/gemv/awq_gemv_packed.h describes the same bytes from the kernel's side):

- ``wpacked [K/8, N] int32``: the 4 words at ``(kb, 4*c4 .. 4*c4 + 3)`` (16 bytes, one lane's load)
  hold rows ``8kb .. 8kb + 7`` of columns ``4c4 .. 4c4 + 3``. Word ``j`` holds row ``8kb + 2j`` in
  its even nibbles and row ``8kb + 2j + 1`` in its odd ones; column ``c`` is the byte at bits ``8c``.
- ``szpacked [K/G, 2N]`` (the scales' dtype): ``(scale, zero)`` of column ``n`` at ``2n, 2n + 1``,
  zeros as exact small integers, so one 16-byte load is a group's pairs for 4 columns.

The on-disk format stays AWQ GEMM: ``awq_gemv_unpack`` gives back the original tensors bit for bit.
Pure torch ops, so the repack runs on the weights' own device (CPU or GPU).
"""
from __future__ import annotations

import torch

from fastawq import _ext, reference

MAX_M = 8  # the kernel's largest batch


def _check_repackable(k: int, n: int, g: int) -> None:
    if k % 8 != 0 or n % 8 != 0:
        raise ValueError(f"awq_gemv_repack: needs K and N multiples of 8, got K={k}, N={n}, group_size={g}")


def _nibbles_to_words(nib: torch.Tensor) -> torch.Tensor:
    """[..., 8] ints in [0, 15] (nibble i at bits 4i) -> [...] int32 words."""
    shifts = torch.arange(0, 32, 4, device=nib.device, dtype=torch.int64)
    word = (nib.to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _words_to_nibbles(words: torch.Tensor) -> torch.Tensor:
    """[...] int32 words -> [..., 8] int32 nibbles (nibble i at bits 4i)."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def awq_gemv_repack(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM ``qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8]`` -> ``(wpacked, szpacked)``."""
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, group_size)
    _check_repackable(k, n, g)
    q = reference.unpack_int4(qweight)  # [K, N] column order
    # [kb, j, r, c4, c] -> [kb, c4, j, c, r]: nibble 2c + r of word j
    q = q.view(k // 8, 4, 2, n // 4, 4).permute(0, 3, 1, 4, 2).reshape(k // 8, n // 4, 4, 8)
    wpacked = _nibbles_to_words(q).reshape(k // 8, n).contiguous()
    z = reference.unpack_int4(qzeros).to(scales.dtype)  # integers 0..15: exact in fp16 and bf16
    szpacked = torch.stack([scales, z], dim=-1).reshape(k // g, 2 * n).contiguous()
    return wpacked, szpacked


def awq_gemv_unpack(
    wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact inverse of ``awq_gemv_repack``: ``(qweight, scales, qzeros)`` in AWQ GEMM layout."""
    if wpacked.dtype != torch.int32 or wpacked.dim() != 2 or wpacked.shape[1] != n or n % 8 != 0:
        raise ValueError(f"awq_gemv_unpack: wpacked must be int32 [K/8, N={n}], got {wpacked.dtype} "
                         f"{tuple(wpacked.shape)}")
    k = wpacked.shape[0] * 8
    g = group_size
    if g <= 0 or k % g != 0 or tuple(szpacked.shape) != (k // g, 2 * n):
        raise ValueError(f"awq_gemv_unpack: szpacked must be [K/G, 2N] = [{k // g if g > 0 else '?'}, {2 * n}] "
                         f"for K={k}, N={n}, group_size={g}, got {tuple(szpacked.shape)}")
    nib = _words_to_nibbles(wpacked.view(k // 8, n // 4, 4)).view(k // 8, n // 4, 4, 4, 2)
    q = nib.permute(0, 2, 4, 1, 3).reshape(k, n)  # [kb, c4, j, c, r] -> [kb, j, r, c4, c]
    qweight = reference.pack_int4(q)
    sz = szpacked.view(k // g, n, 2)
    scales = sz[..., 0].contiguous()
    qzeros = reference.pack_int4(sz[..., 1].to(torch.int32))
    return qweight, scales, qzeros


def awq_gemv_packed(
    x: torch.Tensor,
    wpacked: torch.Tensor,
    szpacked: torch.Tensor,
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M <= 8, K] @ W`` from the repacked operands: the compiled kernel on CUDA, else the
    reference through the inverse repack (for tests and CPU fallbacks; it is not fast)."""
    if x.is_cuda and _ext.has_op("awq_gemv_packed"):
        return torch.ops.fastawq.awq_gemv_packed(x, wpacked, szpacked, n, group_size, bias)
    qweight, scales, qzeros = awq_gemv_unpack(wpacked, szpacked, n, group_size)
    return reference.awq_gemm(x, qweight, scales, qzeros, group_size, bias)


def _register_fakes() -> None:
    """Output shape of the compiled kernel, so it traces under torch.compile and passes opcheck."""
    if _ext.has_op("awq_gemv_packed"):

        @torch.library.register_fake("fastawq::awq_gemv_packed")
        def _(x, wpacked, szpacked, n, group_size, bias):
            torch._check(x.dim() == 2, lambda: f"x {tuple(x.shape)} must be [M, K]")
            torch._check(x.shape[0] <= MAX_M, lambda: f"awq_gemv_packed takes M <= {MAX_M}, got x {tuple(x.shape)}")
            torch._check(wpacked.dtype == torch.int32, lambda: f"wpacked is {wpacked.dtype}, not int32")
            torch._check(
                wpacked.shape[0] * 8 == x.shape[1] and wpacked.shape[1] == n,
                lambda: f"wpacked {tuple(wpacked.shape)} must be [K/8, N={n}] for x {tuple(x.shape)}",
            )
            torch._check(
                szpacked.shape[1] == 2 * n, lambda: f"szpacked {tuple(szpacked.shape)} must be [K/G, 2N={2 * n}]"
            )
            return x.new_empty((x.shape[0], n))


_register_fakes()
