"""CPU backend for W4A16: fastawq's own AVX-512 / AVX2 kernel (csrc/cpu/), or torch's packed
int4 CPU kernel, each behind a cached, exact load-time repack of the AWQ GEMM layout.

Which kernel serves a call (`kernel_for`): the first of `PREFERENCE` that is present and takes
the call; `FASTAWQ_CPU_KERNEL=fastawq|torch-int4` forces one. When neither takes it,
`awq_gemm_fits` says why and dispatch falls back to the torch reference.

fastawq's kernel (in fastawq._C, built with or without CUDA): any M, fp32 / bf16 / fp16
activations, any N (a multiple of 8, as AWQ packs it), any group size that is a multiple of 8.
It multiplies the activations by 1 + q/16 (exact in bf16 and fp32) and folds zero point and
offset into one FMA per group, accumulating in fp32: fp32 activations get fp32 accuracy (an FMA
chain), bf16 activations that of an fp32-accumulated bf16 matmul (vdpbf16ps where the CPU has
AVX512-BF16). fp16 activations run as fp32. On CPUs with AVX2 but no AVX-512 the default
activation mode (`act_isa`, FASTAWQ_CPU_ACT) rounds x to int8 and uses AVX2 integer dot products
instead. Measured (benchmarks/CPU_RESULTS.md, M=1, 4096 x 4096, g128, 2 threads, AVX-512 CPU):
0.27 ms (bf16 x) and 0.31 ms (fp32 x) against 0.44 ms for torch's kernel in bf16; one thread
0.35 / 0.57 ms against 0.85 ms. Hence it comes first.

torch's ``_weight_int4pack_mm_for_cpu`` (the fallback when _C is absent) reads weights as
``w = (q - 8) * s + z`` with ``(s, z)`` float pairs per (group, column). AWQ's ``w = (q - z) * s``
is the same line with ``z_float = (8 - z) * s``, so its repack keeps every nibble and only
rewrites the scales and zeros. On x86 only its bf16 instantiation is vectorised, so it computes
in bf16 whatever the activations' dtype (products accumulate in fp32, the output is rounded to
bf16 before it is cast back). ``FASTAWQ_CPU_FP32=exact`` makes it decline fp32 activations.

The inference-only modules built on these repacks (CPUInt4Linear, CPUInt8Linear, convert_model)
live in fastawq/modules/cpu_linear.py; the fake impls of the compiled CPU ops in fastawq/ops/gemm.py.
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fastawq import _ext, reference
from fastawq.backend import env_switch, tensor_version

log = logging.getLogger(__name__)

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAST_X = (torch.float32, torch.bfloat16)  # what awq_cpu_gemm takes as is
FASTAWQ = "fastawq"
TORCH_INT4 = "torch-int4"
PREFERENCE = (FASTAWQ, TORCH_INT4)
# fastawq's kernel walks K in steps of 8 rows (one packed word per column).
_FAST_STEP_K = 8
# torch's kernel finds group starts with a bit mask, so its group size must be a power of two;
# larger AWQ groups (and group_size=-1) are served by repeating (s, z) over sub-groups.
_KERNEL_GROUPS = (128, 64, 32)
# torch packs 64 (AVX-512) or 32 (AVX2) output columns per block, with 16-column tails.
_N_ALIGN = 16

_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
# id(qweight) -> (weakref, FastPacked, (scales, qzeros), versions): the per-call shortcut to a
# fastawq repack (a WeakIdKeyDictionary lookup alone costs microseconds).
_fast_ids: dict = {}


def kernel_available() -> str | None:
    """None if this torch has the packed int4 CPU kernel, else why not."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu (needs a torch >= 2.5 CPU build)"
    return None


_KERNEL_MISSING = kernel_available()


_UNKNOWN = object()
# Why fastawq's kernel is absent (None: present). Found on first use, which loads _C.
_FAST_MISSING: object = _UNKNOWN


def fast_kernel_available() -> str | None:
    """None if fastawq._C holds the CPU kernel, else why not."""
    global _FAST_MISSING
    if _FAST_MISSING is _UNKNOWN:
        if not _ext.is_loaded():
            _FAST_MISSING = f"fastawq._C is not loaded ({_ext.status()['reason']})"
        elif not hasattr(torch.ops.fastawq, "awq_cpu_gemm"):
            _FAST_MISSING = "fastawq._C has no CPU kernel (built before it existed): rebuild fastawq"
        else:
            _FAST_MISSING = None
    return _FAST_MISSING


