"""Element-wise and attention pieces of the fused decoder layer, each with a torch fallback.

`kernels` picks the implementation: "triton" (GPU, or CPU under TRITON_INTERPRET=1), "torch",
"cuda" (the compiled decode-attention kernel of fastawq._C; Triton for the ops that have none),
or None = compiled, then Triton on CUDA when present, torch elsewhere (the interpreter is a test
vehicle, never chosen automatically, as in backend.select_backend). FASTAWQ_BACKEND sets the
same choice for every call (cpu means torch here).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from fastawq import _ext
from fastawq.backend import BackendUnavailableError, triton_available, triton_interpreting

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


_ENV_KERNELS = {"torch": "torch", "cpu": "torch", "triton": "triton", "cuda": "cuda"}


def _forced(kernels: str | None) -> str | None:
    forced = kernels or _ENV_KERNELS.get(os.environ.get("FASTAWQ_BACKEND", ""), None)
    if forced not in (None, "auto", "cuda", "triton", "torch"):
        raise ValueError(f"kernels={forced!r}; choose 'cuda', 'triton', 'torch' or None")
    return None if forced == "auto" else forced


def use_triton(device: torch.device, kernels: str | None) -> bool:
    """Triton (else torch) for the ops without a compiled kernel; "cuda" means GPU kernels there."""
    forced = _forced(kernels)
    if forced == "cuda":
        forced = None
    if forced == "torch":
        return False
    if forced == "triton":
        if not triton_available():
            raise RuntimeError("kernels='triton' but triton is not installed")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(f"kernels='triton' on {device} needs TRITON_INTERPRET=1")
        return True
    return device.type == "cuda" and triton_available()


_FAKES = False


def _register_fakes() -> None:
    """Output shapes of the compiled attention ops, for torch.compile and opcheck."""
    global _FAKES
    if _FAKES:
        return
    _FAKES = True
    try:
        torch.library.register_fake("fastawq::decode_attention")(
            lambda q, k_cache, v_cache, lens, scale: q.new_empty(q.shape)
        )
        torch.library.register_fake("fastawq::decode_attention_out")(
            lambda q, k_cache, v_cache, lens, scale, out: None
        )
    except RuntimeError:  # registered elsewhere already
        pass


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def cuda_decode_declines(q: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor) -> str | None:
    """None when the compiled decode-attention kernel takes these shapes and dtypes, else why not."""
    d, hq, hkv = q.shape[-1], q.shape[-2], k_cache.shape[-2]
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype:
        return f"q {q.dtype} / cache {k_cache.dtype}: the kernel takes fp16 or bf16"
    if d not in (64, 128, 256):
        return f"head_dim {d} (the kernel takes 64, 128, 256)"
    if hq % hkv or hq // hkv > 8:
        return f"{hq} query heads over {hkv} KV heads (at most 8 per KV head)"
    if lens.dtype != torch.int32:
        return f"lens is {lens.dtype}, not int32"
    if not (_aligned(q) and _aligned(k_cache)):
        return "q or the caches are not 16-byte aligned rows"
    return None


def _why_not_cuda_decode(q: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor) -> str | None:
    if q.device.type != "cuda":
        return f"q is on {q.device}"
    if not _ext.has_op("decode_attention"):
        return _ext.status()["reason"] or "the compiled extension has no op 'decode_attention'"
    if not _ext.supports_device(q.device):
        return f"fastawq._C was built for {_ext.built_archs()}, not this GPU"
    _register_fakes()
    return cuda_decode_declines(q, k_cache, lens)


def decode_attention_backend(
    q: torch.Tensor, k_cache: torch.Tensor, lens: torch.Tensor, kernels: str | None = None
) -> str:
    """"cuda", "triton" or "torch" for one decode_attention call (compiled > Triton > torch)."""
    forced = _forced(kernels)
    if forced == "cuda":
        reason = _why_not_cuda_decode(q, k_cache, lens)
        if reason is not None:
            raise BackendUnavailableError(f"kernels='cuda' cannot run decode_attention: {reason}")
        return "cuda"
    if forced is None and q.device.type == "cuda" and _why_not_cuda_decode(q, k_cache, lens) is None:
        return "cuda"
    return "triton" if use_triton(q.device, forced) else "torch"


@functools.lru_cache(maxsize=None)
def _tk():
    import triton
    import triton.language as tl

    from fastawq.triton_kernels import attention

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, n, eps, offset,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            # Round the sum to the activation dtype first: the residual stream is stored in it.
            x = x + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        y = xf * tl.rsqrt(var + eps) * w
        tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def act_mul_kernel(gu_ptr, out_ptr, inter, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))
        else:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        tl.store(out_ptr + row * inter + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    return triton, add_rms_norm_kernel, act_mul_kernel, attention


# x [..., H] · residual [..., H] or None · weight [H]  ->  (y [..., H], residual' = x + residual)
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    *,
    kernels: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) * (weight + offset), and the new residual stream (x + residual).

    offset is 1.0 for Gemma's (1 + weight) norms."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match hidden size {h} of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if not use_triton(x.device, kernels):
        r = x if residual is None else x + residual
        rf = r.float()
        y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)
        return y.to(x.dtype), r
    triton, kernel, _, _ = _tk()
    x2 = x.reshape(-1, h).contiguous()
    y = torch.empty_like(x2)
    if residual is None:
        res_in, res_out = x2, x2
    else:
        res_in = residual.reshape(-1, h).contiguous()
        res_out = torch.empty_like(x2)
    block = triton.next_power_of_2(h)
    kernel[(x2.shape[0],)](
        x2, res_in, weight, y, res_out, h, eps, offset,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return y.reshape(x.shape), res_out.reshape(x.shape)


# gate_up [..., 2I] (gate columns, then up columns)  ->  act(gate) * up [..., I]
def act_mul(gate_up: torch.Tensor, act: str = "silu", *, kernels: str | None = None) -> torch.Tensor:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not fused; supported: {ACTIVATIONS}")
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must have an even last dimension")
    inter = two_i // 2
    if not use_triton(gate_up.device, kernels):
        g, u = gate_up.float().split(inter, dim=-1)
        if act == "silu":
            a = F.silu(g)
        else:
            a = F.gelu(g, approximate="tanh" if act == "gelu_pytorch_tanh" else "none")
        return (a * u).to(gate_up.dtype)
    triton, _, kernel, _ = _tk()
    gu = gate_up.reshape(-1, two_i).contiguous()
    out = torch.empty(gu.shape[0], inter, device=gu.device, dtype=gu.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    kernel[(gu.shape[0], triton.cdiv(inter, block))](
        gu, out, inter, ACT=ACTIVATIONS.index(act), BLOCK=block, num_warps=4
    )
    return out.reshape(*gate_up.shape[:-1], inter)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# qkv [B, L, (HQ + 2 HKV) D] · positions [B, L] int32 · cos/sin [S, D] fp32 · caches [B', S, HKV, D]
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
    *,
    kernels: str | None = None,
) -> torch.Tensor:
    """Rotate q, k; write k, v into the caches at `positions`; return q [B, L, HQ, D]."""
    if use_triton(qkv.device, kernels):
        return _tk()[3].rope_kv_cache(
            qkv, positions, cos, sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
            q_norm_weight, k_norm_weight, eps,
        )
    b, seq, _ = qkv.shape
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(b, seq, num_heads, head_dim)
    k = k.reshape(b, seq, num_kv_heads, head_dim)
    v = v.reshape(b, seq, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            tf = t.float()
            n = (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)
            return (n.float() * w.float()).to(t.dtype)

        q, k = norm(q, q_norm_weight), norm(k, k_norm_weight)
    pos = positions.long()
    c = cos[pos].unsqueeze(2)  # [B, L, 1, D]
    s = sin[pos].unsqueeze(2)
    q = _rotate(q.float(), c, s).to(qkv.dtype)
    k = _rotate(k.float(), c, s).to(k_cache.dtype)
    rows = torch.arange(b, device=qkv.device).unsqueeze(1).expand(b, seq)
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v.to(v_cache.dtype)
    return q


# q [B, HQ, D] · caches [B', S, HKV, D] · lens [B] int32  ->  [B, HQ, D]
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    max_len: int | None = None,
    kernels: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row over its first lens[b] cached positions, into `out` if given.

    The torch path needs `max_len` (a host int >= every lens[b]) to bound the keys it reads;
    the CUDA and Triton kernels read lens on the device (CUDA-graph safe)."""
    backend = decode_attention_backend(q, k_cache, lens, kernels)
    if backend == "cuda":
        if out is None:
            return torch.ops.fastawq.decode_attention(q, k_cache, v_cache, lens, scale)
        torch.ops.fastawq.decode_attention_out(q, k_cache, v_cache, lens, scale, out)
        return out
    if backend == "triton":
        return _tk()[3].decode_attention(q, k_cache, v_cache, lens, scale, out=out)
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
    o = torch.einsum("bhgn,bnhd->bhgd", scores.softmax(-1), v).reshape(b, hq, d).to(q.dtype)
    if out is None:
        return o
    return out.copy_(o)


# q [B, L, HQ, D] · caches [B', S, HKV, D]: queries at positions start .. start+L-1 of every row
def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Causal attention of L new tokens over the cache (SDPA; flash on GPU when start == 0)."""
    b, seq, hq, d = q.shape
    end = start + seq
    k = k_cache[:b, :end].transpose(1, 2)
    v = v_cache[:b, :end].transpose(1, 2)
    qt = q.transpose(1, 2)
    if hq != k.shape[1]:
        # Expanded K/V (a few MB) rather than enable_gqa, which some SDPA backends do not take:
        # the math fallback would materialise L x L scores per head.
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    if start == 0:
        out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale)
    else:
        qpos = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)

