"""Which backend serves an op: compiled CUDA > Triton (GPU) > CPU kernels > torch reference.

This module is the only place that chooses, for every op in ``fastawq.ops`` (the W4 GEMM,
dequantize, add+RMSNorm, act*mul, rope + KV-cache write, decode attention). One vocabulary
everywhere: ``cuda`` (the compiled kernels of fastawq._C), ``triton`` (triton_kernels/, on GPUs,
or on CPU under TRITON_INTERPRET=1), ``cpu`` (the CPU kernels of fastawq/cpu.py) and ``torch``
(reference.py). The user forces one with ``backend=`` on an op (or on ``fuse_model`` / a
``WQLinear``) or the ``FASTAWQ_BACKEND`` environment variable.

A forced backend that cannot serve the call is an error that says why, never a silent fallback.
A forced backend names a family of kernels, so two cases are documented, not silent: a forced
``cpu`` for an op that has no CPU kernel (norm, act*mul, rope, attention) runs the torch
reference on the CPU (the CPU backend's contract is "run on the CPU"), and a forced ``cuda``
for an op that has no compiled kernel (norm, act*mul, rope) runs its Triton kernel on the GPU.

Unforced, the order on CUDA devices is compiled > Triton > torch (by size bucket where
measurement says otherwise, see _CUDA_PREFERENCE); on the CPU it is the CPU kernels where the op
has one, then torch (the Triton interpreter is a test vehicle, never chosen automatically).
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from fastawq import _ext

BACKENDS = ("cuda", "triton", "cpu", "torch")

# Ops each backend implements, by module: the module must define a function of the op's name.
_TRITON_MODULE = "fastawq.triton_kernels"
_CPU_MODULE = "fastawq.cpu"


# Per-op order on CUDA devices where measurement overrules "compiled first", by problem size:
# a list of (largest M, order), the first entry whose bound is >= M applies (None: any M).
# awq_gemm (benchmarks/RESULTS.md, H200): above M=2 the Triton kernels beat the compiled ones at
# every M measured; at M <= CUDA_GEMV_MAX_M the compiled GEMV kernels win. This is the only
# owner of that threshold: the compiled op no longer chooses GEMV by M, Python names the kernel.
CUDA_GEMV_MAX_M = 2
# The compiled awq_gemm kernel bound for each small-M bucket (measured winners, RESULTS.md):
# the plain GEMV at M=1, the staged one (activations staged in shared memory) at M=2; above
# that "auto" (the tensor-core kernel when it fits, else dequantize + cuBLAS).
CUDA_GEMM_KERNEL_BY_M = {1: "gemv", 2: "gemv_staged"}
# packed_gemm (the packed layout of ops/repack.py) has three compiled kernels: awq_gemv_packed (CUDA
# cores, M <= 8) up to PACKED_GEMV_MAX_M rows, awq_mma_packed (tensor cores, the batch as the mma's
# N, M <= 32) up to PACKED_MMA_MAX_M, awq_gemm_packed (tensor cores, the batch as the mma's M, any M)
# up to PACKED_GEMM_MAX_M, the Triton GEMM on the packed layout above. H200, benchmarks/RESULTS.md,
# geomean x cuBLAS fp16 / bf16: since the GEMV sums in half2 (session 11) it leads at M = 1 (2.18 /
# 2.05 against the tensor-core kernel's 1.76) and M = 2 (1.72 / 1.65 against 1.65 / 1.61); from
# M = 4 the tensor-core kernel (its register ring) leads: 1.61 vs 1.20 at M = 4, 1.43 vs 0.55 at
# M = 8 (session 10); at M = 16 it (1.03) edges the AWQ layout's Triton kernels (0.87-0.98,
# session 5), above 16 it does not win (M = 32: 0.77 vs 0.77).
PACKED_GEMV_MAX_M = 2
PACKED_MMA_MAX_M = 8
# awq_gemm_packed for M = 9 .. 16 (a bound not above PACKED_MMA_MAX_M leaves it out). H200,
# RESULTS.md session 13, geomean x cuBLAS fp16 / bf16 with its best tile: M = 16 1.06 / 1.04
# (awq_mma_packed 1.02 / 1.01), M = 32 0.81 (awq_mma_packed 0.88), M = 64 0.53 (the AWQ layout's
# Triton GEMM 0.72): its register ring keeps about one step of loads in flight (CUDA_NOTES.md).
# Session 18, decode at batch 16 against awq_mma_packed there: Llama-3-8B shape 3,808 -> 4,041
# tokens/s, Qwen3-30B-A3B 2,351 -> 2,435 (bench_ab.py --compare gemm16).
PACKED_GEMM_MAX_M = 16
# awq_wgmma_packed (Hopper's warpgroup MMA, sm_90a builds on sm_90 devices) for M above the compiled
# buckets up to PACKED_WGMMA_MAX_M (None: every M), in place of the Triton GEMM, and the fused
# engine's packed layout up to that batch. H100 (the H200 was not lent), RESULTS.md session 21,
# geomean x cuBLAS fp16 / bf16 against the automatic choice on the AWQ layout (Triton, tuned), same
# run: M = 32 1.13 / 1.13 against 1.01 / 0.99, M = 64 0.84 against 0.96 / 0.98, M = 128 0.61
# against 0.57 / 0.56, M = 256 0.38 against 0.44 / 0.50; the fused engine (packed layout, Llama-3-8B
# shape) decodes 1.36x / 1.23x / 1.19x faster with it at batch 32 / 64 / 128 than with the untuned
# Triton GEMM (bench_ab.py --compare wgmma). So it takes M = 17..32. Session 27 (H100), with its
# warp-specialized form on the 64-token tile (the op's default there since): the engine at batch
# 48 / 64 on the packed layout decodes 7,646 / 10,054 tokens/s against 5,345 / 6,885 on the AWQ
# layout (bench_ab.py --compare layout, RESULTS.md), but both arms ran Triton's heuristic configs
# (FASTAWQ_TRITON_TUNE=0), and tuned Triton on the AWQ layout led the op at M = 64 in session 21
# (0.96 against 0.84; ws 0.87 in session 27): the bound moves to 64 once the A/B with tuning on
# (gpu_suite.sh s28) agrees. Since session 39 the 64-token tile runs the plain form, its K splits
# meeting in a cluster (H100: 1.00x cuBLAS against ws 0.96 at M = 64). FASTAWQ_PACKED_WGMMA=0 (read
# at import) turns it off, FASTAWQ_PACKED_WGMMA_MAX_M=N or "none" (every M; read at import) moves the
# bound; bench_ab.py --compare wgmma A/Bs it in one process.
PACKED_WGMMA = os.environ.get("FASTAWQ_PACKED_WGMMA", "1") == "1"


def _bound_from_env(name: str, default: int | None) -> int | None:
    """An M bound from the environment: a positive integer, or "none" for no bound."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() == "none":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer or 'none'")
    return int(value)