def fast_kernel_isas() -> list[str]:
    """Instruction sets fastawq's CPU kernel runs here, best first (empty without _C)."""
    return list(torch.ops.fastawq.awq_cpu_isas()) if fast_kernel_available() is None else []


# Activation modes of fastawq's kernel (FASTAWQ_CPU_ACT, or the `act` argument of the CPU modules):
#   exact: x as given (fp32 or bf16), products exact, fp32 accumulation;
#   int8:  x quantized per 32 rows of K to int8 (one fp32 scale each) and multiplied by the
#          nibbles with integer dot products (AVX2 vpmaddubsw): half the instructions per weight,
#          at the cost of the activations' rounding (benchmarks/CPU_RESULTS.md);
#   auto:  int8 where the CPU has AVX2 but no AVX-512 (there the exact kernel is instruction-
#          bound and int8 is ~2x faster), else exact (the AVX-512 kernels already stream the
#          weights near memory speed, so int8 would cost accuracy for nothing).
# The default is auto: on AVX2-only CPUs the int8 rounding costs +0.2 % perplexity on SmolLM2
# (under the 0.5 % bar the 8-bit head meets) for twice the speed (benchmarks/CPU_RESULTS.md).
ACT_MODES = ("exact", "int8", "auto")
DEFAULT_ACT = "auto"
# (requested mode) -> isa: the CPU and _C do not change within a process, and act_isa sits on
# the per-call path of the public op.
_act_memo: dict[str, str] = {}


def act_isa(mode: str | None = None) -> str:
    """awq_cpu_gemm's `isa` argument for activation mode `mode` (default: FASTAWQ_CPU_ACT, else
    DEFAULT_ACT): "auto" (the exact kernel) or "int8"."""
    raw = mode or env_switch(b"FASTAWQ_CPU_ACT") or DEFAULT_ACT
    isa = _act_memo.get(raw)
    if isa is None:
        isa = _act_memo[raw] = _resolve_act(raw.strip().lower() or DEFAULT_ACT)
    return isa


def _resolve_act(mode: str) -> str:
    if mode not in ACT_MODES:
        raise ValueError(f"CPU activation mode {mode!r} (FASTAWQ_CPU_ACT?): expected one of {ACT_MODES}")
    isas = fast_kernel_isas()
    if mode == "auto":
        mode = "int8" if "avx2_int8" in isas and "avx512" not in isas else "exact"
    if mode == "int8" and "avx2_int8" not in isas:
        raise ValueError(f"CPU activation mode int8 needs fastawq's AVX2 kernel; this CPU / build runs {isas}")
    return "int8" if mode == "int8" else "auto"


def _fp32_exact() -> bool:
    return os.environ.get("FASTAWQ_CPU_FP32", "").lower() == "exact"


def preference() -> tuple[str, ...]:
    forced = os.environ.get("FASTAWQ_CPU_KERNEL", "").strip().lower()
    if not forced:
        return PREFERENCE
    if forced not in PREFERENCE:
        raise ValueError(f"FASTAWQ_CPU_KERNEL={forced!r}: expected one of {PREFERENCE}")
    return (forced,)


def kernel_group_size(group_size: int) -> int | None:
    """Largest group size torch's kernel takes that divides the AWQ group size (None if none)."""
    for kg in _KERNEL_GROUPS:
        if group_size % kg == 0:
            return kg
    return None


# x [M, K] · qweight [K, N // 8] int32  ->  None if a CPU kernel takes the call, else the reasons
def awq_gemm_fits(x2d: torch.Tensor, qweight: torch.Tensor, group_size: int) -> str | None:
    kernel, why = kernel_for(x2d.dtype, qweight, group_size, x_device=x2d.device)
    return None if kernel is not None else why


def kernel_for(x_dtype: torch.dtype, qweight: torch.Tensor, group_size: int, *,
               x_device: torch.device = torch.device("cpu")) -> tuple[str | None, str]:
    """(the kernel that serves these activations and this weight, "") or (None, why none does)."""
    reasons = []
    for name in preference():
        why = _x_fits(x_dtype, x_device) or weight_fits(name, qweight, group_size)
        if why is None and name == TORCH_INT4 and x_dtype == torch.float32 and _fp32_exact():
            why = "FASTAWQ_CPU_FP32=exact and torch's packed int4 CPU kernel computes in bf16"
        if why is None:
            return name, ""
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)


