"""The W4A16 mixture-of-experts op: validation, backend dispatch, the torch path and the custom op.

moe_w4 runs the routed experts of a SwiGLU-style MoE layer on the AWQ GEMM layout stacked per
expert: Triton on GPUs (a grouped GEMM, tokens sorted by expert), elsewhere reference.moe_w4 (a
loop over the experts that received tokens, in fp32). It is registered as ``torch.ops.fastawq.moe_w4`` with a fake impl, so it traces under torch.compile. topk_route
turns router logits into (topk_weights, topk_ids), in one Triton launch on GPUs; route does the
router GEMM too, in the same launch.
"""
from __future__ import annotations

from typing import Callable

import torch

from fastawq import reference
from fastawq import _ext
from fastawq import backend as _backend
from fastawq.backend import MOE_GEMV_MAX_LOAD, select_backend
from fastawq.ops._common import HALF as _HALF
from fastawq.ops._common import call_op as _call
from fastawq.ops._common import check_same_device
from fastawq.ops._common import triton_module as _triton
from fastawq.ops.layer import _add_rms_norm_impl


# w13_qweight [E, H, 2I // 8] · w13_scales [E, H // G, 2I] · w13_qzeros [E, H // G, 2I // 8]
# w2_qweight [E, I, H // 8] · w2_scales [E, I // G, H] · w2_qzeros [E, I // G, H // 8]
def check_moe_shapes(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size: int):
    """Validate stacked expert weights; return (E, H, I). Errors name every shape involved."""
    named = {
        "w13_qweight": w13_qweight, "w13_scales": w13_scales, "w13_qzeros": w13_qzeros,
        "w2_qweight": w2_qweight, "w2_scales": w2_scales, "w2_qzeros": w2_qzeros,
    }
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in named.items())
    if any(v.dim() != 3 for v in named.values()):
        raise ValueError(f"expected 3-D stacked expert weights [E, ...], got {shapes}")
    for k in ("w13_qweight", "w13_qzeros", "w2_qweight", "w2_qzeros"):
        if named[k].dtype != torch.int32:
            raise TypeError(f"{k} must be int32, got {named[k].dtype}")
    for k in ("w13_scales", "w2_scales"):
        if named[k].dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{k} must be fp16, bf16 or fp32, got {named[k].dtype}")
    e, h, i2 = w13_qweight.shape[0], w13_qweight.shape[1], w13_qweight.shape[2] * reference.PACK
    i = i2 // 2
    if any(v.shape[0] != e for v in named.values()) or w2_qweight.shape[1:] != (i, h // reference.PACK) \
            or h % reference.PACK:
        raise ValueError(f"inconsistent MoE weights (E={e}, H={h}, 2I={i2}): {shapes}")
    g13 = reference.resolve_group_size(group_size, h)
    g2 = reference.resolve_group_size(group_size, i)
    if h % g13 or i % g2:
        raise ValueError(f"H={h} and I={i} must be divisible by group_size={group_size}: {shapes}")
    want = {
        "w13_scales": (e, h // g13, i2), "w13_qzeros": (e, h // g13, i2 // 8),
        "w2_scales": (e, i // g2, h), "w2_qzeros": (e, i // g2, h // 8),
    }
    for k, shape in want.items():
        if tuple(named[k].shape) != shape:
            raise ValueError(f"{k} should be {shape} for E={e}, H={h}, I={i}, group_size={group_size}; got {shapes}")
    return e, h, i


def _check_experts(inputs: tuple, weights: tuple, group_size: int, act: str) -> tuple[int, int, int]:
    e, h, i = check_moe_shapes(*weights, group_size)
    if act not in reference.MOE_ACTS:
        raise ValueError(f"act must be one of {reference.MOE_ACTS}, got {act!r}")
    devices = {t.device for t in (*inputs, *weights)}
    if len(devices) > 1:
        raise ValueError(f"all MoE tensors must be on one device, got {sorted(map(str, devices))}")
    return e, h, i


def _check_routing(x, topk_ids, topk_weights, h: int) -> None:
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"hidden_states {tuple(x.shape)} must be [T, H={h}]")
    if not x.is_floating_point():
        raise TypeError(f"hidden_states must be floating point, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={x.shape[0]}, k]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")


# x [T, H] · topk_ids [T, k] int · topk_weights [T, k] · w13_* / w2_* as in check_moe_shapes  ->  [T, H] (x's dtype)
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
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * down_e(act(gate_e(x)) * up_e(x)), e = topk_ids[:, j].

    topk_ids must lie in [0, E): the GPU path does not check them, since checking would cost a
    host sync that breaks CUDA-graph capture.
    """
    weights = (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros)
    e, h, i = _check_experts((x, topk_ids, topk_weights), weights, group_size, act)
    _check_routing(x, topk_ids, topk_weights, h)
    args = (x, topk_ids, topk_weights, *weights, group_size, act)
    if torch.compiler.is_compiling():
        # The choice is made when the op runs: dispatch reads the environment and imports modules,
        # which the tracer would not follow.
        return torch.ops.fastawq.moe_w4(*args, backend or "")
    # Eagerly the op's dispatcher round trip costs more than a decode step's kernels: call direct.
    return _moe_w4_impl(*args, _select(x, weights, group_size, act, backend, _load(x.shape[0], topk_ids.shape[1], e)))


def moe_w4_plan(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_qzeros: torch.Tensor,
    group_size: int,
    act: str = "silu",
    *,
    backend: str | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Validate the experts once and bind the backend for activations like `x` (device, dtype).

    The returned run(x, topk_ids, topk_weights) checks only the routing shapes: a module caches
    it, so an eager decode step pays neither weight validation nor dispatch (about 0.1 ms a layer
    on a slow CPU). Its `.backend` attribute names the backend chosen.
    """
    weights = (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros)
    e, h, i = _check_experts((x,), weights, group_size, act)
    # The automatic choice depends on the load (assignments per expert, backend.size_buckets):
    # one backend for each bucket, bound here.
    chosen = _by_bucket(lambda m: _select(x, weights, group_size, act, backend, m))
    return _bucketed(chosen, h, e, lambda x, ids, w, be: _moe_w4_impl(x, ids, w, *weights, group_size, act, be))


# --- the experts in the packed layout (ops.repack.awq_experts_repack; WQExperts.set_layout) ---------


def check_moe_packed_shapes(w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size: int):
    """Validate stacked packed experts; return (E, H, I). Errors name every shape involved."""
    named = {"w13_wpacked": w13_wpacked, "w13_szpacked": w13_szpacked, "w2_wpacked": w2_wpacked,
             "w2_szpacked": w2_szpacked}
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in named.items())
    if any(v.dim() != 3 for v in named.values()):
        raise ValueError(f"expected 3-D stacked packed experts [E, ...], got {shapes}")
    for k in ("w13_wpacked", "w2_wpacked"):
        if named[k].dtype != torch.int32:
            raise TypeError(f"{k} must be int32, got {named[k].dtype}")
    for k in ("w13_szpacked", "w2_szpacked"):
        if named[k].dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{k} must be fp16, bf16 or fp32, got {named[k].dtype}")
    e, h, i2 = w13_wpacked.shape[0], w13_wpacked.shape[1] * reference.PACK, w13_wpacked.shape[2]
    i = w2_wpacked.shape[1] * reference.PACK
    if any(v.shape[0] != e for v in named.values()) or i2 != 2 * i or w2_wpacked.shape[2] != h:
        raise ValueError(f"inconsistent packed MoE weights (E={e}, H={h}, 2I={i2}): {shapes}")
    g13 = reference.resolve_group_size(group_size, h)
    g2 = reference.resolve_group_size(group_size, i)
    if h % g13 or i % g2:
        raise ValueError(f"H={h} and I={i} must be divisible by group_size={group_size}: {shapes}")
    want = {"w13_szpacked": (e, h // g13, 4 * i), "w2_szpacked": (e, i // g2, 2 * h)}
    for k, shape in want.items():
        if tuple(named[k].shape) != shape:
            raise ValueError(f"{k} should be {shape} for E={e}, H={h}, I={i}, group_size={group_size}; got {shapes}")
    return e, h, i


def _select_packed(x: torch.Tensor, packed: tuple, dims: tuple[int, int, int], group_size: int, act: str,
                   backend: str | None, m: int) -> str:
    """_select for experts in the packed layout (the same buckets: the compiled kernels up to
    MOE_MMA_MAX_LOAD, Triton's grouped GEMM above)."""
    ops = ("moe_gemv_packed_w4", "moe_mma_packed_w4")
    if not all(_ext.has_op(op) for op in ops):
        absent = "fastawq._C has no packed-expert kernels (moe_gemv_packed_w4, moe_mma_packed_w4)"
        return _select_moe(x, dims, (packed[1], packed[3]), group_size, act, backend, m, absent)
    return _select_moe(x, dims, (packed[1], packed[3]), group_size, act, backend, m, None, ops[1])


def _moe_w4_packed_impl(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_wpacked: torch.Tensor,
                        w13_szpacked: torch.Tensor, w2_wpacked: torch.Tensor, w2_szpacked: torch.Tensor,
                        group_size: int, act: str, backend: str) -> torch.Tensor:
    packed = (w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked)
    if not backend:  # chosen here, at run time ("" from a traced call)
        dims = check_moe_packed_shapes(*packed, group_size)
        backend = _select_packed(x, packed, dims, group_size, act, None, _load(x.shape[0], topk_ids.shape[1], dims[0]))
    if backend == "cuda":
        t, k = topk_ids.shape
        x = _rows16(x)
        ids, w = topk_ids.contiguous(), topk_weights.to(torch.float32).contiguous()
        if _backend.moe_kernel(t, k, w13_wpacked.shape[0]) == "mma":
            return torch.ops.fastawq.moe_mma_packed_w4(x, ids, w, *packed, group_size, act,
                                                       _backend.moe_pass_rows(t, k, w13_wpacked.shape[0]))
        return torch.ops.fastawq.moe_gemv_packed_w4(x, ids, w, *packed, group_size, act)
    if backend == "triton":
        return _triton().moe_w4_packed(x, topk_ids, topk_weights, *packed, group_size, act)
    if backend != "torch":
        raise ValueError(f"no {backend!r} implementation of moe_w4 on packed experts")
    return _moe_w4_impl(x, topk_ids, topk_weights, *experts_unpack(*packed, group_size), group_size, act, "torch")


def experts_unpack(w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size: int) -> tuple:
    """awq_experts_repack's inverse, exactly: the stacked AWQ tensors (check_moe_shapes' order)."""
    from fastawq.ops import repack

    out = []
    for wp, sz in ((w13_wpacked, w13_szpacked), (w2_wpacked, w2_szpacked)):
        k, n = wp.shape[1] * reference.PACK, wp.shape[2]
        g = reference.resolve_group_size(group_size, k)
        parts = [repack.awq_gemv_unpack(wp[e], sz[e], n, g) for e in range(wp.shape[0])]
        out += [torch.stack([p[j] for p in parts]) for j in range(3)]
    return tuple(out)


_moe_w4_packed_op = torch.library.custom_op("fastawq::moe_w4_packed", _moe_w4_packed_impl, mutates_args=())


@_moe_w4_packed_op.register_fake
def _(x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size, act, backend):
    torch._check(x.dim() == 2, lambda: f"hidden_states must be [T, H], got {tuple(x.shape)}")
    torch._check(w2_wpacked.dim() == 3 and w2_wpacked.shape[2] == x.shape[1],
                 lambda: f"w2_wpacked {tuple(w2_wpacked.shape)} vs x {tuple(x.shape)}")
    torch._check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0],
                 lambda: f"topk_ids {tuple(topk_ids.shape)} and weights must be [T={x.shape[0]}, k]")
    return x.new_empty(x.shape)


# x [T, H] · topk_ids [T, k] · topk_weights [T, k] · w13_wpacked [E, H // 8, 2I] int32 · w13_szpacked
# [E, H // G, 4I] · w2_wpacked [E, I // 8, H] int32 · w2_szpacked [E, I // G, 2H]  ->  [T, H] (x's dtype)
def moe_w4_packed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_wpacked: torch.Tensor,
                  w13_szpacked: torch.Tensor, w2_wpacked: torch.Tensor, w2_szpacked: torch.Tensor, group_size: int,
                  act: str = "silu", *, backend: str | None = None) -> torch.Tensor:
    """moe_w4 on experts in the packed layout: on GPUs the compiled kernels (moe_gemv_packed_w4 /
    moe_mma_packed_w4 by backend.moe_kernel) up to backend.MOE_MMA_MAX_LOAD, Triton's grouped GEMM
    above; elsewhere the torch reference on the unpacked experts."""
    packed = (w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked)
    if torch.compiler.is_compiling():  # the choice is made when the op runs (as moe_w4's)
        return torch.ops.fastawq.moe_w4_packed(x, topk_ids, topk_weights, *packed, group_size, act, backend or "")
    return moe_w4_packed_plan(x, *packed, group_size, act, backend=backend)(x, topk_ids, topk_weights)


