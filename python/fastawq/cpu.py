"""CPU backend for W4A16: torch's packed int4 CPU kernel behind a cached load-time repack.

torch's ``_weight_int4pack_mm_for_cpu`` reads weights as ``w = (q - 8) * s + z`` with ``q`` the
unsigned nibble and ``(s, z)`` float pairs per (group, column). AWQ's ``w = (q - z) * s`` is the
same line with ``z_float = (8 - z) * s``, so the repack keeps every nibble and only rewrites the
scales and zeros. The repack runs once per weight and is cached by the qweight tensor object.

Precision. On x86 only the bf16 instantiation of torch's kernel is vectorised (AVX2 / AVX-512);
its fp32 and fp16 instantiations are scalar loops, slower than a dense fp32 matmul. So every call
computes in bf16: activations and the (s, z) pairs are rounded to bf16, products accumulate in
fp32 and the output is rounded to bf16 before it is cast back to x's dtype. For bf16 activations
this is the precision of a bf16 linear; for fp32 and fp16 activations it is bf16-grade, not fp32
(IPEX's weight-only int4 makes the same trade by default). ``FASTAWQ_CPU_FP32=exact`` makes
``awq_gemm_fits`` decline fp32 activations, so dispatch runs them on the exact torch path.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from fastawq import reference

log = logging.getLogger(__name__)

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernel's K loop finds group starts with a bit mask, so its group size must be a power of
# two; larger AWQ groups (and group_size=-1) are served by repeating (s, z) over sub-groups.
_KERNEL_GROUPS = (128, 64, 32)
# torch packs 64 (AVX-512) or 32 (AVX2) output columns per block, with 16-column tails.
_N_ALIGN = 16

_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()


def kernel_available() -> str | None:
    """None if this torch has the packed int4 CPU kernel, else why not."""
    aten = torch.ops.aten
    if not (hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu (needs a torch >= 2.5 CPU build)"
    return None


_KERNEL_MISSING = kernel_available()


def _fp32_exact() -> bool:
    return os.environ.get("FASTAWQ_CPU_FP32", "").lower() == "exact"


def kernel_group_size(group_size: int) -> int | None:
    """Largest group size the kernel takes that divides the AWQ group size (None if none does)."""
    for kg in _KERNEL_GROUPS:
        if group_size % kg == 0:
            return kg
    return None


# x [M, K] · qweight [K, N // 8] int32  ->  None if the CPU kernel takes the call, else the reason
def awq_gemm_fits(x2d: torch.Tensor, qweight: torch.Tensor, group_size: int) -> str | None:
    if _KERNEL_MISSING is not None:
        return _KERNEL_MISSING
    why = _x_fits(x2d) or _weight_fits(qweight, group_size)
    if why is None and x2d.dtype == torch.float32 and _fp32_exact():
        return "FASTAWQ_CPU_FP32=exact and the packed int4 CPU kernel computes in bf16"
    return why


def _x_fits(x2d: torch.Tensor) -> str | None:
    if x2d.device.type != "cpu":
        return f"x is on {x2d.device}; the CPU kernel runs on the CPU"
    if x2d.dtype not in _ACT_DTYPES:
        return f"x is {x2d.dtype}; the CPU kernel takes fp32, bf16 or fp16 activations"
    return None


def _weight_fits(qweight: torch.Tensor, group_size: int) -> str | None:
    k, n = qweight.shape[0], qweight.shape[1] * reference.PACK
    if qweight.device.type != "cpu":
        return f"qweight is on {qweight.device}; the CPU kernel runs on the CPU"
    g = reference.resolve_group_size(group_size, k)
    if kernel_group_size(g) is None:
        return f"group_size={g} is not a multiple of 32 (K={k}, N={n}); the CPU kernel needs 32, 64 or 128"
    if n % _N_ALIGN != 0:
        return f"N={n} is not a multiple of {_N_ALIGN} (qweight {tuple(qweight.shape)})"
    return None


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


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _signature(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> tuple:
    return (
        g,
        scales.dtype,
        tuple(qweight.shape), tuple(scales.shape), tuple(qzeros.shape),
        qweight.stride(), scales.stride(), qzeros.stride(),
        _version(qweight), _version(scales), _version(qzeros),
        qweight.data_ptr(), scales.data_ptr(), qzeros.data_ptr(),
    )


def _nibble_shifts(device: torch.device) -> torch.Tensor:
    # Column c of each group of 8 sits in nibble AWQ_REVERSE_ORDER[c].
    return torch.tensor([4 * i for i in reference.AWQ_REVERSE_ORDER], dtype=torch.int32, device=device)


def _unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """[R, C // 8] int32 AWQ words -> [R, C] int32 nibbles in column order."""
    rows, words = packed.shape
    return ((packed.unsqueeze(-1) >> _nibble_shifts(packed.device)) & 0xF).reshape(rows, words * reference.PACK)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32  ->  PackedInt4
def _repack(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g: int) -> PackedInt4:
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, g)
    why = _weight_fits(qweight, g)
    if why is not None:
        raise ValueError(f"CPU int4 kernel cannot run qweight {tuple(qweight.shape)}: {why}")
    kg = kernel_group_size(g)
    with torch.no_grad():
        # Transposing the packed words (8x less data) before unpacking halves the repack time.
        words_t = qweight.t().contiguous()  # [N // 8, K]
        q = ((words_t.unsqueeze(1) >> _nibble_shifts(qweight.device).view(1, 8, 1)) & 0xF).reshape(n, k)
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        rep = g // kg
        s = scales.to(torch.float32)
        z = _unpack_cols(qzeros).to(torch.float32)
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