def _x_fits(x_dtype: torch.dtype, x_device: torch.device) -> str | None:
    if x_device.type != "cpu":
        return f"x is on {x_device}; the CPU kernels run on the CPU"
    if x_dtype not in _ACT_DTYPES:
        return f"x is {x_dtype}; the CPU kernels take fp32, bf16 or fp16 activations"
    return None


def weight_fits(kernel: str, qweight: torch.Tensor, group_size: int) -> str | None:
    k, n = qweight.shape[0], qweight.shape[1] * reference.PACK
    if qweight.device.type != "cpu":
        return f"qweight is on {qweight.device}; the CPU kernels run on the CPU"
    g = reference.resolve_group_size(group_size, k)
    if kernel == FASTAWQ:
        why = fast_kernel_available()
        if why is None and g % _FAST_STEP_K != 0:
            why = f"group_size={g} is not a multiple of {_FAST_STEP_K} (K={k}, N={n})"
        return why
    if _KERNEL_MISSING is not None:
        return _KERNEL_MISSING
    if kernel_group_size(g) is None:
        return f"group_size={g} is not a multiple of 32 (K={k}, N={n}); the kernel needs 32, 64 or 128"
    if n % _N_ALIGN != 0:
        return f"N={n} is not a multiple of {_N_ALIGN} (qweight {tuple(qweight.shape)})"
    return None


def weight_kernel(qweight: torch.Tensor, group_size: int) -> str | None:
    """The preferred kernel for this weight whatever the activations (None if none takes it)."""
    return next((name for name in preference() if weight_fits(name, qweight, group_size) is None), None)


@dataclass(frozen=True)
class FastPacked:
    """One AWQ weight in fastawq's CPU layout (csrc/cpu/awq_cpu_kernels.h).

    w [N/64, K/8, 64] int32 · scales [N/64, K/G, 64] fp32 · zeros16 [N/64, K/G, 64] uint8 (16 + z)
    """

    w: torch.Tensor
    scales: torch.Tensor
    zeros16: torch.Tensor
    group: int
    k: int
    n: int
    signature: tuple
    kernel: ClassVar[str] = FASTAWQ


@dataclass(frozen=True)
class PackedInt4:
    """One AWQ weight in torch's CPU int4 layout.

    weight [N, K // 2] uint8 (torch's blocked nibble order) · scale_zeros [K // kg, N, 2] bf16
    """

    weight: torch.Tensor
    scale_zeros: torch.Tensor
    kernel_group: int
    k: int
    n: int
    signature: tuple
    kernel: ClassVar[str] = TORCH_INT4


def _signature(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> tuple:
    return (
        g,
        scales.dtype,
        tuple(qweight.shape), tuple(scales.shape), tuple(qzeros.shape),
        qweight.stride(), scales.stride(), qzeros.stride(),
        tensor_version(qweight), tensor_version(scales), tensor_version(qzeros),
        qweight.data_ptr(), scales.data_ptr(), qzeros.data_ptr(),
    )


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  PackedInt4
def _repack_int4(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> PackedInt4:
    k, n = qweight.shape[0], qweight.shape[1] * reference.PACK
    kg = kernel_group_size(g)
    with torch.no_grad():
        q = reference.unpack_int4(qweight).t().contiguous()  # [N, K], the kernel's row order
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        rep = g // kg
        s = scales.to(torch.float32)
        z = reference.unpack_int4(qzeros).to(torch.float32)
        s_b = s.to(torch.bfloat16)
        # (q - z) * s == (q - 8) * s + (8 - z) * s. Forming z_float from the bf16 scale makes the
        # kernel's weight (q - z) * s_b plus one bf16 rounding of z_float: a relative error of the
        # weight itself, measured 1.7e-3 (Frobenius) against 1.7e-3 for rounding w to bf16.
        z_b = ((8.0 - z) * s_b.to(torch.float32)).to(torch.bfloat16)
        sz = torch.stack([s_b, z_b], dim=-1)
        if rep > 1:
            sz = sz.repeat_interleave(rep, dim=0)
        sz = sz.contiguous()
    return PackedInt4(weight, sz, kg, k, n, _signature(qweight, scales, qzeros, g))


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  FastPacked
def repack_fast(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> FastPacked:
    k, n = qweight.shape[0], qweight.shape[1] * reference.PACK
    with torch.no_grad():
        w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), g)
    return FastPacked(w, s, z, g, k, n, _signature(qweight, scales, qzeros, g))


def repack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int,
            kernel: str | None = None) -> FastPacked | PackedInt4:
    """The weight repacked for `kernel` (default: the preferred kernel that takes it)."""
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, g)
    kernel = kernel or weight_kernel(qweight, g)
    why = "no CPU kernel is available" if kernel is None else weight_fits(kernel, qweight, g)
    if why is not None:
        reasons = "; ".join(f"{name}: {weight_fits(name, qweight, g)}" for name in preference())
        raise ValueError(f"CPU int4 kernel cannot run qweight {tuple(qweight.shape)}: {reasons}")
    return (repack_fast if kernel == FASTAWQ else _repack_int4)(qweight, scales, qzeros, g)