def moe_w4_packed_plan(x: torch.Tensor, w13_wpacked: torch.Tensor, w13_szpacked: torch.Tensor,
                       w2_wpacked: torch.Tensor, w2_szpacked: torch.Tensor, group_size: int, act: str = "silu", *,
                       backend: str | None = None
                       ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """moe_w4_plan for experts in the packed layout."""
    packed = (w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked)
    dims = check_moe_packed_shapes(*packed, group_size)
    e, h, _ = dims
    if act not in reference.MOE_ACTS:
        raise ValueError(f"act must be one of {reference.MOE_ACTS}, got {act!r}")
    check_same_device(x=x, w13_wpacked=w13_wpacked, w13_szpacked=w13_szpacked, w2_wpacked=w2_wpacked,
                      w2_szpacked=w2_szpacked)
    chosen = _by_bucket(lambda m: _select_packed(x, packed, dims, group_size, act, backend, m))
    return _bucketed(chosen, h, e,
                     lambda x, ids, w, be: _moe_w4_packed_impl(x, ids, w, *packed, group_size, act, be))


def packed_sums_kernel_serves(x: torch.Tensor, k: int, packed: tuple, group_size: int, act: str,
                              backend: str | None) -> bool:
    """sums_kernel_serves for experts in the packed layout (moe_gemv_packed_w4_sums)."""
    if not (x.is_cuda and x.dtype in _HALF and _ext.has_op("moe_gemv_packed_w4_sums")) or x.shape[0] != 1:
        return False
    try:
        dims = check_moe_packed_shapes(*packed, group_size)
        chosen = _select_packed(x, packed, dims, group_size, act, backend, _load(1, k, dims[0]))
    except Exception:  # a forced backend that cannot serve: moe_w4_packed says why
        return False
    return chosen == "cuda" and _backend.moe_kernel(1, k, dims[0]) == "gemv"


# moe_w4_sums on packed experts (packed_sums_kernel_serves): the fp32 weighted sum [1, H].
def moe_w4_packed_sums(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_wpacked: torch.Tensor,
                       w13_szpacked: torch.Tensor, w2_wpacked: torch.Tensor, w2_szpacked: torch.Tensor,
                       group_size: int, act: str = "silu") -> torch.Tensor:
    _check_routing(x, topk_ids, topk_weights, x.shape[-1])
    return torch.ops.fastawq.moe_gemv_packed_w4_sums(
        _rows16(x), topk_ids.contiguous(), topk_weights.to(torch.float32).contiguous(), w13_wpacked, w13_szpacked,
        w2_wpacked, w2_szpacked, group_size, act)


def sums_kernel_serves(x: torch.Tensor, k: int, weights: tuple, group_size: int, act: str, backend: str | None) -> bool:
    """Whether moe_w4_sums serves one token x [1, H] routed to k experts: the compiled one-token
    kernel is what moe_w4's automatic (or forced) choice runs for it."""
    if not (x.is_cuda and x.dtype in _HALF and _ext.has_op("moe_gemv_w4_sums")) or x.shape[0] != 1:
        return False
    e = weights[0].shape[0]
    try:
        chosen = _select(x, weights, group_size, act, backend, _load(1, k, e))
    except Exception:  # a forced backend that cannot serve: moe_w4 says why
        return False
    return chosen == "cuda" and _backend.moe_kernel(1, k, e) == "gemv"


# As moe_w4 for one token on the compiled kernel (sums_kernel_serves), but returns the weighted sum
# in fp32 [1, H], before its rounding to x's dtype.
def moe_w4_sums(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_qweight: torch.Tensor,
                w13_scales: torch.Tensor, w13_qzeros: torch.Tensor, w2_qweight: torch.Tensor, w2_scales: torch.Tensor,
                w2_qzeros: torch.Tensor, group_size: int, act: str = "silu") -> torch.Tensor:
    _check_routing(x, topk_ids, topk_weights, x.shape[-1])
    return torch.ops.fastawq.moe_gemv_w4_sums(
        x if x.stride(-1) == 1 else x.contiguous(), topk_ids.contiguous(), topk_weights.to(torch.float32).contiguous(),
        w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size, act)


def _rows16(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where the compiled kernels could not load its rows in 16-byte pieces."""
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _bucketed(chosen: list[tuple[int | None, str]], h: int, e: int, impl: Callable) -> Callable:
    """A plan's call: the routing checked, then impl(x, topk_ids, topk_weights, backend) with the
    backend _by_bucket bound for the call's load; .backend names the ones bound."""

    def run(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        _check_routing(x, topk_ids, topk_weights, h)
        load = _load(x.shape[0], topk_ids.shape[1], e)
        return impl(x, topk_ids, topk_weights, next(b for bound, b in chosen if bound is None or load <= bound))

    run.backend = "/".join(dict.fromkeys(b for _, b in chosen))
    return run


def _by_bucket(select: Callable[[int], str]) -> list[tuple[int | None, str]]:
    """(bound, select(m)) for each of moe_w4's load buckets (backend.size_buckets), m its largest
    load (one past the last bound for the unbounded one): the backend a plan binds per bucket."""
    chosen, below = [], 0
    for bound in _backend.size_buckets("moe_w4"):
        chosen.append((bound, select(below + 1 if bound is None else bound)))
        below = bound if bound is not None else below
    return chosen


def _load(t: int, k: int, e: int) -> int:
    """Assignments per expert, rounded up: what moe_w4's automatic choice is sized by. Past the
    CUDA-core kernel's loads, a call the tensor-core kernel cannot take (more than
    backend.MOE_MMA_MAX_ASSIGN assignments or MOE_MMA_MAX_EXPERTS experts) counts as the bucket
    above it, so it goes where larger loads go, not to the kernel that reads an expert per
    assignment (Qwen3-30B-A3B at 600 tokens: load 38, 4,800 assignments)."""
    load = -(-t * k // max(e, 1))
    if load > MOE_GEMV_MAX_LOAD and (t * k > _backend.MOE_MMA_MAX_ASSIGN or e > _backend.MOE_MMA_MAX_EXPERTS):
        return max(load, _backend.MOE_MMA_MAX_LOAD + 1)
    return load


def _select(x: torch.Tensor, weights: tuple, group_size: int, act: str, backend: str | None, m: int) -> str:
    """The backend for activations like x on the stacked `weights` (check_moe_shapes' order) at
    load m (assignments per expert, _load)."""
    dims = (weights[0].shape[0], weights[0].shape[1], weights[3].shape[1])
    return _select_moe(x, dims, (weights[1], weights[4]), group_size, act, backend, m, None, "moe_mma_w4")


def _select_moe(x: torch.Tensor, dims: tuple[int, int, int], scales: tuple, group_size: int, act: str,
                backend: str | None, m: int, cuda_absent: str | None, mma_op: str = "") -> str:
    """select_backend for moe_w4 at load m on experts of dims (E, H, I) with these scales (either
    layout); cuda_absent: why the compiled backend cannot serve at all, or None; mma_op: its
    tensor-core kernel, which loads above MOE_GEMV_MAX_LOAD need."""
    e, h, i = dims

    def fits(b: str) -> str | None:
        if b in ("cuda", "triton") and x.dtype not in _HALF:
            return f"x is {x.dtype}; the {b} MoE kernels take fp16 or bf16 activations"
        if b == "triton":
            return _triton().moe_w4_fits(h, i, group_size, act)
        if b == "cuda":
            if cuda_absent is not None:
                return cuda_absent
            dtypes = {s.dtype for s in scales}
            if dtypes != {x.dtype}:
                return f"the compiled MoE kernels take scales in x's dtype {x.dtype}, got {sorted(map(str, dtypes))}"
            if m > MOE_GEMV_MAX_LOAD and not (_backend.MOE_MMA and _ext.has_op(mma_op)):
                return f"{m} assignments per expert need the tensor-core MoE kernel ({mma_op}): off or absent"
            return torch.ops.fastawq.moe_gemv_w4_declines(e, h, i, group_size) or None
        return None

    return select_backend("moe_w4", x.device, backend=backend, shapes_ok=fits, m=m)


def _moe_w4_impl(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_qweight: torch.Tensor,
                 w13_scales: torch.Tensor, w13_qzeros: torch.Tensor, w2_qweight: torch.Tensor, w2_scales: torch.Tensor,
                 w2_qzeros: torch.Tensor, group_size: int, act: str, backend: str) -> torch.Tensor:
    e = w13_qweight.shape[0]
    if not backend:  # chosen here, at run time ("" from a traced call)
        weights = (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros)
        backend = _select(x, weights, group_size, act, None, _load(x.shape[0], topk_ids.shape[1], e))
    if backend == "cuda":
        # The kernels take dense operands and fp32 routing weights (no-ops when they already are).
        t, k = topk_ids.shape
        kernel = _backend.moe_kernel(t, k, e) if _ext.has_op("moe_mma_w4") else "gemv"
        op, extra = torch.ops.fastawq.moe_gemv_w4, ()
        if kernel == "mma":
            op, extra = torch.ops.fastawq.moe_mma_w4, (_backend.moe_pass_rows(t, k, e),)
            x = _rows16(x)
        return op(
            x if x.stride(-1) == 1 else x.contiguous(), topk_ids.contiguous(),
            topk_weights.to(torch.float32).contiguous(), w13_qweight.contiguous(), w13_scales.contiguous(),
            w13_qzeros.contiguous(), w2_qweight.contiguous(), w2_scales.contiguous(), w2_qzeros.contiguous(),
            group_size, act, *extra)
    if backend == "triton":
        return _triton().moe_w4(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros,
                                w2_qweight, w2_scales, w2_qzeros, group_size, act)
    if backend != "torch":
        raise ValueError(f"no {backend!r} implementation of moe_w4")
    if topk_ids.numel():  # the torch path syncs anyway (it loops over the experts hit): check the ids
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"topk_ids must lie in [0, {e}) for {e} experts, got values in [{lo}, {hi}]")
    return reference.moe_w4(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros,
                            w2_qweight, w2_scales, w2_qzeros, group_size, act)


_moe_w4_op = torch.library.custom_op("fastawq::moe_w4", _moe_w4_impl, mutates_args=())


@_moe_w4_op.register_fake
def _(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros,
      group_size, act, backend):
    torch._check(x.dim() == 2, lambda: f"hidden_states must be [T, H], got {tuple(x.shape)}")
    torch._check(w13_qweight.dim() == 3 and w2_qweight.dim() == 3, lambda: "stacked expert weights must be 3-D")
    torch._check(x.shape[1] == w13_qweight.shape[1], lambda: f"x {tuple(x.shape)} vs w13 {tuple(w13_qweight.shape)}")
    torch._check(w2_qweight.shape[2] * 8 == x.shape[1], lambda: f"w2 {tuple(w2_qweight.shape)} vs H={x.shape[1]}")
    torch._check(w13_qweight.shape[2] * 4 == w2_qweight.shape[1], lambda: "w13's 2I must be twice w2's I")
    torch._check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0],
                 lambda: f"topk_ids {tuple(topk_ids.shape)} and weights must be [T={x.shape[0]}, k]")
    return x.new_empty(x.shape)


def _moe_fake(sums: bool):
    """The fake of a compiled MoE kernel: x's shape, in fp32 for moe_gemv_w4_sums."""

    def fake(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros,
             group_size, act, pass_rows=8):  # pass_rows: moe_mma_w4's only
        torch._check(x.dim() == 2 and w13_qweight.dim() == 3 and w2_qweight.dim() == 3,
                     lambda: f"x {tuple(x.shape)} must be [T, H], the stacked weights 3-D")
        torch._check(w2_qweight.shape[2] * 8 == x.shape[1],
                     lambda: f"w2 {tuple(w2_qweight.shape)} vs x {tuple(x.shape)}")
        torch._check(topk_weights.dtype == torch.float32,
                     lambda: f"topk_weights must be fp32, got {topk_weights.dtype}")
        torch._check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0],
                     lambda: f"topk_ids {tuple(topk_ids.shape)} and weights must be [T={x.shape[0]}, k]")
        return x.new_empty(x.shape, dtype=torch.float32 if sums else x.dtype)

    return fake