# Session 36 (H100, bench_ab.py --compare layout, Triton tuned as a user gets it): with the wgmma
# tiles' weights in row order the engine at batch 64 decodes 12,903.9 tokens/s on the packed layout
# (awq_wgmma_packed up to M = 64) against 10,260.5 on the AWQ layout, 1.258x: the bound is 64.
PACKED_WGMMA_MAX_M: int | None = _bound_from_env("FASTAWQ_PACKED_WGMMA_MAX_M", 64)
# awq_wgmma_packed's 16-token tile also serves the M = 9 .. 16 bucket (PACKED_GEMM_MAX_M's) on sm_90
# devices, in place of awq_gemm_packed (which keeps it on other GPUs, where the op declines). H100,
# RESULTS.md session 27: geomean x cuBLAS fp16 at M = 16 1.55 against awq_gemm_packed's 1.38;
# Llama-3-8B shape decode at batch 16 3,601 -> 3,885 tokens/s (bench_ab.py --compare wgmma16).
PACKED_WGMMA_16 = True
# moe_w4 is sized by its load, ceil(T * k / E) assignments per expert, not by T: the compiled MoE
# decode kernel (csrc/moe/, which reads an expert once per assignment) serves up to
# MOE_GEMV_MAX_LOAD, the Triton grouped GEMM (each expert once per block of rows) above. H200,
# RESULTS.md: Qwen3-30B-A3B T=1 19.6 vs 35.5 us, T=16 (load 1) 140 vs 272 us; Mixtral T=1 96 vs
# 248 us, T=16 (load 4) 1075 vs 934 us.
MOE_GEMV_MAX_LOAD = 2
# The compiled backend of moe_w4 has two kernels: moe_gemv_w4 (CUDA cores, each expert read once
# per assignment) and moe_mma_w4 (tensor cores, each expert reached read once per call; at most
# MOE_MMA_MAX_ASSIGN = T * k assignments and MOE_MMA_MAX_EXPERTS experts), which also serves loads
# up to MOE_MMA_MAX_LOAD. moe_kernel picks the tensor-core one once an expert reached gets
# MOE_MMA_MIN_REUSE assignments on average (uniform routing). H200, benchmarks/RESULTS.md (session
# 6), us GEMV / tensor cores (Triton): Qwen3-30B-A3B T=4 (reuse 1.10) 46.3 / 52.2, T=8 (1.24)
# 91.4 / 69.2 (184), T=16 140 / 99.3 (274); Mixtral T=1 95.2 / 95.6, T=2 (1.14) 179 / 139 (396),
# T=16 1076 / 288 (933). With passes of 16 tokens (session 7, MOE_MMA_WIDE_REUSE below), tensor
# cores (Triton): Qwen3-30B-A3B T=256 (load 16) 304 (619); Mixtral T=64 (load 16) 529 (1119,
# session 6), T=256 (load 64) 1657 (1882), so the kernel serves loads up to 64, the largest measured.
# MOE_MMA off: the GEMV, and loads above MOE_GEMV_MAX_LOAD go to Triton.
MOE_MMA = True
MOE_MMA_MIN_REUSE = 1.12
MOE_MMA_MAX_LOAD = 64
MOE_MMA_MAX_ASSIGN = 4096  # kMoeMmaMaxAssign, csrc/common/launch.h
MOE_MMA_MAX_EXPERTS = 1024  # kMoeMmaMaxExperts
# moe_mma_w4 streams an expert's weights once per pass of 8 or 16 of its tokens (two mma n-tiles:
# half the passes and dequantization per token for 3 blocks an SM instead of 4): 16 once an expert
# reached expects more than MOE_MMA_WIDE_REUSE assignments (uniform routing). H200, RESULTS.md
# (session 7), us 8 / 16 a pass: Qwen3-30B-A3B T=16 (reuse 1.6) 98.2 / 118.9, T=64 (4.3) 154 / 181,
# T=256 (16) 395 / 304; Mixtral T=16 (4) 284 / 339, T=64 (16) 884 / 529, T=256 (64) 3013 / 1657.
# Between reuse 4 and 16 the crossing was not measured on this tree (at T=128, reuse 8, a slower
# prologue tried and dropped gave 254 / 219), so 8 stands.
MOE_MMA_WIDE_REUSE = 8.0
# ops.route on GPUs: the router GEMM inside the Triton routing launch (route_kernel), instead of a
# cuBLAS GEMM then topk_route (benchmarks/bench_ab.py --compare route measures both; H200 decode
# 1.014x / 1.016x Qwen3-30B-A3B at batch 1 / 16, RESULTS.md), for up to ROUTE_FUSED_MAX_T tokens:
# route_kernel reads the router weights once per token, cuBLAS once per tile of tokens, so prefill
# chunks keep cuBLAS.
ROUTE_FUSED = True
ROUTE_FUSED_MAX_T = 32
# ops.add_rms_norm_route (the fused engine's MoE blocks): the add + RMSNorm before the router in the
# same launch as well. Off: it measured no faster (H200, Qwen3-30B-A3B, all layers, bench_ab.py
# --compare norm_route: 1.004x at batch 1, 1.000x at batch 16, RESULTS.md session 5); off, the
# block runs the add_rms_norm and route launches.
NORM_ROUTE_FUSED = False
# The compiled routing kernel (fastawq::moe_route, csrc/moe/route.cu): the router GEMV, the top-k
# choice and, for ops.add_rms_norm_route, the norm before them in one launch; like route_kernel it
# reads the router once per token, so it serves up to ROUTE_FUSED_MAX_T tokens. On sm_90 with
# 16-byte rows, H <= 8192 and E <= 128 it runs as a cluster of up to 8 blocks that stage their
# router rows in shared memory before the PDL wait and meet in distributed shared memory. The
# automatic choice takes it on sm_90 for E in ROUTE_CUDA_EXPERTS and H <= 4096, where it was
# measured (H200, RESULTS.md session 14, bench_ab.py --compare route_cuda: Qwen3-30B-A3B decode
# 1.056x at batch 1, 1.029x at 16; norm + route 5.80 against Triton's 7.18 us). Mixtral-8x7B (E = 8)
# measured 0.907x in the same call although its routing alone is faster (3.52 against 5.17 us):
# the experts' GEMV, launched early, lands beside the 8 route blocks (FASTAWQ_ROUTE_LATE_TRIGGER=1
# ties it, 1.000x, and costs Qwen3 1.4 %: session 15), so E < 16 keeps Triton, as do GPUs before
# sm_90 (the part kernel, without clusters: 0.966x, session 8). backend="cuda" still runs it
# everywhere it fits.
ROUTE_CUDA = True
ROUTE_CUDA_EXPERTS = (16, 128)
# ops.rope_decode_attention: where the compiled decode attention serves a decode step (one token a
# row), the rotary embedding (after Qwen3's q/k norms) and the cache write run inside it
# (fastawq::rope_decode_attention) rather than as rope_kv_cache's launch before it. H200, RESULTS.md
# session 15, bench_ab.py --compare rope_attention: decode 1.008x / 1.014x Qwen3-30B-A3B at batch
# 1 / 16, 1.003x / 1.030x Llama-3-8B, 1.006x Mixtral-8x7B. Off: the two launches.
ROPE_ATTENTION_FUSED = True
# modules.fused.act_linear: the fused MLP's act(gate) * up inside the down projection's GEMV
# (fastawq::awq_gemv_packed_act, packed layout, M <= 2) rather than act_mul's launch before it.
# H200, RESULTS.md session 16, bench_ab.py --compare act_gemv: Llama-3-8B decode 1.035x at batch 1,
# 1.027x at batch 2. Off: the two launches.
ACT_GEMV_FUSED = True
# modules.fused.norm_linear: the decoder layer's add + RMSNorm inside the QKV (and a dense MLP's
# gate_up) GEMV (fastawq::awq_gemv_packed_norm, packed layout, M <= 2). Off until measured (same branch).
NORM_GEMV_FUSED = False
_CUDA_PREFERENCE: dict[str, list[tuple[int | None, tuple[str, ...]]]] = {
    "route": [
        (ROUTE_FUSED_MAX_T, ("cuda", "triton", "torch")),
        (None, ("triton", "torch")),
    ],
    "moe_w4": [
        (MOE_GEMV_MAX_LOAD, ("cuda", "triton", "torch")),
        (MOE_MMA_MAX_LOAD, ("cuda", "triton", "torch")),
        (None, ("triton", "torch")),
    ],
    "awq_gemm": [
        *((m, ("cuda", "triton", "torch")) for m in sorted(CUDA_GEMM_KERNEL_BY_M)),
        (None, ("triton", "cuda", "torch")),
    ],
}