def prepare(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int,
            kernel: str | None = None) -> FastPacked | PackedInt4:
    """The repacked weight for these tensors: built once, then served from the cache until any of
    qweight, scales or qzeros changes (in-place writes bump their version) or another kernel is
    asked for."""
    g = reference.resolve_group_size(group_size, qweight.shape[0])
    kernel = kernel or weight_kernel(qweight, g)
    sig = _signature(qweight, scales, qzeros, g)
    entry = _cache.get(qweight)
    if entry is not None and entry.signature == sig and entry.kernel == kernel:
        return entry
    if entry is not None:
        log.debug("CPU int4 repack invalidated for qweight %s", tuple(qweight.shape))
    entry = repack(qweight, scales, qzeros, g, kernel)
    _cache[qweight] = entry
    if entry.kernel == FASTAWQ:
        _remember_fast(qweight, scales, qzeros, entry)
    else:
        _fast_ids.pop(id(qweight), None)
    return entry


def clear_cache() -> None:
    """Drop every cached repack (they are also dropped when their qweight is freed)."""
    _cache.clear()
    _fast_ids.clear()


def cache_size() -> int:
    return len(_cache)


def _fast_hit(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
              group_size: int, bias: torch.Tensor | None) -> FastPacked | None:
    """The cached fastawq repack when it serves this call as is (None: take the checked path)."""
    hit = _fast_ids.get(id(qweight))
    if hit is None:
        return None
    ref, entry, tensors, versions = hit
    if (ref() is not qweight or x2d.dtype not in _FAST_X or x2d.dim() != 2 or x2d.shape[1] != entry.k
            or not x2d.is_cpu or group_size != entry.group
            or (bias is not None and bias.shape != (entry.n,)) or env_switch(b"FASTAWQ_CPU_KERNEL") is not None):
        return None
    # Same objects (so same inference-ness) and no in-place write since the repack; an inference
    # tensor keeps no counter (its slot holds None) and is keyed on identity alone.
    if tensors[0] is not scales or tensors[1] is not qzeros:
        return None
    for t, v in zip((qweight, scales, qzeros), versions):
        if v is not None and t._version != v:
            return None
    return entry


def _remember_fast(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, entry: FastPacked) -> None:
    key = id(qweight)
    versions = tuple(None if t.is_inference() else t._version for t in (qweight, scales, qzeros))
    # The callback fires when qweight dies, before its id can be reused.
    ref = weakref.ref(qweight, lambda _, key=key: _fast_ids.pop(key, None))
    _fast_ids[key] = (ref, entry, (scales, qzeros), versions)


