"""Triton kernels for the element-wise pieces of a decoder layer: add + RMSNorm, and act(gate) * up."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import env, launch_options, pdl_enter


def norm_form() -> int:
    """FASTAWQ_NORM_FORM (read at each call): 2 (unset) loads the norm weight before the PDL wait and
    zeroes later projections' sums from a second grid dimension; 1 only the early weight; 0 the
    one-block-a-row kernel of session 40. H100, session 41 (benchmarks/RESULTS.md): decode of the
    Llama-3-8B shape 1.023x / 1.054x / 1.062x at batch 1 / 16 / 64 for 2 against 0, 1.015x / 1.005x /
    1.007x for 1; Qwen3-30B-A3B 1.013x / 0.999x at batch 1 / 16. (Form 2 at no more than 8 warps a
    block, so that 64 rows' zeroing runs in one wave, measured 0.997x / 0.980x / 0.982x at batch 1 / 16
    / 64 against 2 on an H100 in session 43, and was removed.)"""
    raw = env(b"FASTAWQ_NORM_FORM")
    if raw not in ("", "0", "1", "2"):
        raise ValueError(f"FASTAWQ_NORM_FORM must be 0, 1 or 2, got {raw!r}")
    return int(raw) if raw else 2


# Order matters: the kernel takes the index as a constexpr.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, zero_ptr, n, zn, eps, offset,
    HAS_RES: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    EARLY_W: tl.constexpr, ZSPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if ZSPLIT:
        # Grid (rows, 1 + cdiv(zn, BLOCK)): program 0 of a row normalizes it, program p > 0 zeroes
        # the row's p-th BLOCK of sums, so the zeroing (up to 128 KB a row: o_proj's and gate_up's
        # sums) spreads over SMs instead of preceding the norm in one block.
        part = tl.program_id(1)
    else:
        part = 0
    if part > 0:
        pdl_enter(PDL)
        z0 = (part - 1) * BLOCK
        tl.store(zero_ptr + row * zn + z0 + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=z0 + cols < zn)
    else:
        if EARLY_W:
            # The norm weight before the PDL wait: no kernel writes it, and its load (often from DRAM)
            # then overlaps the previous kernel's tail instead of following the row's reduction.
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        pdl_enter(PDL)
        if ZERO and not ZSPLIT:
            # Later projections' fp32 sums, zn a row ([rows, zn]: o_proj's alone, or the QKV
            # projection's beside them), zeroed here (after the PDL wait: earlier kernels are done
            # with the memory) for their blocks to add into.
            for z0 in range(0, zn, BLOCK):
                tl.store(zero_ptr + row * zn + z0 + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=z0 + cols < zn)
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            # x in fp32 (an MoE block's unconverted sums) is rounded to the residual's dtype first, as
            # the block's own conversion would; then the sum is rounded to it too: the residual stream
            # is stored in it.
            x = x.to(res_out_ptr.dtype.element_ty) + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n
        if not EARLY_W:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        y = xf * tl.rsqrt(var + eps) * w
        tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_kernel(
    gu_ptr, out_ptr, inter, ACT: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    if ROUND:
        # fp32 sums (a projection that added into them instead of storing): rounded to the output's
        # dtype first, as that projection's own conversion would have stored them.
        g = g.to(out_ptr.dtype.element_ty)
        u = u.to(out_ptr.dtype.element_ty)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    tl.store(out_ptr + row * inter + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


# x [..., H] · residual [..., H] or None · weight [H]  ->  (y [..., H], x + residual [..., H] or None);
# with a residual, x may be fp32 (rounded to the residual's dtype first) and both outputs take that dtype
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float = 0.0,
    zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x + residual) * (weight + offset); the new residual is None when `residual` is.
    zero: a contiguous fp32 tensor [rows, Z] (any Z; rows those of x) that the kernel fills with zeros
    (for later projections' sums, awq_gemv_packed_sums)."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    if residual is None:
        y = torch.empty_like(x2)
        res_in, res_out = x2, x2  # unread and unwritten (HAS_RES=False)
    else:
        # The outputs take the residual's dtype (x may be fp32 sums: see the kernel).
        res_in = residual.reshape(-1, h).contiguous()
        y = torch.empty_like(res_in)
        res_out = torch.empty_like(res_in)
    block = triton.next_power_of_2(h)
    rows = x2.shape[0]
    zn = 0 if zero is None else zero.numel() // max(rows, 1)
    form = norm_form()
    zsplit = form >= 2 and zn > 0
    grid = (rows, 1 + triton.cdiv(zn, block)) if zsplit else (rows,)
    _add_rms_norm_kernel[grid](
        x2, res_in, weight.contiguous(), y, res_out, x2 if zero is None else zero, h, zn, eps, offset,
        HAS_RES=residual is not None, ZERO=zero is not None, BLOCK=block, EARLY_W=form >= 1, ZSPLIT=zsplit,
        num_warps=min(16, max(1, block // 256)), **launch_options(x2.device),
    )
    return y.reshape(x.shape), (None if residual is None else res_out.reshape(x.shape))


# gate_up [..., 2I] (gate columns, then up columns)  ->  act(gate) * up [..., I]; out_dtype (None:
# gate_up's) other than gate_up's fp32: gate and up rounded to it first (fp32 sums of a projection)
def act_mul(gate_up: torch.Tensor, act: str = "silu", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    two_i = gate_up.shape[-1]
    inter = two_i // 2
    gu = gate_up.reshape(-1, two_i).contiguous()
    out_dtype = out_dtype or gu.dtype
    out = torch.empty(gu.shape[0], inter, device=gu.device, dtype=out_dtype)
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
        gu, out, inter, ACT=ACTIVATIONS.index(act), ROUND=gu.dtype == torch.float32 and out_dtype != gu.dtype,
        BLOCK=block, num_warps=4, **launch_options(gu.device),
    )
    return out.reshape(*gate_up.shape[:-1], inter)