def prepare(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> PackedInt4:
    """The repacked weight for these tensors: built once, then served from the cache until any of
    qweight, scales or qzeros changes (in-place writes bump their version)."""
    if _KERNEL_MISSING is not None:
        raise RuntimeError(_KERNEL_MISSING)
    g = reference.resolve_group_size(group_size, qweight.shape[0])
    sig = _signature(qweight, scales, qzeros, g)
    entry = _cache.get(qweight)
    if entry is not None and entry.signature == sig:
        return entry
    if entry is not None:
        log.debug("CPU int4 repack invalidated for qweight %s", tuple(qweight.shape))
    entry = _repack(qweight, scales, qzeros, g)
    _cache[qweight] = entry
    return entry


def clear_cache() -> None:
    """Drop every cached repack (they are also dropped when their qweight is freed)."""
    _cache.clear()


def cache_size() -> int:
    return len(_cache)


# x [M, K] · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] int32 · bias [N]  ->  [M, N] (x's dtype)
def awq_gemm(
    x2d: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(qweight, scales, qzeros) + bias, computed in bf16 (see the module doc)."""
    if x2d.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got {tuple(x2d.shape)}")
    why = _x_fits(x2d)
    if why is not None:
        raise ValueError(f"CPU int4 kernel cannot run x {tuple(x2d.shape)} {x2d.dtype}: {why}")
    # Decode calls this ~200 times per token: a cache hit checks only what can differ per call.
    p = prepare(qweight, scales, qzeros, group_size)  # validates the weight when it (re)packs
    if x2d.shape[1] != p.k:
        raise ValueError(f"x {tuple(x2d.shape)} has K={x2d.shape[1]} but qweight {tuple(qweight.shape)} has K={p.k}")
    if bias is not None and tuple(bias.shape) != (p.n,):
        raise ValueError(f"bias {tuple(bias.shape)} must have shape ({p.n},) to match qweight {tuple(qweight.shape)}")
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
    q = _unpack_cols(qweight).view(k // g, g, n)
    z = _unpack_cols(qzeros).unsqueeze(1)  # [K // G, 1, N]
    s = scales.to(torch.float32).unsqueeze(1)
    w = (q - z).to(torch.float32).mul_(s)
    return w.view(k, n).to(scales.dtype)


class CPUInt4Linear(nn.Module):
    """Inference-only CPU linear holding just the repacked weight: one kernel call per forward.

    WQLinear's forward goes through ops.awq_gemm (validation, backend choice, cache lookup):
    about 30 us per call on this project's 2-core CPU, a quarter of SmolLM2-135M's decode step.
    This module skips all of it. It keeps no AWQ tensors (so no state_dict to save) and stays on
    the CPU; convert a loaded model with `convert_model`.
    """

    def __init__(self, packed: PackedInt4, bias: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.k, packed.n
        self.bias_fp32 = None if bias is None else bias.detach().to(torch.float32)

    @classmethod
    def from_wqlinear(cls, layer: nn.Module) -> "CPUInt4Linear":
        """From a WQLinear (any module with qweight, scales, qzeros, group_size and bias)."""
        if _KERNEL_MISSING is not None:
            raise RuntimeError(_KERNEL_MISSING)
        return cls(_repack(layer.qweight, layer.scales, layer.qzeros, layer.group_size), layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _int4_mm(x.reshape(-1, self.in_features), self.packed, self.bias_fp32)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_fp32 is not None}, kernel_group={self.packed.kernel_group}")


def convert_model(model: nn.Module) -> int:
    """Replace every CPU WQLinear that the kernel takes by a CPUInt4Linear; return how many.

    Layers the kernel declines (group size not a multiple of 32, N not a multiple of 16) stay
    WQLinear and keep working through dispatch."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Duck-typed on WQLinear's buffers: this backend sits below fastawq.modules.
            qweight = getattr(child, "qweight", None)
            if (
                isinstance(qweight, torch.Tensor) and hasattr(child, "qzeros") and hasattr(child, "group_size")
                and qweight.device.type == "cpu" and _weight_fits(qweight, child.group_size) is None
            ):
                setattr(parent, name, CPUInt4Linear.from_wqlinear(child))
                count += 1
    return count
