"""Pure-torch reference for the AWQ "GEMM" packed format: the oracle of every test.

Layout (what AutoAWQ, transformers and vLLM read and write):

    qweight [K, N // 8] int32   nibble i (bits 4i..4i+3) of a word holds column
                                AWQ_ORDER[i] of its group of 8 consecutive output columns
    qzeros  [K // G, N // 8] int32   packed the same way
    scales  [K // G, N] fp16 (or bf16)
    w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

Everything here runs on any device and favours clarity over speed; it accumulates in fp32.
"""
from __future__ import annotations

import torch

# Column held by nibble i. The interleave lets a kernel turn one word into fp16 pairs
# (n, n+4) with two shifts and a mask: it is the layout the ecosystem standardised on.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Nibble that holds column c (inverse of AWQ_ORDER).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

PACK = 8  # 4-bit values per int32 word


def resolve_group_size(group_size: int, k: int) -> int:
    """-1 means one group spanning all of K."""
    if group_size == -1:
        return k
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    return group_size


def check_awq_shapes(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
) -> tuple[int, int, int]:
    """Validate a packed AWQ weight; return (K, N, G). Errors name every shape involved."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise TypeError(
            f"qweight and qzeros must be int32, got qweight {qweight.dtype}, qzeros {qzeros.dtype}"
        )
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"scales must be fp16, bf16 or fp32, got {scales.dtype}")
    if qweight.dim() != 2 or scales.dim() != 2 or qzeros.dim() != 2:
        raise ValueError(
            f"expected 2-D qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8]; got "
            f"qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, qzeros {tuple(qzeros.shape)}"
        )
    k, n8 = qweight.shape
    n = n8 * PACK
    g = resolve_group_size(group_size, k)
    if k % g != 0:
        raise ValueError(f"K={k} (qweight {tuple(qweight.shape)}) is not divisible by group_size={g}")
    groups = k // g
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n8):
        raise ValueError(
            f"inconsistent AWQ shapes for K={k}, N={n}, group_size={g}: expected scales "
            f"{(groups, n)} and qzeros {(groups, n8)}, got scales {tuple(scales.shape)} and "
            f"qzeros {tuple(qzeros.shape)}"
        )
    return k, n, g


# intweight [R, C] ints in [0, 15]  ->  packed [R, C // 8] int32
def pack_int4(intweight: torch.Tensor) -> torch.Tensor:
    if intweight.dim() != 2:
        raise ValueError(f"pack_int4 expects a 2-D tensor, got shape {tuple(intweight.shape)}")
    rows, cols = intweight.shape
    if cols % PACK != 0:
        raise ValueError(f"number of columns N={cols} (shape {tuple(intweight.shape)}) is not divisible by 8")
    if intweight.is_floating_point():
        raise TypeError(f"pack_int4 expects an integer tensor, got {intweight.dtype}")
    q = intweight.to(torch.int64)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"values to pack must lie in [0, 15], got [{int(q.min())}, {int(q.max())}]")
    q = q.view(rows, cols // PACK, PACK)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    word = (q << shifts).sum(dim=-1)
    # Reinterpret the unsigned 32-bit word as int32.
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).contiguous()


# packed [R, C // 8] int32  ->  [R, C] int32 in [0, 15]
def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise TypeError(f"unpack_int4 expects 2-D int32, got {packed.dtype} {tuple(packed.shape)}")
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, W, 8] in nibble order
    nib = nib[:, :, list(AWQ_REVERSE_ORDER)]  # column order
    return nib.reshape(rows, words * PACK).contiguous()


# wg [R, G] fp32 groups  ->  scales [R, 1] fp32 · zeros [R, 1] fp32 (integers)
def _rtn_grid(wg: torch.Tensor, w_bit: int, zero_point: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's round-to-nearest grid of each group: the one place its scale and zero are computed.

    Asymmetric: s = (max - min) / (2^b - 1), z = clamp(-round(min / s)).
    Symmetric (zero_point=False): s = max|w| / (2^(b-1) - 1), stored with the constant zero 2^(b-1)
    so that both kinds dequantize as (q - z) * s."""
    qmax = 2**w_bit - 1
    if zero_point:
        wmin = wg.amin(dim=1, keepdim=True)
        scales = (wg.amax(dim=1, keepdim=True) - wmin).clamp_(min=1e-5).div_(qmax)
        zeros = wmin.div_(scales).round_().neg_().clamp_(0, qmax)
    else:
        half = 2 ** (w_bit - 1)
        scales = wg.abs().amax(dim=1, keepdim=True).clamp_(min=1e-5).div_(half - 1)
        zeros = torch.full_like(scales, float(half))
    return scales, zeros


