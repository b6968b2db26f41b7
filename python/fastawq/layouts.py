"""AutoAWQ's other checkpoint layouts ("version" gemv, gemv_fast, marlin), repacked exactly to GEMM.

Every layout stores the same numbers: 4-bit q in [0, 15], a zero point z and a scale s per
(group of G input channels, output channel), w = (q - z) * s. They differ only in where each
nibble sits, so a load converts each linear's tensors once and the rest of fastawq sees GEMM.

Per layout (K = in_features, N = out_features, G = group size; facts from AutoAWQ's
`awq/modules/linear/{gemv,gemv_fast,marlin}.py`):

  gemv       qweight [N, K // 8] int32, nibble i of word j = q[n, 8j + i] (no interleave)
             qzeros  [N, W] int32 packed the same way; scales [N, 8W] fp16; groups beyond K // G
             are zero padding, W = ceil(K/G / 8) rounded up to a multiple of 1 (G >= 128), 2 (64), 4 (32)
  gemv_fast  qweight [N // 4, K] int16: four output rows interleaved, a fixed shuffle inside each
             32 input channels, four nibbles per int16 (see _fast_shuffle)
             scales [8W, N] fp16 and qzeros [8W, N] fp16 holding the *scaled* zero -(s * z)
  marlin     symmetric only (z = 8, no qzeros tensor); qweight [K // 16, 2N] int32 holds 16x16
             tiles in the order of the Marlin kernel's tensor-core fragments; scales [K // G, N]
             permuted within each 64 (32 when G = K) consecutive values

Each layout has `to_gemm(tensors, group_size) -> (qweight, qzeros, scales)` and its exact inverse
`from_gemm(qweight, qzeros, scales, group_size) -> tensors` (tests build checkpoints with it).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fastawq import reference

log = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor]
_SHIFTS8 = tuple(range(0, 32, 4))


class LayoutError(ValueError):
    pass


# --------------------------------------------------------------- shared helpers
# x [R, C] ints in [0, 15]  ->  [R, C // 8] int32, nibble i of word j = x[:, 8j + i]
def _pack_plain(x: torch.Tensor) -> torch.Tensor:
    r, c = x.shape
    shifts = torch.tensor(_SHIFTS8, dtype=torch.int64, device=x.device)
    word = (x.to(torch.int64).reshape(r, c // 8, 8) << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# [R, W] int32  ->  [R, 8W] int32 in [0, 15]
def _unpack_plain(p: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor(_SHIFTS8, dtype=torch.int32, device=p.device)
    return ((p.unsqueeze(-1) >> shifts) & 0xF).reshape(p.shape[0], -1)


def padded_groups(k: int, group_size: int) -> int:
    """Rows of scales / zeros that the gemv layouts allocate: K // G padded to a multiple of 8
    (and of 16 / 32 for G = 64 / 32: their kernels read zeros in wider vectors)."""
    g = reference.resolve_group_size(group_size, k)
    if g >= 128:
        mult = 1
    elif g in (64, 32):
        mult = 128 // g
    else:
        raise LayoutError(f"the gemv layouts support group sizes 32, 64 and >= 128, got {g}")
    width = -(-(k // g) // 8)
    return -(-width // mult) * mult * 8


def _unpack_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    k, n, g = reference.check_awq_shapes(qweight, scales, qzeros, group_size)
    return reference.unpack_int4(qweight), reference.unpack_int4(qzeros), scales, k, n, g


def _pack_gemm(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.pack_int4(q), reference.pack_int4(z), s.contiguous()


def _need(tensors: Tensors, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise LayoutError(f"missing tensor(s) {missing}; got {sorted(tensors)}")
    return [tensors[n] for n in names]


def _groups_of(k: int, group_size: int, what: str) -> tuple[int, int]:
    g = reference.resolve_group_size(group_size, k)
    if k % g:
        raise LayoutError(f"{what}: in_features K={k} is not divisible by group_size={g}")
    return g, k // g


# --------------------------------------------------------------- gemv
# gemv: qweight [N, K // 8] int32 · qzeros [N, W] int32 · scales [N, 8W]  ->  GEMM
def gemv_to_gemm(tensors: Tensors, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, qzeros, scales = _need(tensors, "qweight", "qzeros", "scales")
    n, k = qweight.shape[0], qweight.shape[1] * 8
    g, groups = _groups_of(k, group_size, f"gemv qweight {tuple(qweight.shape)}")
    if qzeros.shape[0] != n or qzeros.shape[1] * 8 < groups or scales.shape[0] != n or scales.shape[1] < groups:
        raise LayoutError(
            f"gemv shapes do not fit K={k}, N={n}, group_size={g}: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    q = _unpack_plain(qweight).t()
    z = _unpack_plain(qzeros)[:, :groups].t()
    s = scales[:, :groups].t()
    return _pack_gemm(q, z, s)


def gemv_from_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    q, z, s, k, n, g = _unpack_gemm(qweight, qzeros, scales, group_size)
    width = padded_groups(k, g)
    zp = torch.zeros(n, width, dtype=torch.int32, device=z.device)
    zp[:, : k // g] = z.t()
    sp = torch.zeros(n, width, dtype=s.dtype, device=s.device)
    sp[:, : k // g] = s.t()
    return {"qweight": _pack_plain(q.t()), "qzeros": _pack_plain(zp), "scales": sp}


# --------------------------------------------------------------- gemv_fast
def _fast_shuffle(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] -> [N // 4, K // 64, 64, 4]: nibble u of int16 t in each 64-wide chunk.

    Inside each 32 input channels, channel 8a + 2b + c moves to 8b + 4c + a (the kernel turns
    a word into fp16 pairs with one shift); then each 4 output rows x 64 channels block is laid
    out row after row and cut into int16s of 4 consecutive nibbles."""
    n, k = q.shape
    x = q.reshape(n, k // 32, 4, 4, 2).permute(0, 1, 3, 4, 2)  # (a, b, c) -> (b, c, a)
    x = x.reshape(n // 4, 4, k // 64, 64).permute(0, 2, 1, 3)
    return x.reshape(n // 4, k // 64, 64, 4)


def _fast_unshuffle(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    x = x.reshape(n // 4, k // 64, 4, 64).permute(0, 2, 1, 3).reshape(n, k // 32, 4, 2, 4)
    return x.permute(0, 1, 4, 2, 3).reshape(n, k)  # (b, c, a) -> (a, b, c)


# gemv_fast: qweight [N // 4, K] int16 · scales [8W, N] · qzeros [8W, N] (= -s * z)  ->  GEMM
def gemv_fast_to_gemm(tensors: Tensors, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, qzeros, scales = _need(tensors, "qweight", "qzeros", "scales")
    if qweight.dtype != torch.int16:
        raise LayoutError(f"gemv_fast qweight must be int16, got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0] * 4, qweight.shape[1]
    g, groups = _groups_of(k, group_size, f"gemv_fast qweight {tuple(qweight.shape)}")
    if k % 64 or tuple(scales.shape[1:]) != (n,) or scales.shape[0] < groups or qzeros.shape != scales.shape:
        raise LayoutError(
            f"gemv_fast shapes do not fit K={k} (a multiple of 64), N={n}, group_size={g}: qweight "
            f"{tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    words = qweight.to(torch.int32) & 0xFFFF
    shifts = torch.tensor((0, 4, 8, 12), dtype=torch.int32, device=qweight.device)
    nib = (words.reshape(n // 4, k // 64, 64, 1) >> shifts) & 0xF
    q = _fast_unshuffle(nib, n, k).t()
    s = scales[:groups]
    scaled_zero = qzeros[:groups].float()
    sf = s.float()
    # The layout keeps -(s * z) rounded to fp16; z <= 15 makes the rounding error far below 1/2.
    z = torch.where(sf != 0, torch.round(-scaled_zero / torch.where(sf != 0, sf, 1.0)), 0.0)
    if z.numel() and (z.min() < 0 or z.max() > 15):
        raise LayoutError(f"gemv_fast qzeros {tuple(qzeros.shape)} are not -scale * z for an integer z in [0, 15]")
    z = z.to(torch.int32)
    redo = -(sf * z).to(qzeros.dtype)
    bad = int((redo != qzeros[:groups]).sum())
    if bad:
        log.warning("gemv_fast: %d scaled zero(s) are not -scale * integer; rounded to the nearest zero point", bad)
    return _pack_gemm(q, z, s)


def gemv_fast_from_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    q, z, s, k, n, g = _unpack_gemm(qweight, qzeros, scales, group_size)
    if k % 64 or n % 4:
        raise LayoutError(f"gemv_fast needs K % 64 == 0 and N % 4 == 0, got K={k}, N={n}")
    x = _fast_shuffle(q.t()).to(torch.int32)
    word = x[..., 0] | (x[..., 1] << 4) | (x[..., 2] << 8) | (x[..., 3] << 12)
    packed = torch.where(word >= 2**15, word - 2**16, word).to(torch.int16).reshape(n // 4, k)
    rows = padded_groups(k, g)
    sp = torch.zeros(rows, n, dtype=s.dtype, device=s.device)
    sp[: k // g] = s
    zp = torch.zeros(rows, n, dtype=s.dtype, device=s.device)
    zp[: k // g] = -(s.float() * z).to(s.dtype)
    return {"qweight": packed, "qzeros": zp, "scales": sp}


# --------------------------------------------------------------- marlin
@functools.lru_cache(maxsize=None)
def _marlin_perms() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight permutation within 1024 values (four 16x16 tiles) and the two scale ones."""
    base = []
    for i in range(32):  # one entry per thread of a warp: its mma fragment
        col = i // 4
        rows = (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        base += [16 * r + col + 8 * block for block in (0, 1) for r in rows]
    perm = torch.tensor(base).reshape(32, 8)
    # each thread also takes the same fragment of the next three tiles of its 64-wide strip
    perm = torch.cat([perm + 256 * j for j in range(4)], dim=1).reshape(-1)
    # each 8 values packed as (0, 2, 4, 6, 1, 3, 5, 7) so one shift yields fp16 pairs
    perm = perm.reshape(-1, 8)[:, list(reference.AWQ_ORDER)].reshape(-1)
    scale_perm = torch.arange(64).reshape(8, 8).t().reshape(-1)
    scale_single = torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    return perm, scale_perm, scale_single


def _marlin_scale_perm(groups: int) -> torch.Tensor:
    _, grouped, single = _marlin_perms()
    return single if groups == 1 else grouped


def marlin_to_gemm(tensors: Tensors, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, scales = _need(tensors, "qweight", "scales")
    k, n = qweight.shape[0] * 16, qweight.shape[1] // 2
    if qweight.dtype != torch.int32 or qweight.shape[1] % 2 or n % 64 or scales.dim() != 2 or scales.shape[1] != n \
            or scales.shape[0] == 0 or k % scales.shape[0]:
        raise LayoutError(
            f"marlin shapes do not fit: qweight {tuple(qweight.shape)} {qweight.dtype} (K // 16, 2N) with N % 64 == 0, "
            f"scales {tuple(scales.shape)} (K // G, N)"
        )
    groups = scales.shape[0]
    g = k // groups
    expected = reference.resolve_group_size(group_size, k)
    if g != expected:
        raise LayoutError(f"marlin scales {tuple(scales.shape)} give group size {g}, the config says {expected}")
    perm = _marlin_perms()[0].to(qweight.device)
    res = _unpack_plain(qweight)  # [K // 16, 16N], permuted within 1024
    out = torch.empty_like(res)
    out.view(-1, 1024)[:, perm] = res.reshape(-1, 1024)
    q = out.reshape(k // 16, n // 16, 16, 16).permute(0, 2, 1, 3).reshape(k, n)
    sp = _marlin_scale_perm(groups).to(scales.device)
    s = torch.empty_like(scales)
    s.view(-1, sp.numel())[:, sp] = scales.reshape(-1, sp.numel())
    z = torch.full((groups, n), 8, dtype=torch.int32, device=qweight.device)
    return _pack_gemm(q, z, s)


def marlin_from_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    q, z, s, k, n, g = _unpack_gemm(qweight, qzeros, scales, group_size)
    if k % 16 or n % 64:
        raise LayoutError(f"marlin needs K % 16 == 0 and N % 64 == 0, got K={k}, N={n}")
    if bool((z != 8).any()):
        raise LayoutError("marlin stores no zero points: only symmetric weights (every zero = 8) fit it")
    x = q.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, n * 16)
    x = x.reshape(-1, 1024)[:, _marlin_perms()[0].to(x.device)].reshape(k // 16, n * 16)
    sp = _marlin_scale_perm(k // g).to(s.device)
    return {"qweight": _pack_plain(x), "scales": s.reshape(-1, sp.numel())[:, sp].reshape(k // g, n).contiguous()}


# --------------------------------------------------------------- registry and checkpoint hook
@dataclass(frozen=True)
class Layout:
    name: str
    to_gemm: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    from_gemm: Callable[..., dict]
    names: tuple[str, ...]  # the tensors of one linear in this layout (besides bias)


LAYOUTS = {
    "gemv": Layout("gemv", gemv_to_gemm, gemv_from_gemm, ("qweight", "qzeros", "scales")),
    "gemv_fast": Layout("gemv_fast", gemv_fast_to_gemm, gemv_fast_from_gemm, ("qweight", "qzeros", "scales")),
    "marlin": Layout("marlin", marlin_to_gemm, marlin_from_gemm, ("qweight", "scales")),
}


def version_of(quant_config: Mapping[str, Any]) -> str:
    """The layout a `quantization_config` names (AutoAWQ writes "version", transformers 5 "format")."""
    v = quant_config.get("version") or quant_config.get("format") or "gemm"
    return str(getattr(v, "value", v)).lower()


def get_layout(version: str) -> Layout:
    v = version.lower()
    if v not in LAYOUTS:
        raise LayoutError(f"unknown AWQ layout version={version!r}; fastawq reads gemm, {', '.join(LAYOUTS)}")
    return LAYOUTS[v]


class _Slice:
    _NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32",
              torch.int16: "I16"}

    def __init__(self, t: torch.Tensor):
        self._t = t

    def get_shape(self) -> list[int]:
        return list(self._t.shape)

    def get_dtype(self) -> str:
        return self._NAMES.get(self._t.dtype, str(self._t.dtype))


class MemoryHandle:
    """Stands in for a safetensors handle for tensors made at load (the repacked ones)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.tensors[name])


def convert_to_gemm(
    tensors: dict[str, tuple[Path, Any]], quant_config: Mapping[str, Any]
) -> dict[str, tuple[Path, Any]]:
    """Repack every linear of a checkpoint to GEMM.

    `tensors` maps name -> (file, safetensors handle) as checkpoint.read_tensors returns it; the
    result maps the repacked names to an in-memory handle and leaves every other tensor as it was."""
    version = version_of(quant_config)
    if version == "gemm":
        return tensors
    layout = get_layout(version)
    group_size = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
    if int(quant_config.get("bits", quant_config.get("w_bit", 4))) != 4:
        raise LayoutError(f"the {version} layout is 4-bit only, config says bits={quant_config.get('bits')}")
    mem = MemoryHandle()
    out = dict(tensors)
    prefixes = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
    for prefix in prefixes:
        f = tensors[f"{prefix}.qweight"][0]
        parts = {}
        for name in layout.names:
            key = f"{prefix}.{name}"
            if key not in tensors:
                raise LayoutError(f"{f}: {prefix}.qweight has no {key} ({version} layout)")
            kf, h = tensors[key]
            try:
                parts[name] = h.get_tensor(key)
            except Exception as e:
                raise LayoutError(f"cannot read tensor {key!r} from {kf} (truncated?): {e}") from None
        try:
            qweight, qzeros, scales = layout.to_gemm(parts, group_size)
        except LayoutError as e:
            raise LayoutError(f"{f}: layer {prefix!r} ({version} layout): {e}") from None
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            mem.tensors[f"{prefix}.{name}"] = t
            out[f"{prefix}.{name}"] = (f, mem)
    log.info("repacked %d %s layer(s) to gemm", len(prefixes), version)
    return out
