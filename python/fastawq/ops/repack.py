"""The packed W4 layout: the exact load-time repack of AWQ "GEMM" weights and its inverse, and the
ops on it: ``packed_gemm`` (compiled ``awq_gemv_packed`` for decode, Triton above, torch reference)
and ``packed_dequantize``, with their schemas and fake impls.

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

from typing import Callable

import torch

from fastawq import _ext, reference
from fastawq import backend as backend_mod
from fastawq.backend import select_backend
from fastawq.ops._common import HALF, call_op, check_same_device
from fastawq.ops._common import triton_module as _triton
from fastawq.ops.gemm import check_activations, plan_by_buckets

MAX_M = 8  # awq_gemv_packed's largest batch
MMA_MAX_M = 32  # awq_mma_packed's


def _check_repackable(k: int, n: int, g: int) -> None:
    if k % 8 != 0 or n % 8 != 0 or g % 8 != 0:
        raise ValueError(f"awq_gemv_repack: needs K, N and group_size multiples of 8, got K={k}, N={n}, group_size={g}")


def _nibbles_to_words(nib: torch.Tensor) -> torch.Tensor:
    """[..., 8] int32 in [0, 15] (nibble i at bits 4i) -> [...] int32 words, in int32 throughout
    (a load-time repack of a large layer on the GPU should not hold 8-byte temporaries)."""
    top = nib[..., 7]
    word = (top - 16 * (top >= 8).to(torch.int32)) << 28  # the sign nibble, without overflow
    for i in range(7):
        word |= nib[..., i] << (4 * i)
    return word


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
    k, n, g = reference.check_packed_shapes(wpacked, szpacked, n, group_size)
    nib = _words_to_nibbles(wpacked.view(k // 8, n // 4, 4)).view(k // 8, n // 4, 4, 4, 2)
    q = nib.permute(0, 2, 4, 1, 3).reshape(k, n)  # [kb, c4, j, c, r] -> [kb, j, r, c4, c]
    qweight = reference.pack_int4(q)
    sz = szpacked.view(k // g, n, 2)
    scales = sz[..., 0].contiguous()
    qzeros = reference.pack_int4(sz[..., 1].to(torch.int32))
    return qweight, scales, qzeros


def awq_experts_repack(
    w13_qweight: torch.Tensor, w13_scales: torch.Tensor, w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor, w2_scales: torch.Tensor, w2_qzeros: torch.Tensor, group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked AWQ experts (``WQExperts``' buffers) -> ``(w13_wpacked [E, H/8, 2I], w13_szpacked
    [E, H/G, 4I], w2_wpacked [E, I/8, H], w2_szpacked [E, I/G, 2H])``: each expert's ``awq_gemv_repack``,
    exactly (``awq_gemv_unpack`` of expert e gives its AWQ tensors back), for moe_mma_packed_w4."""
    if w13_qweight.dim() != 3 or w2_qweight.dim() != 3:
        raise ValueError(f"awq_experts_repack: stacked [E, K, N/8] weights expected, got w13_qweight "
                         f"{tuple(w13_qweight.shape)}, w2_qweight {tuple(w2_qweight.shape)}")
    out = []
    for qw, sc, qz in ((w13_qweight, w13_scales, w13_qzeros), (w2_qweight, w2_scales, w2_qzeros)):
        g = reference.resolve_group_size(group_size, qw.shape[1])
        pairs = [awq_gemv_repack(qw[e], sc[e], qz[e], g) for e in range(qw.shape[0])]
        out += [torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])]
    return out[0], out[1], out[2], out[3]


# --- packed_gemm: x @ W on the packed layout --------------------------------------------------