def _moe_packed_fake(x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size, act,
                     pass_rows=8):
    """moe_mma_packed_w4's fake: x's shape and dtype."""
    torch._check(x.dim() == 2 and w2_wpacked.dim() == 3 and w2_wpacked.shape[2] == x.shape[1],
                 lambda: f"w2_wpacked {tuple(w2_wpacked.shape)} vs x {tuple(x.shape)}")
    torch._check(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0],
                 lambda: f"topk_ids {tuple(topk_ids.shape)} and weights must be [T={x.shape[0]}, k]")
    return x.new_empty(x.shape)


def _moe_packed_fake_gemv(sums: bool):
    """moe_gemv_packed_w4(_sums)'s fake: x's shape, in fp32 for the sums."""

    def fake(x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked, group_size, act):
        out = _moe_packed_fake(x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, w2_wpacked, w2_szpacked,
                               group_size, act)
        return x.new_empty(out.shape, dtype=torch.float32) if sums else out

    return fake


def _register_fakes() -> None:
    """Output shape of the compiled MoE kernels, so they trace and pass opcheck."""
    for name in ("moe_gemv_w4", "moe_mma_w4", "moe_gemv_w4_sums"):
        if _ext.has_op(name):
            torch.library.register_fake(f"fastawq::{name}")(_moe_fake(name.endswith("_sums")))
    if _ext.has_op("moe_mma_packed_w4"):
        torch.library.register_fake("fastawq::moe_mma_packed_w4")(_moe_packed_fake)
    for name in ("moe_gemv_packed_w4", "moe_gemv_packed_w4_sums"):
        if _ext.has_op(name):
            torch.library.register_fake(f"fastawq::{name}")(_moe_packed_fake_gemv(name.endswith("_sums")))