def _check_rtn(w: torch.Tensor, group_size: int, w_bit: int) -> int:
    if not 2 <= w_bit <= 8:
        raise ValueError(f"w_bit must be in [2, 8], got {w_bit}")
    k = w.shape[-1]
    g = resolve_group_size(group_size, k)
    if k % g != 0:
        raise ValueError(f"in_features K={k} (weight {tuple(w.shape)}) is not divisible by group_size={g}")
    return g


# w [N, K] (nn.Linear layout)  ->  q [N, K] int32, scales [N, K // G] fp32, zeros [N, K // G] int32
def quantize_groupwise(
    w: torch.Tensor, group_size: int, w_bit: int = 4, zero_point: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest group-wise quantization, AWQ's convention (grid: _rtn_grid):
    q = clamp(round(w / s) + z, 0, 2^b - 1)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got {tuple(w.shape)}")
    g = _check_rtn(w, group_size, w_bit)
    n, k = w.shape
    wg = w.detach().to(torch.float32).reshape(-1, g)
    scales, zeros = _rtn_grid(wg, w_bit, zero_point)
    q = (torch.round(wg / scales) + zeros).clamp(0, 2**w_bit - 1)
    return (
        q.reshape(n, k).to(torch.int32),
        scales.reshape(n, k // g),
        zeros.reshape(n, k // g).to(torch.int32),
    )


# w [..., K]  ->  Q(w) [..., K] in w's dtype (w itself when inplace)
def pseudo_quantize(
    w: torch.Tensor, group_size: int, w_bit: int = 4, zero_point: bool = True, *, inplace: bool = False
) -> torch.Tensor:
    """Quantize then dequantize, (clamp(round(w / s) + z) - z) * s in fp32: what the AWQ search
    evaluates and what quantize_groupwise's integers dequantize to. inplace=True overwrites w
    (contiguous fp32) with no temporaries beyond the grid: the search's inner loop."""
    g = _check_rtn(w, group_size, w_bit)
    if inplace:
        if w.dtype != torch.float32 or not w.is_contiguous():
            raise ValueError(f"inplace pseudo_quantize needs a contiguous fp32 tensor, got {w.dtype} {tuple(w.shape)}")
        wg = w.view(-1, g)
    else:
        wg = w.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(-1, g)
    scales, zeros = _rtn_grid(wg, w_bit, zero_point)
    wg.div_(scales).round_().add_(zeros).clamp_(0, 2**w_bit - 1).sub_(zeros).mul_(scales)
    return w if inplace else wg.view(w.shape).to(w.dtype)


# q [N, K] · scales [N, K // G] · zeros [N, K // G]  ->  qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8]
def pack_awq(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = q.shape
    if n % PACK != 0:
        raise ValueError(f"out_features N={n} (weight {tuple(q.shape)}) is not divisible by 8")
    qweight = pack_int4(q.t().contiguous())
    qzeros = pack_int4(zeros.t().contiguous())
    return qweight, scales.t().contiguous().to(dtype), qzeros


def quantize_awq(
    w: torch.Tensor, group_size: int, zero_point: bool = True, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of w [N, K] straight into the packed AWQ layout."""
    q, s, z = quantize_groupwise(w, group_size, 4, zero_point)
    return pack_awq(q, s, z, dtype)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  w [K, N] (scales' dtype)
def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    k, n, g = check_awq_shapes(qweight, scales, qzeros, group_size)
    return _dequantize_fp32(qweight, scales, qzeros, g).to(scales.dtype)


def _dequantize_fp32(qweight, scales, qzeros, g):
    q = unpack_int4(qweight).to(torch.float32)
    z = unpack_int4(qzeros).to(torch.float32).repeat_interleave(g, dim=0)
    s = scales.to(torch.float32).repeat_interleave(g, dim=0)
    return (q - z) * s


# x [..., K] · qweight [K, N // 8] · scales [K // G, N] · qzeros [K // G, N // 8] · bias [N]  ->  [..., N] (x's dtype)
def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k, n, g = check_awq_shapes(qweight, scales, qzeros, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} has K={x.shape[-1]} but qweight {tuple(qweight.shape)} has K={k}")
    w = _dequantize_fp32(qweight, scales, qzeros, g)
    out = x.reshape(-1, k).to(torch.float32) @ w
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