# x [M, K] · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32 · bias [N]  ->  [M, N] (x's dtype)
def awq_gemm(
    x2d: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(qweight, scales, qzeros) + bias on the kernel `kernel_for` picks."""
    # A cache hit on fastawq's kernel skips the kernel choice (~5 us a call, ~200 calls a token).
    entry = _fast_hit(x2d, qweight, scales, qzeros, group_size, bias)
    if entry is not None:
        return torch.ops.fastawq.awq_cpu_gemm(x2d, entry.w, entry.scales, entry.zeros16, entry.group, entry.n, bias,
                                              act_isa())
    if x2d.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x2d.shape)}")
    kernel, why = kernel_for(x2d.dtype, qweight, group_size, x_device=x2d.device)
    if kernel is None:
        raise ValueError(f"CPU int4 kernel cannot run x {tuple(x2d.shape)} {x2d.dtype}: {why}")
    p = prepare(qweight, scales, qzeros, group_size, kernel)  # validates the weight when it (re)packs
    if x2d.shape[1] != p.k:
        raise ValueError(f"x {tuple(x2d.shape)} has K={x2d.shape[1]} but qweight {tuple(qweight.shape)} has K={p.k}")
    if bias is not None and tuple(bias.shape) != (p.n,):
        raise ValueError(f"bias {tuple(bias.shape)} must have shape ({p.n},) to match qweight {tuple(qweight.shape)}")
    return mm(x2d, p, bias)


# x [..., K] · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32 · bias [N]  ->  [..., N] or None
def cached_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """ops.awq_gemm's shortcut: the product when this weight's fastawq repack is cached and valid
    and the call needs nothing else (bias in x's dtype, M > 0); None otherwise."""
    if x.dim() < 1 or (bias is not None and bias.dtype != x.dtype):
        return None
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a reshape costs ~3 us
    if x2d.shape[0] == 0:
        return None
    entry = _fast_hit(x2d, qweight, scales, qzeros, group_size, bias)
    if entry is None:
        return None
    out = torch.ops.fastawq.awq_cpu_gemm(x2d, entry.w, entry.scales, entry.zeros16, entry.group, entry.n, bias,
                                         act_isa())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], entry.n)


# x [M, K] · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32 · bias [N]
def bind_gemm(x_dtype: torch.dtype, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
              group_size: int, bias: torch.Tensor | None):
    """x2d -> awq_gemm(x2d, ...) for activations of x_dtype, with the repack done now: the
    caller (a cached plan) re-binds when the tensors change, so a call is one kernel call."""
    kernel, why = kernel_for(x_dtype, qweight, group_size)
    if kernel is None:
        raise ValueError(f"CPU int4 kernel cannot run {x_dtype} activations: {why}")
    p = prepare(qweight, scales, qzeros, group_size, kernel)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if p.kernel == FASTAWQ and x_dtype in _FAST_X:
        gemm, w, s, z, g, n, isa = torch.ops.fastawq.awq_cpu_gemm, p.w, p.scales, p.zeros16, p.group, p.n, act_isa()
        return lambda x2d: gemm(x2d, w, s, z, g, n, b, isa)
    bias_x = None if bias is None else bias.detach().to(x_dtype)
    return lambda x2d: mm(x2d, p, bias_x)


def mm(x2d: torch.Tensor, p: FastPacked | PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
    if p.kernel == FASTAWQ:
        isa = act_isa()
        if x2d.dtype == torch.float16:  # no fp16 arithmetic on x86 CPUs: run it as fp32
            return torch.ops.fastawq.awq_cpu_gemm(x2d.float(), p.w, p.scales, p.zeros16, p.group, p.n, bias, isa).half()
        return torch.ops.fastawq.awq_cpu_gemm(x2d, p.w, p.scales, p.zeros16, p.group, p.n, bias, isa)
    return _int4_mm(x2d, p, bias)


def _int4_mm(x2d: torch.Tensor, p: PackedInt4, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2d.to(torch.bfloat16).contiguous(), p.weight, p.kernel_group, p.scale_zeros
    )
    if bias is None:
        return out if x2d.dtype == torch.bfloat16 else out.to(x2d.dtype)
    # Bias is added in fp32 so its only rounding is the final cast, as in the reference.
    return out.to(torch.float32).add_(bias.to(torch.float32)).to(x2d.dtype)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  w [K, N] (scales' dtype)
def awq_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Vectorised dequantisation, bit-identical to reference.dequantize (fp32 math, one cast)."""
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, group_size)
    q = reference.unpack_int4(qweight).view(k // g, g, n)
    z = reference.unpack_int4(qzeros).unsqueeze(1)  # [K // G, 1, N]
    s = scales.to(torch.float32).unsqueeze(1)
    w = (q - z).to(torch.float32).mul_(s)
    return w.view(k, n).to(scales.dtype)