_register_fakes()


def _topk_route_impl(router_logits: torch.Tensor, k: int, renormalize: bool, scoring: str,
                     correction_bias: torch.Tensor | None, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        return _triton().topk_route(router_logits, k, renormalize, scoring, correction_bias=correction_bias,
                                    scale=scale)
    return reference.topk_route(router_logits, k, renormalize, scoring, correction_bias=correction_bias, scale=scale)


_topk_route_op = torch.library.custom_op("fastawq::topk_route", _topk_route_impl, mutates_args=())


@_topk_route_op.register_fake
def _(router_logits, k, renormalize, scoring, correction_bias, scale, backend):
    torch._check(router_logits.dim() == 2, lambda: f"router_logits {tuple(router_logits.shape)} must be [T, E]")
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, k), dtype=torch.float32),
            router_logits.new_empty((t, k), dtype=torch.int64))


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
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.topk_route (softmax or sigmoid scores, optional bias and group limit), in one
    Triton launch on GPUs where there is no group limit."""
    _, e = reference.check_topk_route(router_logits, k, scoring, correction_bias)

    def fits(b: str) -> str | None:
        return _triton().topk_route_fits(e, num_groups, scoring) if b == "triton" else None

    be = select_backend("topk_route", router_logits.device, backend=backend, shapes_ok=fits,
                        m=router_logits.shape[0])
    if num_groups > 1:  # the group limit runs in torch only (fits declines it for Triton)
        return reference.topk_route(router_logits, k, renormalize, scoring, num_groups=num_groups,
                                    topk_groups=topk_groups, correction_bias=correction_bias, scale=scale)
    return _call(torch.ops.fastawq.topk_route, _topk_route_impl, router_logits, k, renormalize, scoring,
                 correction_bias, float(scale), be)


def _route_impl(x: torch.Tensor, router_weight: torch.Tensor, k: int, renormalize: bool, scoring: str,
                correction_bias: torch.Tensor | None, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "cuda":
        w, ids, _, _ = torch.ops.fastawq.moe_route(x, None, None, 0.0, 0.0, router_weight, k, renormalize, scoring,
                                                   correction_bias, scale)
        return w, ids
    if backend == "triton" and _backend.ROUTE_FUSED and x.shape[0] <= _backend.ROUTE_FUSED_MAX_T:
        return _triton().route(x, router_weight, k, renormalize, scoring, correction_bias=correction_bias,
                               scale=scale)
    if backend == "triton":
        logits = torch.nn.functional.linear(x.to(router_weight.dtype), router_weight)
        return _topk_route_impl(logits, k, renormalize, scoring, correction_bias, scale, backend)
    return reference.route(x, router_weight, k, renormalize, scoring, correction_bias=correction_bias, scale=scale)


_route_op = torch.library.custom_op("fastawq::route", _route_impl, mutates_args=())


@_route_op.register_fake
def _(x, router_weight, k, renormalize, scoring, correction_bias, scale, backend):
    torch._check(x.dim() == 2 and router_weight.dim() == 2 and x.shape[1] == router_weight.shape[1],
                 lambda: f"x {tuple(x.shape)} and router_weight {tuple(router_weight.shape)} must be [T, H], [E, H]")
    t = x.shape[0]
    return x.new_empty((t, k), dtype=torch.float32), x.new_empty((t, k), dtype=torch.int64)


# x [T, H] · router_weight [E, H]  ->  topk_weights [T, k] fp32 · topk_ids [T, k] int64
def route(
    x: torch.Tensor, router_weight: torch.Tensor, k: int, renormalize: bool = True, scoring: str = "softmax", *,
    correction_bias: torch.Tensor | None = None, scale: float = 1.0, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.route (the router GEMM, then topk_route without a group limit): on GPUs one Triton
    launch for both up to backend.ROUTE_FUSED_MAX_T tokens (with ROUTE_FUSED), else the GEMM in
    torch and topk_route's launch."""
    be = _route_backend(x, router_weight, k, scoring, correction_bias, backend)
    return _call(torch.ops.fastawq.route, _route_impl, x, router_weight, k, renormalize, scoring, correction_bias,
                 float(scale), be)


