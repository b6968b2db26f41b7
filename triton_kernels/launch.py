"""Launchers for the Triton W4 kernels (AWQ and packed layouts): configuration choice, tuning
cache, split-K workspace."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton

from .awq import awq_dequantize_kernel, awq_gemm_kernel, awq_gemv_kernel, packed_dequantize_kernel
from .workspace import WORKSPACE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    gemv: bool = False  # the tensor-core-free kernel for M = 1 (block_m unused)
    defer: bool = False  # GEMV: reduce over K once at the end instead of per tile

    def label(self) -> str:
        kind = ("gemvd" if self.defer else "gemv") if self.gemv else f"m{self.block_m}"
        return f"{kind}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"


@dataclass(frozen=True)
class W4:
    """One W4 weight in either layout: AWQ (qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8])
    or packed (wpacked [K/8, N] as w, szpacked [K/G, 2N] as s, z None; fastawq/ops/repack.py)."""

    w: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor | None
    n: int

    @property
    def packed(self) -> bool:
        return self.z is None

    def rows(self, a: int, b: int, g: int) -> "W4":
        """Rows a..b of K (multiples of G)."""
        if self.packed:
            return W4(self.w[a // 8:b // 8], self.s[a // g:b // g], None, self.n)
        return W4(self.w[a:b], self.s[a // g:b // g], self.z[a // g:b // g], self.n)

    def dequantize(self, g: int, dtype) -> torch.Tensor:
        if self.packed:
            return packed_dequantize(self.w, self.s, self.n, g, dtype=dtype)
        return awq_dequantize(self.w, self.s, self.z, g, dtype=dtype)


DEQUANT_MATMUL = "dequant+matmul"  # a "config" too: dequantize once, then cuBLAS
# The same, in K chunks on two streams: chunk j+1 is dequantized (memory-bound) while chunk j's
# matmul (compute-bound at large M) runs, so the dequantize hides under cuBLAS.
DEQUANT_MATMUL_PIPELINED = "dequant+matmul, pipelined"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _m_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _block_ks(g: int, k: int) -> list[int]:
    return [bk for bk in (128, 64, 32) if g % bk == 0 and k % bk == 0]


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_for(tiles: int, k_tiles: int, target: int, most: int = 64) -> int:
    """Largest power-of-two K split keeping programs <= target and each split >= one K tile."""
    split = 1
    while tiles * split * 2 <= target and split * 2 <= k_tiles and split < most:
        split *= 2
    return split


def _splits(tiles: int, k_tiles: int, sms: int) -> list[int]:
    """Split-K values worth timing: from about one wave of programs to eight."""
    return sorted({_split_for(tiles, k_tiles, w * sms) for w in (1, 2, 4, 8)})


def heuristic_config(m: int, n: int, k: int, g: int, sms: int, packed: bool = False) -> GemmConfig:
    """A reasonable config without measuring (interpreter, CUDA-graph capture, tuning off)."""
    bk = _block_ks(g, k)[0]
    if m == 1 and not packed:  # the GEMV kernel reads the AWQ layout only
        bk = min(bk, 64)
        tiles = triton.cdiv(n, 256)
        return GemmConfig(1, 256, bk, _split_for(tiles, k // bk, 2 * sms), 8, 3, gemv=True)
    if m <= 16:
        bm, bn, warps, stages = 16, 128, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 32 if m <= 32 else 64, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, min(bk, 64), 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = _split_for(tiles, k // bk, 2 * sms) if m <= 128 else 1
    return GemmConfig(bm, bn, bk, split, warps, stages)


def candidate_configs(m: int, n: int, k: int, g: int, sms: int, packed: bool = False) -> list:
    bks = _block_ks(g, k)
    out: list = []
    if m == 1 and not packed:
        # (words per program, K rows per tile, warps): at most 64 nibbles per thread in flight.
        # Split-K is a run-time argument, so the splits cost timing, not compilation.
        for bw, bk, warps in ((16, 64, 4), (32, 64, 8), (32, 32, 4), (64, 32, 8), (16, 128, 8)):
            if g % bk or k % bk:
                continue
            for split in _splits(triton.cdiv(n, bw * 8), k // bk, sms):
                for stages in (2, 4):
                    out.append(GemmConfig(1, bw * 8, bk, split, warps, stages, gemv=True))
        # Deferred reduction: 32 fp32 partials per thread.
        for bw, bk, warps in ((32, 16, 4), (16, 32, 4), (64, 16, 8), (32, 32, 8)):
            if g % bk or k % bk:
                continue
            for split in _splits(triton.cdiv(n, bw * 8), k // bk, sms):
                out.append(GemmConfig(1, bw * 8, bk, split, warps, 3, gemv=True, defer=True))
    if m <= 64:
        bms = [16] if m <= 16 else [32, 64] if m <= 32 else [64]
        for bm in bms:
            for bn in (64, 128, 256):
                for bk in bks[:2]:
                    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                    for split in _splits(tiles, k // bk, sms):
                        out.append(GemmConfig(bm, bn, bk, split, 4, 4))
    else:
        bk = min(bks[0], 64)
        for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 8)):
            for stages in (3, 4):
                out.append(GemmConfig(bm, bn, bk, 1, warps, stages))
        if m <= 256:
            out.append(GemmConfig(64, 128, bk, 2, 4, 4))
        out.append(DEQUANT_MATMUL)
        out.append(DEQUANT_MATMUL_PIPELINED)
    return out


# Shared with the attention kernels: one owner of graph-safe scratch (workspace.py).
_WORKSPACE = WORKSPACE
_TUNED: dict[tuple, object] = {}


def launch_gemm(x, wts: W4, g, bias, out, cfg: GemmConfig) -> torch.Tensor:
    m, k = x.shape
    n = out.shape[1]
    grid_mn = triton.cdiv(n, cfg.block_n) * (1 if cfg.gemv else triton.cdiv(m, cfg.block_m))
    if cfg.split_k > 1:
        # fp32 partials per split; per-tile arrival counters that the kernel re-arms.
        ws = _WORKSPACE.get(
            x.device, "gemm_partials", cfg.split_k * m * n, torch.float32, zeroed=False, minimum=1 << 20
        )
        locks = _WORKSPACE.get(x.device, "gemm_counters", grid_mn, torch.int32, zeroed=True, minimum=4096)
    else:
        ws, locks = out, out  # unused
    if cfg.gemv:
        assert m == 1 and not wts.packed, "the GEMV kernel takes one row in the AWQ layout"
        awq_gemv_kernel[(grid_mn, cfg.split_k)](
            x, wts.w, wts.s, wts.z, bias if bias is not None else out, out, ws, locks,
            n, k, g, cfg.split_k,
            HAS_BIAS=bias is not None,
            SPLIT=cfg.split_k > 1,
            BLOCK_W=cfg.block_n // 8,
            BLOCK_K=cfg.block_k,
            DEFER=cfg.defer,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return out
    awq_gemm_kernel[(grid_mn, cfg.split_k)](
        x, wts.w, wts.s, wts.w if wts.packed else wts.z, bias if bias is not None else out, out, ws, locks,
        m, n, k, g, cfg.split_k,
        x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT=cfg.split_k > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        INTERPRET=_interpreting(),
        PACKED=wts.packed,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def dequant_matmul_pipelined(x, wts: W4, g, bias, out, chunks: int = 4):
    k = x.shape[1]
    groups = k // g
    step = triton.cdiv(groups, chunks) * g
    bounds = [(a, min(a + step, k)) for a in range(0, k, step)]
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        side = None
    else:
        side = _SIDE_STREAMS.setdefault(x.device, torch.cuda.Stream(x.device))
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
    for j, (a, b) in enumerate(bounds):
        if side is None:
            w = wts.rows(a, b, g).dequantize(g, x.dtype)
        else:
            with torch.cuda.stream(side):
                w = wts.rows(a, b, g).dequantize(g, x.dtype)
            main.wait_stream(side)
            w.record_stream(main)  # freed only after the main stream's matmul has used it
        if j == 0:
            if bias is None:
                torch.mm(x[:, a:b], w, out=out)
            else:
                torch.addmm(bias, x[:, a:b], w, out=out)
        else:
            out.addmm_(x[:, a:b], w)
    return out


def _run(cfg, x, wts: W4, g, bias, out):
    if cfg == DEQUANT_MATMUL:
        w = wts.dequantize(g, x.dtype)
        if bias is None:
            return torch.matmul(x, w, out=out)
        return torch.addmm(bias, x, w, out=out)
    if cfg == DEQUANT_MATMUL_PIPELINED:
        return dequant_matmul_pipelined(x, wts, g, bias, out)
    return launch_gemm(x, wts, g, bias, out, cfg)


def _tune(key, x, wts: W4, g, bias, out, candidates):
    best, best_ms = None, float("inf")
    for cfg in candidates:
        try:
            ms = triton.testing.do_bench(
                lambda: _run(cfg, x, wts, g, bias, out), warmup=2, rep=10,
                return_mode="median",
            )
        except Exception as e:  # a config the compiler rejects on this GPU (e.g. shared memory)
            logger.debug("config %s failed: %s", cfg, e)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    logger.info("%s %s -> %s (%.1f us)", "packed_gemm" if wts.packed else "awq_gemm", key,
                getattr(best, "label", lambda: best)(), best_ms * 1e3)
    # The candidates' largest split-K partials (64 x M x N fp32 for M = 64, N = 4096: 64 MiB) need
    # not outlive the timing: the next call allocates what the chosen configs use.
    _WORKSPACE.release(x.device, "gemm_partials")
    return best


def choose_config(x, wts: W4, g, bias, out):
    m, k = x.shape
    n = out.shape[1]
    if _interpreting() or x.device.type != "cuda":
        return heuristic_config(m, n, k, g, sms=4, packed=wts.packed)
    sms = _sm_count(x.device)
    key = (x.device, _m_bucket(m), n, k, g, x.dtype, bias is not None, wts.packed)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if os.environ.get("FASTAWQ_TRITON_TUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        return heuristic_config(m, n, k, g, sms, wts.packed)
    cfg = _tune(key, x, wts, g, bias, out, candidate_configs(m, n, k, g, sms, wts.packed))
    _TUNED[key] = cfg or heuristic_config(m, n, k, g, sms, wts.packed)
    return _TUNED[key]


# x [M, K] fp16/bf16 · qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8] · bias [N]  ->  [M, N]
def awq_gemm(x, qweight, scales, qzeros, group_size: int, bias=None, *, config=None) -> torch.Tensor:
    # The kernels index the weights as dense arrays (no-ops when they already are).
    wts = W4(qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), qweight.shape[1] * 8)
    return _gemm(x, wts, group_size, bias, config)


# x [M, K] fp16/bf16 · wpacked [K // 8, N] int32 · szpacked [K // G, 2N] · bias [N]  ->  [M, N]
def packed_gemm(x, wpacked, szpacked, n: int, group_size: int, bias=None, *, config=None) -> torch.Tensor:
    return _gemm(x, W4(wpacked.contiguous(), szpacked.contiguous(), None, n), group_size, bias, config)


def _gemm(x, wts: W4, group_size: int, bias, config) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    m = x.shape[0]
    out = torch.empty((m, wts.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(x, wts, group_size, bias, out)
    return _run(cfg, x, wts, group_size, bias, out)


def awq_gemm_fits(x, qweight, group_size: int) -> str | None:
    k = x.shape[1]
    if not _block_ks(group_size, k):
        return f"group_size={group_size} and K={k} must be multiples of 32 for the Triton GEMM"
    return None


def packed_gemm_fits(x, wpacked, group_size: int) -> str | None:
    return awq_gemm_fits(x, wpacked, group_size)


# qweight [K, N // 8] int32 · scales [K // G, N] · qzeros [K // G, N // 8]  ->  [K, N] (dtype, default scales')
def awq_dequantize(qweight, scales, qzeros, group_size: int, *, dtype=None) -> torch.Tensor:
    qweight, scales, qzeros = qweight.contiguous(), scales.contiguous(), qzeros.contiguous()
    k, n8 = qweight.shape
    n = n8 * 8
    out = torch.empty((k, n), dtype=dtype or scales.dtype, device=qweight.device)
    block_k, block_n = (32, 128) if _interpreting() else (16, 256)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    awq_dequantize_kernel[grid](
        qweight, scales, qzeros, out, k, n, group_size,
        BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4,
    )
    return out


# wpacked [K // 8, N] int32 · szpacked [K // G, 2N]  ->  [K, N] (dtype, default szpacked's)
def packed_dequantize(wpacked, szpacked, n: int, group_size: int, *, dtype=None) -> torch.Tensor:
    wpacked, szpacked = wpacked.contiguous(), szpacked.contiguous()
    k = wpacked.shape[0] * 8
    out = torch.empty((k, n), dtype=dtype or szpacked.dtype, device=wpacked.device)
    # A tile lies in one group: G is a multiple of 8 (of the packed layout), often of 32.
    block_k, block_n = (32 if group_size % 32 == 0 else 8), (128 if _interpreting() else 256)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    packed_dequantize_kernel[grid](wpacked, szpacked, out, k, n, group_size, BLOCK_K=block_k, BLOCK_N=block_n,
                                   num_warps=4)
    return out