def _preference(op: str) -> list[tuple[int | None, tuple[str, ...]]]:
    """_CUDA_PREFERENCE[op]; packed_gemm's from the PACKED_*_MAX_M bounds as they are now (a benchmark
    may move them between plans)."""
    if op != "packed_gemm":
        return _CUDA_PREFERENCE.get(op, [])
    compiled = [PACKED_GEMV_MAX_M, PACKED_MMA_MAX_M] + ([PACKED_GEMM_MAX_M] if PACKED_GEMM_MAX_M > PACKED_MMA_MAX_M else [])
    wgmma = _wgmma_on()
    if wgmma and PACKED_WGMMA_MAX_M is not None and PACKED_WGMMA_MAX_M > compiled[-1]:
        compiled.append(PACKED_WGMMA_MAX_M)
    above = ("cuda", "triton", "torch") if wgmma and PACKED_WGMMA_MAX_M is None else ("triton", "torch")
    return [(bound, ("cuda", "triton", "torch")) for bound in compiled] + [(None, above)]


def _wgmma_on() -> bool:
    """PACKED_WGMMA, where the build has awq_wgmma_packed (whether the device is sm_90 the op's fit
    check says: ops/repack.py)."""
    return PACKED_WGMMA and _ext.has_op("awq_wgmma_packed")

