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
    word = (q.view(rows, cols // PACK, PACK) << _column_shifts(q.device, torch.int64)).sum(dim=-1)
    # Reinterpret the unsigned 32-bit word as int32.
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).contiguous()


# packed [R, C // 8] int32  ->  [R, C] int32 in [0, 15]
def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise TypeError(f"unpack_int4 expects 2-D int32, got {packed.dtype} {tuple(packed.shape)}")
    rows, words = packed.shape
    nib = (packed.unsqueeze(-1) >> _column_shifts(packed.device, torch.int32)) & 0xF  # [R, W, 8] column order
    return nib.reshape(rows, words * PACK).contiguous()


def _column_shifts(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[8]: the bit offset of each column of a group of 8 in its word, 4 * AWQ_REVERSE_ORDER[c].

    Computed on the device (c // 2 + 4 * (c % 2)) rather than indexed by a Python list, which is a
    host-to-device copy and so cannot be captured in a CUDA graph."""
    c = torch.arange(PACK, device=device, dtype=dtype)
    return 4 * ((c >> 1) + 4 * (c & 1))


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
    _check_x(x, k, f"qweight {tuple(qweight.shape)}")
    return _matmul_fp32(x, _dequantize_fp32(qweight, scales, qzeros, g), bias)


def _check_x(x: torch.Tensor, k: int, weight: str) -> None:
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} has K={x.shape[-1]} but {weight} has K={k}")


def _matmul_fp32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k, n = w.shape
    out = x.reshape(-1, k).to(torch.float32) @ w
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


# --- the packed layout (fastawq/ops/repack.py writes it from the AWQ layout, exactly) ---
#   wpacked  [K/8, N] int32: q[k, n] is nibble 2 * (n % 4) + k % 2 of word (k // 8, 4 * (n // 4) + (k % 8) // 2)
#   szpacked [K/G, 2N]: scale of (group, n) at column 2n, its zero point (an exact integer) at 2n + 1


def check_packed_shapes(wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int) -> tuple[int, int, int]:
    """Validate a packed-layout weight of N output columns; return (K, N, G)."""
    if wpacked.dtype != torch.int32 or wpacked.dim() != 2 or wpacked.shape[1] != n or n % PACK != 0:
        raise ValueError(f"wpacked must be int32 [K/8, N={n}] with N a multiple of 8, got {wpacked.dtype} "
                         f"{tuple(wpacked.shape)}")
    k = wpacked.shape[0] * PACK
    g = resolve_group_size(group_size, k)
    if k % g != 0 or g % PACK != 0 or szpacked.dim() != 2 or tuple(szpacked.shape) != (k // g, 2 * n):
        raise ValueError(f"szpacked must be [K/G, 2N] = [{k // g if k % g == 0 else '?'}, {2 * n}] for K={k}, N={n}, "
                         f"group_size={g} (a multiple of 8 dividing K), got {tuple(szpacked.shape)}")
    if szpacked.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"szpacked must be fp16, bf16 or fp32, got {szpacked.dtype}")
    return k, n, g


def _dequantize_packed_fp32(wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, g: int) -> torch.Tensor:
    k = wpacked.shape[0] * PACK
    rows = torch.arange(k, device=wpacked.device)[:, None]
    cols = torch.arange(n, device=wpacked.device)[None, :]
    words = wpacked[rows // 8, 4 * (cols // 4) + (rows % 8) // 2]
    q = ((words >> (4 * (2 * (cols % 4) + rows % 2))) & 0xF).to(torch.float32)
    sz = szpacked.to(torch.float32).view(k // g, n, 2).repeat_interleave(g, dim=0)
    return (q - sz[..., 1]) * sz[..., 0]


# wpacked [K // 8, N] int32 · szpacked [K // G, 2N]  ->  w [K, N] (szpacked's dtype)
def dequantize_packed(wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    _, _, g = check_packed_shapes(wpacked, szpacked, n, group_size)
    return _dequantize_packed_fp32(wpacked, szpacked, n, g).to(szpacked.dtype)


# x [..., K] · wpacked [K // 8, N] int32 · szpacked [K // G, 2N] · bias [N]  ->  [..., N] (x's dtype)
def packed_gemm(
    x: torch.Tensor, wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k, n, g = check_packed_shapes(wpacked, szpacked, n, group_size)
    _check_x(x, k, f"wpacked {tuple(wpacked.shape)}")
    return _matmul_fp32(x, _dequantize_packed_fp32(wpacked, szpacked, n, g), bias)


# --- fused-layer ops ---
# The oracles of the decoder-layer ops in fastawq.ops.layer (and their torch backend): fp32 math,
# rounded to the activation dtype where the model stores a tensor.

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


# x [..., H] · weight [H]  ->  [..., H] (x's dtype)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * (weight + offset); offset is 1.0 for Gemma's (1 + weight) norms."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).to(x.dtype)


# x [..., H] · residual [..., H] or None · weight [H]  ->  (y [..., H], residual' = x + residual)
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sum is rounded to the stream's dtype: the residual stream is stored in it. x in fp32 beside
    # a half residual (an MoE block's unconverted sums) is rounded to that dtype first.
    r = x if residual is None else x.to(residual.dtype) + residual
    return rms_norm(r, weight, eps, offset), r


# gate_up [..., 2I] (gate columns, then up columns)  ->  act(gate) * up [..., I]
def act_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    if act == "silu":
        a = torch.nn.functional.silu(g)
    elif act in ("gelu_pytorch_tanh", "gelu"):
        a = torch.nn.functional.gelu(g, approximate="tanh" if act == "gelu_pytorch_tanh" else "none")
    else:
        raise ValueError(f"activation {act!r} is not one of {ACTIVATIONS}")
    return (a * u).to(gate_up.dtype)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# qkv [B, L, (HQ + 2 HKV) D] · positions [B, L] int · cos/sin [S, D] fp32 · caches [B', S, HKV, D]
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
    """HF "rotate_half" rotary embedding (after an optional per-head RMSNorm of q and k, Qwen3)."""
    b, seq, _ = qkv.shape
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(b, seq, num_heads, head_dim)
    k = k.reshape(b, seq, num_kv_heads, head_dim)
    v = v.reshape(b, seq, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        # The normalised head is rounded to the activation dtype before the weight, as HF does.
        q = (rms_norm(q, torch.ones_like(q_norm_weight), eps).float() * q_norm_weight.float()).to(q.dtype)
        k = (rms_norm(k, torch.ones_like(k_norm_weight), eps).float() * k_norm_weight.float()).to(k.dtype)
    pos = positions.long()
    c = cos[pos].unsqueeze(2)  # [B, L, 1, D]
    s = sin[pos].unsqueeze(2)
    q = _rotate_half(q.float(), c, s).to(qkv.dtype)
    k = _rotate_half(k.float(), c, s).to(k_cache.dtype)
    rows = torch.arange(b, device=qkv.device).unsqueeze(1).expand(b, seq)
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v.to(v_cache.dtype)
    return q


# q [B, HQ, D] · caches [B', S, HKV, D] · lens [B] int  ->  [B, HQ, D] (q's dtype)
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    max_len: int | None = None,
) -> torch.Tensor:
    """One query token per row over its first lens[b] cached positions (grouped KV heads).

    `max_len` (a host int >= every lens[b]) bounds the keys read; None reads lens.max()."""
    b, hq, d = q.shape
    n = max_len if max_len is not None else int(lens.max())
    hkv = k_cache.shape[2]
    # fp32 einsums over the grouped heads: no K/V expansion, and faster on CPU than SDPA's
    # masked half-precision path for one query row.
    qg = q.float().reshape(b, hkv, hq // hkv, d)
    k = k_cache[:b, :n].float()
    v = v_cache[:b, :n].float()
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale
    valid = torch.arange(n, device=q.device)[None, :] < lens[:, None].long()  # [B, n]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.einsum("bhgn,bnhd->bhgd", scores.softmax(-1), v).reshape(b, hq, d).to(q.dtype)

# --- mixture of experts ---
# Per expert e, the AWQ GEMM layout above, stacked on a leading expert dim; w13 holds the gate
# columns [0, I) then the up columns [I, 2I) of one [H, 2I] matrix.

MOE_ACTS = ("silu", "gelu", "gelu_tanh")


def moe_act(h: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(h)
    if act == "gelu":
        return torch.nn.functional.gelu(h)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(h, approximate="tanh")
    raise ValueError(f"act must be one of {MOE_ACTS}, got {act!r}")


# x [T, H] · topk_ids [T, k] int · topk_weights [T, k]
# w13_qweight [E, H, 2I // 8] int32 · w13_scales [E, H // G, 2I] · w13_qzeros [E, H // G, 2I // 8] int32
# w2_qweight [E, I, H // 8] int32 · w2_scales [E, I // G, H] · w2_qzeros [E, I // G, H // 8] int32  ->  [T, H] (x's dtype)
def moe_w4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_qzeros: torch.Tensor,
    group_size: int,
    act: str = "silu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """sum_j w_j * down_e(act(gate_e(x)) * up_e(x)) with e = topk_ids[t, j], in fp32 (the oracle),
    or with dtype=x.dtype what a dequantize-then-matmul layer of that dtype computes (weights
    dequantized in fp32 and rounded once; tests size kernel tolerances from its error)."""
    t, h = x.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    xf = x.to(dtype)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequantize(w13_qweight[e], w13_scales[e].float(), w13_qzeros[e], group_size).to(dtype)
        w2 = dequantize(w2_qweight[e], w2_scales[e].float(), w2_qzeros[e], group_size).to(dtype)
        gate, up = (xf[tok] @ w13).chunk(2, dim=-1)
        y = (moe_act(gate, act) * up) @ w2
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].to(torch.float32)[:, None])
    return out.to(x.dtype)


def check_topk_route(
    router_logits: torch.Tensor, k: int, scoring: str, correction_bias: torch.Tensor | None
) -> tuple[int, int]:
    """Validate topk_route's arguments; return (T, E)."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a 2-D float tensor [T, E], got {router_logits.dtype} "
                         f"{tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"k={k} must lie in [1, {e}] for router_logits {tuple(router_logits.shape)}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if correction_bias is not None and tuple(correction_bias.shape) != (e,):
        raise ValueError(f"correction_bias {tuple(correction_bias.shape)} must be [E={e}]")
    return t, e


# x [T, H] · router_weight [E, H]  ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64
def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    k: int,
    renormalize: bool = True,
    scoring: str = "softmax",
    *,
    correction_bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_route of the router logits: x in the router's dtype times its weight, in that dtype."""
    check_route(x, router_weight)
    logits = torch.nn.functional.linear(x.to(router_weight.dtype), router_weight)
    return topk_route(logits, k, renormalize, scoring, correction_bias=correction_bias, scale=scale)


def check_route(x: torch.Tensor, router_weight: torch.Tensor) -> tuple[int, int]:
    """Validate route's inputs; return (T, E)."""
    if x.dim() != 2 or router_weight.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(f"route needs x [T, H] and router_weight [E, H], got x {tuple(x.shape)} and "
                         f"router_weight {tuple(router_weight.shape)}")
    if not x.is_floating_point() or not router_weight.is_floating_point():
        raise TypeError(f"route needs floating-point x and router_weight, got {x.dtype} and {router_weight.dtype}")
    return x.shape[0], router_weight.shape[0]


# router_logits [T, E]  ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64
def topk_route(
    router_logits: torch.Tensor,
    k: int,
    renormalize: bool = True,
    scoring: str = "softmax",
    *,
    num_groups: int = 1,
    topk_groups: int = 1,
    correction_bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of Mixtral/Qwen (softmax) and DeepSeek-V3 (sigmoid, group-limited, biased).

    The bias only chooses experts; the weights are the unbiased scores of the chosen ones. With
    num_groups > 1 the experts split into equal groups ranked by the sum of their two best biased
    scores, and only the topk_groups best groups compete.
    """
    t, e = check_topk_route(router_logits, k, scoring, correction_bias)
    logits = router_logits.to(torch.float32)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    if num_groups > 1:
        if e % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"{e} experts do not split into {num_groups} groups with topk_groups={topk_groups}")
        grouped = choice.view(t, num_groups, e // num_groups)
        group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    return weights * scale, ids