def _add_rms_norm_route_impl(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
    router_weight: torch.Tensor, k: int, renormalize: bool, scoring: str, correction_bias: torch.Tensor | None,
    scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "cuda":  # the norm always in the routing launch (backend.ROUTE_CUDA)
        w, ids, h, r = torch.ops.fastawq.moe_route(x, residual.contiguous(), norm_weight.contiguous(), eps, offset,
                                                   router_weight, k, renormalize, scoring, correction_bias, scale)
        return h, r, w, ids
    if backend == "triton" and _backend.NORM_ROUTE_FUSED and x.shape[0] <= _backend.ROUTE_FUSED_MAX_T:
        w, ids, h, r = _triton().norm_route(x, residual, norm_weight, eps, offset, router_weight, k, renormalize,
                                            scoring, correction_bias=correction_bias, scale=scale)
        return h, r, w, ids
    h, r = _add_rms_norm_impl(x, residual, norm_weight, eps, offset, backend)
    w, ids = _route_impl(h, router_weight, k, renormalize, scoring, correction_bias, scale, backend)
    return h, r, w, ids


_add_rms_norm_route_op = torch.library.custom_op("fastawq::add_rms_norm_route", _add_rms_norm_route_impl,
                                                 mutates_args=())


@_add_rms_norm_route_op.register_fake
def _(x, residual, norm_weight, eps, offset, router_weight, k, renormalize, scoring, correction_bias, scale, backend):
    torch._check(residual.shape == x.shape, lambda: f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
    t = x.shape[0]
    # h and the new residual come in the residual's dtype (x may be fp32 sums beside it).
    return (residual.new_empty(x.shape), residual.new_empty(x.shape), x.new_empty((t, k), dtype=torch.float32),
            x.new_empty((t, k), dtype=torch.int64))


def norm_route_takes_sums(x: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor, k: int,
                          scoring: str, correction_bias: torch.Tensor | None, backend: str | None) -> bool:
    """Whether add_rms_norm_route would run x, fp32 sums [T, H] beside a residual in norm_weight's
    dtype, on the compiled cluster router, the one form that reads them (FASTAWQ_MOE_O_SUMS)."""
    if not _ext.has_op("moe_route") or x.dtype != torch.float32:
        return False
    try:
        return _route_backend(x, router_weight, k, scoring, correction_bias, backend, _HALF, norm_weight) == "cuda"
    except Exception:  # a forced backend that cannot run here: the usual path says why
        return False


# x [T, H] · residual [T, H] · norm_weight [H] · router_weight [E, H]
#   ->  h [T, H] · x + residual [T, H] · topk_weights [T, k] fp32 · topk_ids [T, k] int64
def add_rms_norm_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
    router_weight: torch.Tensor, k: int, renormalize: bool = True, scoring: str = "softmax", *,
    correction_bias: torch.Tensor | None = None, scale: float = 1.0, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ops.add_rms_norm(x, residual, ...) and ops.route(h, ...) of an MoE block's input; on GPUs, with
    backend.NORM_ROUTE_FUSED, one Triton launch for both up to backend.ROUTE_FUSED_MAX_T tokens."""
    if x.dim() != 2 or residual.shape != x.shape or norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm_route needs x [T, H], residual like x and norm_weight [H], got x "
                         f"{tuple(x.shape)}, residual {tuple(residual.shape)}, norm_weight {tuple(norm_weight.shape)}")
    check_same_device(x=x, residual=residual, norm_weight=norm_weight)
    be = _route_backend(x, router_weight, k, scoring, correction_bias, backend, _HALF + (torch.float32,), norm_weight)
    return _call(torch.ops.fastawq.add_rms_norm_route, _add_rms_norm_route_impl, x, residual, norm_weight,
                 float(eps), float(offset), router_weight, k, renormalize, scoring, correction_bias, float(scale), be)


def _route_cuda_measured(x: torch.Tensor, e: int) -> bool:
    """Where the compiled router's cluster form runs and was measured faster than Triton's routing
    (backend.ROUTE_CUDA_EXPERTS)."""
    lo, hi = _backend.ROUTE_CUDA_EXPERTS
    h = x.shape[1]
    return lo <= e <= hi and h % 8 == 0 and h <= 4096 and _backend.is_sm90(x.device)


def _route_backend(x: torch.Tensor, router_weight: torch.Tensor, k: int, scoring: str,
                   correction_bias: torch.Tensor | None, backend: str | None, triton_dtypes: tuple = (),
                   norm_weight: torch.Tensor | None = None) -> str:
    """Validate route's inputs (errors name the shapes) and choose its backend; triton_dtypes, when
    given, are the x dtypes the Triton path takes; norm_weight, add_rms_norm_route's."""
    t, e = reference.check_route(x, router_weight)
    reference.check_topk_route(x.new_empty((0, e)), k, scoring, correction_bias)
    check_same_device(x=x, router_weight=router_weight, correction_bias=correction_bias)

    def fits(b: str) -> str | None:
        if b == "cuda":
            automatic = (backend or _backend.env_switch(b"FASTAWQ_BACKEND") or "auto") == "auto"
            if automatic and not _backend.ROUTE_CUDA:
                return "backend.ROUTE_CUDA is off (the automatic choice keeps Triton's routing)"
            if automatic and not _route_cuda_measured(x, e):
                lo, hi = _backend.ROUTE_CUDA_EXPERTS
                return (f"the automatic choice takes the compiled router on sm_90 for {lo} <= E <= {hi} "
                        f"and H % 8 == 0, H <= 4096 (where it was measured faster); E={e}, H={x.shape[1]}")
            # fp32 x: sums beside a half residual (FASTAWQ_MOE_O_SUMS), on the cluster form only.
            sums = x.dtype == torch.float32 and norm_weight is not None and norm_weight.dtype in _HALF
            act = norm_weight.dtype if sums else x.dtype
            if sums and not _route_cuda_measured(x, e):
                return ("the compiled router takes fp32 x (sums) only in its cluster form (sm_90, 16 <= E <= 128, "
                        f"H % 8 == 0, H <= 4096), got E={e}, H={x.shape[1]}")
            if act not in _HALF or router_weight.dtype != act or x.stride(-1) != 1:
                return (f"the compiled router takes fp16/bf16 x with unit column stride and the router in x's dtype, "
                        f"got x {x.dtype} {tuple(x.stride())}, router_weight {router_weight.dtype}")
            if norm_weight is not None and norm_weight.dtype != act:
                return f"the compiled router takes the norm weight in x's dtype {act}, got {norm_weight.dtype}"
            return torch.ops.fastawq.moe_route_declines(e, x.shape[1], k) or None
        if b == "triton" and triton_dtypes and x.dtype not in triton_dtypes:
            return f"x is {x.dtype}"
        return _triton().topk_route_fits(e, 1, scoring) if b == "triton" else None

    return select_backend("route", x.device, backend=backend, shapes_ok=fits, m=t)