# Where layout "auto" picks the packed layout on CUDA devices (with the compiled kernels).
# Everywhere only once the GPU benchmark (benchmarks/gemm_table.py --layouts awq,packed) shows it
# at least as fast at every M (prefill runs the Triton GEMM on it, behind the AWQ layout's at
# M >= 1024); meanwhile for the fused engine serving at most PACKED_FUSED_MAX_BATCH sequences,
# whose decode steps the compiled kernels serve (H200, Llama-3-8B shape, benchmarks/bench_ab.py
# --compare layout: decode 1.45x / 1.42x / 1.24x the AWQ layout at batch 4 / 8 / 16, RESULTS.md).
PACKED_LAYOUT_BY_DEFAULT = False
PACKED_LAYOUT_FOR_FUSED_DECODE = True


def packed_fused_max_batch(device: torch.device | None = None) -> int:
    """The largest fused-engine batch whose decode steps the compiled packed kernels serve (on
    `device`: awq_wgmma_packed's bucket counts on sm_90 devices only)."""
    if not _ext.has_op("awq_mma_packed"):
        return PACKED_GEMV_MAX_M
    if _wgmma_on() and (device is None or is_sm90(device)):
        return 1 << 20 if PACKED_WGMMA_MAX_M is None else max(PACKED_WGMMA_MAX_M, PACKED_GEMM_MAX_M)
    return max(PACKED_MMA_MAX_M, PACKED_GEMM_MAX_M if _ext.has_op("awq_gemm_packed") else 0)