def _packed_gemm_impl(
    x: torch.Tensor, wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int,
    bias: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    if backend == "triton":
        return _triton().packed_gemm(x, wpacked, szpacked, n, group_size, bias)
    return reference.packed_gemm(x, wpacked, szpacked, n, group_size, bias)


# The Triton and torch backends as one schema'd op (the compiled one is fastawq::awq_gemv_packed).
_packed_gemm_op = torch.library.custom_op("fastawq::packed_gemm", _packed_gemm_impl, mutates_args=())


def _check_packed_call(x, wpacked, szpacked, n: int) -> None:
    torch._check(x.dim() == 2, lambda: f"x {tuple(x.shape)} must be [M, K]")
    torch._check(wpacked.dtype == torch.int32, lambda: f"wpacked is {wpacked.dtype}, not int32")
    torch._check(
        wpacked.shape[0] * 8 == x.shape[1] and wpacked.shape[1] == n,
        lambda: f"wpacked {tuple(wpacked.shape)} must be [K/8, N={n}] for x {tuple(x.shape)}",
    )
    torch._check(szpacked.shape[1] == 2 * n, lambda: f"szpacked {tuple(szpacked.shape)} must be [K/G, 2N={2 * n}]")


@_packed_gemm_op.register_fake
def _(x, wpacked, szpacked, n, group_size, bias, backend):
    _check_packed_call(x, wpacked, szpacked, n)
    return x.new_empty((x.shape[0], n))


def _packed_gemm_fits(be: str, x2: torch.Tensor, wpacked, szpacked, n: int, k: int, g: int, rows) -> str | None:
    if be in ("cuda", "triton") and x2.dtype not in HALF:
        return f"x is {x2.dtype}; the {be} kernels take fp16 or bf16 activations"
    if be == "cuda":
        op = _compiled_packed_op(rows, x2.device)
        limit = {"awq_gemv_packed": MAX_M, "awq_mma_packed": MMA_MAX_M}.get(op)
        if limit is not None and (rows is None or rows > limit):
            return f"{op} takes M <= {limit}, the triton backend serves larger M"
        if not _ext.has_op(op):
            return f"fastawq._C was built without {op}"
        if op == "awq_wgmma_packed":
            with torch.cuda.device(x2.device):
                why = torch.ops.fastawq.awq_wgmma_packed_declines()
            if why:
                return why
        if g % 32 or k % 32:
            return f"{op} needs group_size and K multiples of 32, got group_size={g}, K={k}"
        if any(t.data_ptr() % 16 or not t.is_contiguous() for t in (wpacked, szpacked)):
            return f"{op} needs contiguous, 16-byte aligned wpacked and szpacked"
        return None
    if be == "triton":
        return _triton().packed_gemm_fits(x2, wpacked, g)
    return None


_COMPILED_PACKED_OPS = {"gemv": "awq_gemv_packed", "mma": "awq_mma_packed", "gemm": "awq_gemm_packed",
                        "wgmma": "awq_wgmma_packed"}


def _compiled_packed_op(rows: int | None, device: torch.device | None = None) -> str:
    """The compiled op of an M bucket (None: above every bucket) on `device`, as backend.packed_kernel
    says."""
    return _COMPILED_PACKED_OPS[backend_mod.packed_kernel(rows, device)]


def _bind_packed(be: str, dtype: torch.dtype, wpacked, szpacked, n: int, g: int, bias, rows: int | None):
    if be != "torch":
        # The kernels read the bias and the (scale, zero) pairs in x's dtype.
        bias = bias.to(dtype) if bias is not None and bias.dtype != dtype else bias
        szpacked = szpacked.to(dtype) if szpacked.dtype != dtype else szpacked
    if be == "cuda":
        op = getattr(torch.ops.fastawq, _compiled_packed_op(rows, wpacked.device))

        def run(x2):
            x2 = x2.contiguous()
            return op(x2 if x2.data_ptr() % 16 == 0 else x2.clone(), wpacked, szpacked, n, g, bias)

        return run
    return lambda x2: call_op(_packed_gemm_op, _packed_gemm_impl, x2, wpacked, szpacked, n, g, bias, be)


# x [..., K] · wpacked [K // 8, N] int32 · szpacked [K // G, 2N] · bias [N]  ->  [..., N] (x's dtype)
def packed_gemm(
    x: torch.Tensor, wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int,
    bias: torch.Tensor | None = None, *, backend: str | None = None,
) -> torch.Tensor:
    """y = x @ W + bias for W in the packed layout; the same numbers as awq_gemm on its AWQ tensors."""
    return packed_gemm_plan(x, wpacked, szpacked, n, group_size, bias, backend=backend)(x)


def packed_gemm_plan(
    x: torch.Tensor,
    wpacked: torch.Tensor,
    szpacked: torch.Tensor,
    n: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """packed_gemm validated once and bound per M bucket, as awq_gemm_plan: on CUDA the compiled
    awq_gemv_packed up to backend.PACKED_GEMV_MAX_M rows, awq_mma_packed up to
    backend.PACKED_MMA_MAX_M, awq_gemm_packed up to backend.PACKED_GEMM_MAX_M, the Triton GEMM on
    the packed layout above (awq_gemm_packed there too when the compiled backend is forced)."""
    k, n, g = reference.check_packed_shapes(wpacked, szpacked, n, group_size)
    check_activations(x, bias, k, n, f"wpacked {tuple(wpacked.shape)} (N={n})")
    device = check_same_device(x=x, wpacked=wpacked, szpacked=szpacked, bias=bias)
    probe = x.reshape(-1, k)[:1] if x.numel() else x.new_empty((1, k))
    return plan_by_buckets(
        "packed_gemm", device, k, n, backend,
        fits=lambda be, rows: _packed_gemm_fits(be, probe, wpacked, szpacked, n, k, g, rows),
        bind=lambda be, bound: _bind_packed(be, x.dtype, wpacked, szpacked, n, g, bias, bound),
        variant=lambda be, bound: _compiled_packed_op(bound, device) if be == "cuda" else None,
    )


# --- packed_dequantize ------------------------------------------------------------------------


def _packed_dequantize_impl(
    wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int, backend: str
) -> torch.Tensor:
    if backend == "triton":
        return _triton().packed_dequantize(wpacked, szpacked, n, group_size)
    return reference.dequantize_packed(wpacked, szpacked, n, group_size)


_packed_dequantize_op = torch.library.custom_op(
    "fastawq::packed_dequantize", _packed_dequantize_impl, mutates_args=()
)


@_packed_dequantize_op.register_fake
def _(wpacked, szpacked, n, group_size, backend):
    torch._check(wpacked.dtype == torch.int32, lambda: f"wpacked is {wpacked.dtype}, not int32")
    torch._check(wpacked.shape[1] == n, lambda: f"wpacked {tuple(wpacked.shape)} must be [K/8, N={n}]")
    torch._check(szpacked.shape[1] == 2 * n, lambda: f"szpacked {tuple(szpacked.shape)} must be [K/G, 2N={2 * n}]")
    return szpacked.new_empty((wpacked.shape[0] * 8, n))


# wpacked [K // 8, N] int32 · szpacked [K // G, 2N]  ->  w [K, N] (szpacked's dtype), bit-exact
def packed_dequantize(
    wpacked: torch.Tensor, szpacked: torch.Tensor, n: int, group_size: int, *, backend: str | None = None
) -> torch.Tensor:
    _, n, g = reference.check_packed_shapes(wpacked, szpacked, n, group_size)
    device = check_same_device(wpacked=wpacked, szpacked=szpacked)

    def fits(be: str) -> str | None:
        if be == "triton" and szpacked.dtype not in HALF:
            return f"szpacked is {szpacked.dtype}; the Triton kernel produces fp16 or bf16"
        return None

    be = select_backend("packed_dequantize", device, backend=backend, shapes_ok=fits)
    return call_op(_packed_dequantize_op, _packed_dequantize_impl, wpacked, szpacked, n, g, be)


def _register_fakes() -> None:
    """Output shape of the compiled kernel, so it traces under torch.compile and passes opcheck."""
    if _ext.has_op("awq_gemv_packed"):

        @torch.library.register_fake("fastawq::awq_gemv_packed")
        def _(x, wpacked, szpacked, n, group_size, bias, warps_per_sm=0):
            _check_packed_call(x, wpacked, szpacked, n)
            torch._check(x.shape[0] <= MAX_M, lambda: f"awq_gemv_packed takes M <= {MAX_M}, got x {tuple(x.shape)}")
            return x.new_empty((x.shape[0], n))

    if _ext.has_op("awq_gemv_packed_act"):

        @torch.library.register_fake("fastawq::awq_gemv_packed_act")
        def _(gate_up, wpacked, szpacked, n, group_size, bias, act):
            torch._check(gate_up.dim() == 2 and gate_up.shape[1] == 2 * wpacked.shape[0] * 8,
                         lambda: f"gate_up {tuple(gate_up.shape)} must be [M, 2K] for wpacked {tuple(wpacked.shape)}")
            torch._check(gate_up.shape[0] <= 2, lambda: f"awq_gemv_packed_act takes M <= 2, got {tuple(gate_up.shape)}")
            return gate_up.new_empty((gate_up.shape[0], n))

    if _ext.has_op("awq_gemv_packed_sums"):

        @torch.library.register_fake("fastawq::awq_gemv_packed_sums")
        def _(x, wpacked, szpacked, n, group_size, bias, sums, zero=None):
            _check_packed_call(x, wpacked, szpacked, n)
            torch._check(x.shape[0] <= 2 and tuple(sums.shape) == (x.shape[0], n) and sums.dtype == torch.float32,
                         lambda: f"awq_gemv_packed_sums: x {tuple(x.shape)} (M <= 2), sums {tuple(sums.shape)} "
                                 f"{sums.dtype} (fp32 [M, {n}])")
            if zero is not None:
                torch._check(zero.dtype == torch.float32 and zero.numel() % 4 == 0,
                             lambda: f"awq_gemv_packed_sums: zero {tuple(zero.shape)} {zero.dtype} must be fp32, "
                                     "a multiple of 4 elements")

    if _ext.has_op("awq_gemv_packed_act_sums"):

        @torch.library.register_fake("fastawq::awq_gemv_packed_act_sums")
        def _(gate_up, wpacked, szpacked, n, group_size, bias, act, sums):
            # gate_up: the activation dtype (szpacked's), or fp32 sums (FASTAWQ_DENSE_GU_SUMS).
            torch._check(gate_up.dim() == 2 and gate_up.shape[1] == 2 * wpacked.shape[0] * 8 and gate_up.shape[0] <= 2,
                         lambda: f"gate_up {tuple(gate_up.shape)} must be [M <= 2, 2K] for wpacked {tuple(wpacked.shape)}")
            torch._check(gate_up.dtype in (szpacked.dtype, torch.float32),
                         lambda: f"gate_up {gate_up.dtype} must be {szpacked.dtype} (szpacked's) or fp32 sums")
            torch._check(tuple(sums.shape) == (gate_up.shape[0], n) and sums.dtype == torch.float32,
                         lambda: f"sums {tuple(sums.shape)} {sums.dtype} must be fp32 [M, {n}]")

    if _ext.has_op("awq_gemv_packed_norm"):

        @torch.library.register_fake("fastawq::awq_gemv_packed_norm")
        def _(x, residual, norm_weight, eps, offset, wpacked, szpacked, n, group_size, bias):
            _check_packed_call(x, wpacked, szpacked, n)
            torch._check(x.shape[0] <= 2, lambda: f"awq_gemv_packed_norm takes M <= 2, got x {tuple(x.shape)}")
            return x.new_empty((x.shape[0], n)), (x.new_empty(x.shape) if residual is not None else x.new_empty((0,)))

    if _ext.has_op("awq_mma_packed"):

        @torch.library.register_fake("fastawq::awq_mma_packed")
        def _(x, wpacked, szpacked, n, group_size, bias, chunks=0, warps_per_sm=0):
            _check_packed_call(x, wpacked, szpacked, n)
            torch._check(
                x.shape[0] <= MMA_MAX_M, lambda: f"awq_mma_packed takes M <= {MMA_MAX_M}, got x {tuple(x.shape)}"
            )
            return x.new_empty((x.shape[0], n))

    if _ext.has_op("awq_gemm_packed"):

        @torch.library.register_fake("fastawq::awq_gemm_packed")
        def _(x, wpacked, szpacked, n, group_size, bias, m_tiles=0, chunks=0, splits=0):
            _check_packed_call(x, wpacked, szpacked, n)
            return x.new_empty((x.shape[0], n))

    if _ext.has_op("awq_wgmma_packed"):

        @torch.library.register_fake("fastawq::awq_wgmma_packed")
        def _(x, wpacked, szpacked, n, group_size, bias, tokens=0, splits=0):
            _check_packed_call(x, wpacked, szpacked, n)
            return x.new_empty((x.shape[0], n))

    if _ext.has_op("awq_wgmma_packed_sums"):

        @torch.library.register_fake("fastawq::awq_wgmma_packed_sums")
        def _(x, wpacked, szpacked, n, group_size, bias, sums, tokens=0, splits=0):
            _check_packed_call(x, wpacked, szpacked, n)
            torch._check(tuple(sums.shape) == (x.shape[0], n) and sums.dtype == torch.float32,
                         lambda: f"awq_wgmma_packed_sums: sums {tuple(sums.shape)} {sums.dtype} must be fp32 "
                                 f"[{x.shape[0]}, {n}] for x {tuple(x.shape)}")


_register_fakes()