def is_sm90(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (sm_90: what awq_wgmma_packed and the router's cluster form run on)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def cuda_gemm_kernel(m: int | None) -> str:
    """The compiled awq_gemm kernel name for an M bucket (None: above every GEMV bucket)."""
    return CUDA_GEMM_KERNEL_BY_M.get(m, "auto") if m is not None else "auto"


def packed_kernel(m: int | None, device: torch.device | None = None) -> str:
    """The compiled packed_gemm kernel for an M bucket: "gemv" (awq_gemv_packed), "mma"
    (awq_mma_packed), "gemm" (awq_gemm_packed, also above every bucket: the compiled backend forced)
    or, above them with PACKED_WGMMA, "wgmma" (awq_wgmma_packed; also above every bucket: the
    compiled backend forced, where it beats awq_gemm_packed at every M measured; and in
    awq_gemm_packed's bucket with PACKED_WGMMA_16 when `device` is an sm_90 GPU)."""
    if m is not None and m <= PACKED_GEMV_MAX_M:
        return "gemv"
    if m is not None and m <= PACKED_MMA_MAX_M:
        return "mma"
    if _wgmma_on():
        if m is None or m > max(PACKED_MMA_MAX_M, PACKED_GEMM_MAX_M):
            return "wgmma"
        if PACKED_WGMMA_16 and device is not None and is_sm90(device):
            return "wgmma"
    return "gemm"


def moe_reuse(t: int, k: int, e: int) -> float:
    """Assignments per expert reached, expected for T tokens routed uniformly to k of E experts."""
    reached = e * (1.0 - (1.0 - min(k, e) / e) ** t) if e > 0 else 0.0
    return t * k / reached if reached > 0 else 0.0


def moe_kernel(t: int, k: int, e: int) -> str:
    """The compiled moe_w4 kernel for T tokens routed to k of E experts each: "gemv" or "mma"."""
    if not MOE_MMA or t * k > MOE_MMA_MAX_ASSIGN or e > MOE_MMA_MAX_EXPERTS:
        return "gemv"
    return "mma" if moe_reuse(t, k, e) >= MOE_MMA_MIN_REUSE else "gemv"


def moe_pass_rows(t: int, k: int, e: int) -> int:
    """Tokens per pass over an expert's weights for moe_mma_w4: 8 or 16."""
    return 16 if moe_reuse(t, k, e) > MOE_MMA_WIDE_REUSE else 8


def size_buckets(op: str) -> list[int | None]:
    """The M bounds at which `op`'s automatic choice on CUDA may change (None: unbounded)."""
    return [bound for bound, _ in (_preference(op) or [(None, ())])]


def _cuda_order(op: str, m: int | None) -> tuple[str, ...]:
    for bound, order in _preference(op):
        if bound is None or (m is not None and m <= bound):
            return order
    return ("cuda", "triton", "torch")


def preferred_layout(device: torch.device, fused_batch: int | None = None) -> str:
    """The W4 weight layout that layout "auto" picks on `device`: "packed" or "awq". fused_batch:
    the batch size of the fused engine the layers will serve (None: not fused)."""
    if device.type != "cuda" or not _ext.has_op(COMPILED_OPS["packed_gemm"]):
        return "awq"
    fused_decode = fused_batch is not None and fused_batch <= packed_fused_max_batch(device)
    return "packed" if PACKED_LAYOUT_BY_DEFAULT or (PACKED_LAYOUT_FOR_FUSED_DECODE and fused_decode) else "awq"


# The routed experts (WQExperts) follow a model's layout (qlinear.set_layout) into the packed one
# where the compiled packed-expert kernels exist (moe_gemv_packed_w4 at loads up to
# MOE_GEMV_MAX_LOAD, moe_mma_packed_w4 to MOE_MMA_MAX_LOAD; Triton's grouped GEMM reads it above),
# a fused engine of batch 1 included. FASTAWQ_MOE_LAYOUT=awq (read when a model is converted) keeps
# them in the AWQ layout. H100 (RESULTS.md),
# Qwen3-30B-A3B decode AWQ -> packed experts: batch 8 1,446.5 -> 1,528.5, batch 16 2,131.7 ->
# 2,468.9 tok/s (session 29); batch 1 500.4 -> 501.6 once moe_gemv_packed_w4's w2 loaded its
# first scales before its PDL wait (session 31; 498.7 -> 480.3 before, when batch 1 kept AWQ
# experts); the grouped op T = 1 / 2 16.9 / 30.5 -> 15.5 / 23.3 us, Mixtral T = 16 / 64 413 / 651
# -> 306 / 548 us.
MOE_PACKED_EXPERTS = True


def experts_layout(layout: str, device: torch.device) -> str:
    """The layout the routed experts take when a model is converted to `layout` ("awq" or
    "packed")."""
    env = os.environ.get("FASTAWQ_MOE_LAYOUT")
    if layout != "packed" or not MOE_PACKED_EXPERTS or env == "awq":
        return "awq"
    # (Elsewhere the packed experts would run the torch reference on unpacked copies.)
    if device.type != "cuda" or not (_ext.has_op("moe_gemv_packed_w4") and _ext.has_op("moe_mma_packed_w4")):
        return "awq"
    return "packed"


# os.environ's look-ups run Python code (key encoding) and cost ~1 us each on this project's CPU;
# the CPU decode path asks for several switches per call. CPython keeps the POSIX environment as a
# bytes dict that os.environ's setters update, so a switch reads it directly where it exists.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def env_switch(name: bytes) -> str | None:
    """os.environ.get(name.decode()) for the hot path: `name` as bytes, read without encoding."""
    if _ENV_BYTES is not None:
        value = _ENV_BYTES.get(name)
        return None if value is None else value.decode()
    return os.environ.get(name.decode())


def tensor_version(t: torch.Tensor) -> int:
    """t's in-place write counter, for caches keyed on weights; -1 for an inference tensor, which
    keeps none (it can be written in place only inside inference mode: such an edit goes
    unseen by the caches, which then key on identity alone; fastawq.cpu.clear_cache() drops them)."""
    if t.is_inference():
        return -1
    return t._version


class BackendUnavailableError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return _module(_TRITON_MODULE) is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _why_not(backend: str, op: str, device: torch.device, shapes_ok) -> str | None:
    """None if `backend` can run `op` on `device`; otherwise the reason, in words."""
    if backend == "torch":
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return f"tensors are on {device}, the compiled kernels run on CUDA devices"
        if not _ext.is_loaded():
            return _ext.status()["reason"]
        # torch.ops.fastawq also holds the Python custom ops of ops/layer.py (same namespace):
        # only the ops _C itself implements count as compiled.
        if op not in COMPILED_OPS or not _ext.has_op(COMPILED_OPS[op]):
            return f"the compiled extension has no op {COMPILED_OPS.get(op, op)!r}"
        if not _ext.supports_device(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            return f"the compiled kernels were built for {_ext.built_archs()}, this GPU is sm {cap}"
        return shapes_ok("cuda")
    if backend == "triton":
        if not triton_available():
            return "triton is not installed"
        if device.type != "cuda" and not triton_interpreting():
            return f"tensors are on {device}; Triton runs on GPUs (or on CPU with TRITON_INTERPRET=1)"
        if not hasattr(_module(_TRITON_MODULE), op):
            return f"no Triton kernel for {op!r}"
        return shapes_ok("triton")
    if backend == "cpu":
        if device.type != "cpu":
            return f"tensors are on {device}, the CPU kernels run on the CPU"
        if not has_cpu_kernel(op):
            return None  # the torch reference on the CPU (see the module docstring)
        return shapes_ok("cpu")
    return f"unknown backend {backend!r}; choose one of {BACKENDS}"


# Ops fastawq._C implements on CUDA devices, by op name: the name of its compiled op (the schemas
# in csrc/registration.cpp).
COMPILED_OPS = {
    "awq_gemm": "awq_gemm", "awq_dequantize": "awq_dequantize", "decode_attention": "decode_attention",
    "packed_gemm": "awq_gemv_packed", "moe_w4": "moe_gemv_w4", "route": "moe_route",
}


def has_cpu_kernel(op: str) -> bool:
    mod = _module(_CPU_MODULE)
    return mod is not None and hasattr(mod, op)


def _always(_backend: str) -> None:
    return None


def select_backend(
    op: str, device: torch.device, *, backend: str | None = None, shapes_ok=_always, m: int | None = None
) -> str:
    """Pick the backend for one call of `op` on `device` (with `m` rows, where the order depends on it).

    `shapes_ok(backend)` returns None when that backend's kernels take the call's shapes and
    dtypes, else the reason; it lets a backend decline without knowing about the others. The
    answer is the backend that runs: a forced "cpu" comes back "torch" for an op without a CPU
    kernel, a forced "cuda" comes back "triton" for an op without a compiled kernel.
    """
    forced = backend or os.environ.get("FASTAWQ_BACKEND") or None
    if forced == "auto":
        forced = None
    if forced == "cuda" and op not in COMPILED_OPS and device.type == "cuda":
        forced = "triton"
    if forced:
        reason = _why_not(forced, op, device, shapes_ok)
        if reason is not None:
            raise BackendUnavailableError(f"backend {forced!r} cannot run {op}: {reason}")
        if forced == "cpu" and not has_cpu_kernel(op):
            return "torch"
        return forced
    if device.type == "cuda":
        candidates = _cuda_order(op, m)
    else:
        # The Triton interpreter is a test vehicle, never an automatic choice on CPU.
        candidates = ("cpu", "torch") if has_cpu_kernel(op) else ("torch",)
    for name in candidates:
        if _why_not(name, op, device, shapes_ok) is None:
            return name
    return "torch"


def report(device: torch.device, ops: tuple[str, ...]) -> dict[str, str]:
    """For `fastawq env`: the backend each op would use on `device`, or why none can."""
    out = {}
    for op in ops:
        try:
            chosen = {select_backend(op, device, m=b) for b in size_buckets(op)}
            out[op] = "/".join(sorted(chosen)) if len(chosen) > 1 else chosen.pop()
        except BackendUnavailableError as e:
            out[op] = f"error: {e}"
    return out
