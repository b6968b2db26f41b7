"""The compiled decode-attention kernel (csrc/attention) against SDPA in float64 on the expanded
K/V, and the dispatch in fastawq.ops (backend.select_backend) that chooses it. GPU tests skip
without CUDA or fastawq._C."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fastawq import _ext
from fastawq.backend import BackendUnavailableError
from fastawq import ops, reference

HAS_CUDA = torch.cuda.is_available()
HAS_OP = HAS_CUDA and _ext.has_op("decode_attention") and _ext.supports_device(torch.device("cuda"))
_skip = pytest.mark.skipif(
    not HAS_OP, reason="needs a CUDA device and fastawq._C with decode_attention built for it"
)


def needs_op(fn):
    return pytest.mark.gpu(_skip(fn))


DTYPES = [torch.float16, torch.bfloat16]
HEADS = [(32, 8), (8, 8), (14, 2)]  # Llama-3-8B, no GQA, Qwen2-1.5B (7 query heads per KV head)
S = 1100
# Lengths straddle the 16-key tiles and 64-key warp rounds; rows of one batch differ.
LENS = [(1,), (63,), (64,), (65,), (1000,), (S,), (1, 1000, 65), (63, S, 64)]


def _caches(b: int, s: int, hkv: int, d: int, dtype, lens, seed: int = 0):
    """Random q-independent caches of B + 1 rows; every position a row must not read is garbage
    (NaN, or a value large enough to swamp the softmax), and so is the extra row."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(b + 1, s, hkv, d, generator=gen)
    v = torch.randn(b + 1, s, hkv, d, generator=gen)
    for i, n in enumerate(list(lens) + [0]):
        k[i, n::2] = float("nan")
        v[i, n::2] = 3e4
        k[i, n + 1::2] = 3e4
        v[i, n + 1::2] = float("nan")
    return k.to("cuda", dtype), v.to("cuda", dtype)


def _oracle(q, k, v, lens, scale, dtype=torch.float64):
    """SDPA per row over its first lens[b] keys, K/V expanded to the query heads, in `dtype`."""
    out = []
    group = q.shape[1] // k.shape[2]
    for i, n in enumerate(lens.tolist()):
        kk = k[i, :n].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        vv = v[i, :n].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(q[i, :, None].to(dtype), kk, vv, scale=scale)[:, 0])
    return torch.stack(out)


def _check(got, q, k, v, lens, scale):
    """Error against float64 within a small multiple of torch's own SDPA in q's dtype."""
    want = _oracle(q, k, v, lens, scale)
    same = _oracle(q, k, v, lens, scale, dtype=q.dtype)
    assert torch.isfinite(got).all(), "non-finite output: garbage past a length was read, or out was not written"
    err = (got.double() - want).abs().max().item()
    ref_err = (same.double() - want).abs().max().item()
    eps = torch.finfo(q.dtype).eps
    bound = 4 * ref_err + 2 * eps * want.abs().max().item()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g} (torch {q.dtype}: {ref_err:.3g})"


def _poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the caching allocator's free blocks, so an unwritten output shows up as NaN."""
    torch.empty(numel + 4096, dtype=dtype, device="cuda").fill_(float("nan"))


@needs_op
@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_sdpa(dtype, d, heads, lens):
    hq, hkv = heads
    b = len(lens)
    k, v = _caches(b, S, hkv, d, dtype, lens, seed=d + hq + b)
    q = torch.randn(b, hq, d, device="cuda").to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    torch.ops.fastawq.decode_attention_out(q, k, v, lens_t, scale, out)
    _check(out, q, k, v, lens_t, scale)
    _poison_allocator(q.numel(), dtype)
    _check(torch.ops.fastawq.decode_attention(q, k, v, lens_t, scale), q, k, v, lens_t, scale)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 2, 8])
def test_decode_attention_llama3_8b_long_cache(dtype, b):
    # Cache capacity of 8192: the most splits, and lengths anywhere in it.
    _out_matches_sdpa(8192, 32, 8, 128, dtype, [8192, 4097, 17, 4096, 1, 2049, 8191, 300][:b], seed=b)


def _out_matches_sdpa(s, hq, hkv, d, dtype, lens, seed):
    """decode_attention_out into a NaN-poisoned out, against SDPA."""
    b = len(lens)
    k, v = _caches(b, s, hkv, d, dtype, lens, seed=seed)
    q = torch.randn(b, hq, d, device="cuda").to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    torch.ops.fastawq.decode_attention_out(q, k, v, lens_t, d ** -0.5, out)
    _check(out, q, k, v, lens_t, d ** -0.5)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_peaky_scores(dtype):
    # Scores of std ~40 growing along the sequence: the running max moves in every tile and the
    # splits' maxima differ by hundreds (log2 units), which the combine must rescale exactly.
    b, s, hq, hkv, d = 2, 2048, 8, 2, 128
    lens = (2048, 777)
    k, v = _caches(b, s, hkv, d, dtype, lens, seed=3)
    ramp = torch.linspace(0.5, 2.0, s, device="cuda")[None, :, None, None]
    k = (k.float() * ramp).to(dtype)
    q = (4 * torch.randn(b, hq, d, device="cuda")).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.ops.fastawq.decode_attention(q, k, v, lens_t, 1.0)
    _check(out, q, k, v, lens_t, 1.0)


@needs_op
def test_decode_attention_strided_views():
    # Heads of q and the caches as views into wider buffers (strides of a fused QKV layout).
    b, s, hq, hkv, d = 3, 300, 8, 2, 64
    lens = (300, 5, 131)
    kv, _ = _caches(b, s, 2 * hkv, d, torch.float16, lens)
    k, v = kv[..., :hkv, :], kv[..., hkv:, :]
    qbuf = torch.randn(b, hq + 4, d, device="cuda").half()
    q = qbuf[:, 2:2 + hq]
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    obuf = torch.full((b, hq, 2 * d), float("nan"), device="cuda", dtype=torch.float16)
    out = obuf[..., :d]
    torch.ops.fastawq.decode_attention_out(q, k, v, lens_t, 0.1, out)
    _check(out, q, k, v, lens_t, 0.1)
    assert obuf[..., d:].isnan().all(), "wrote outside out"


@needs_op
def test_decode_attention_zero_length_gives_zeros():
    q = torch.randn(2, 8, 128, device="cuda").half()
    k, v = _caches(2, 64, 2, 128, torch.float16, (0, 0))
    out = torch.ops.fastawq.decode_attention(q, k, v, torch.zeros(2, dtype=torch.int32, device="cuda"), 0.1)
    assert (out == 0).all()


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_cuda_graph_replay(dtype):
    # One capture, then lengths changed on the device between replays: the grid is sized from
    # the cache capacity and the arrival counters re-arm, so every replay must be exact.
    b, s, hq, hkv, d = 2, 2048, 32, 8, 128
    k, v = _caches(b, s, hkv, d, dtype, (s, s))
    q = torch.randn(b, hq, d, device="cuda").to(dtype)
    lens = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.decode_attention(q, k, v, lens, d ** -0.5, backend="cuda", out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.decode_attention(q, k, v, lens, d ** -0.5, backend="cuda", out=out)
        functional = ops.decode_attention(q, k, v, lens, d ** -0.5, backend="cuda")
    for new in [(1, 1), (64, 65), (2048, 1000), (128, 129), (17, 2047), (3, 3), (1500, 2048)]:
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        _check(out, q, k, v, lens, d ** -0.5)
        _check(functional, q, k, v, lens, d ** -0.5)


@needs_op
@pytest.mark.parametrize("b,lens", [(1, (65,)), (1, (128,)), (1, (512,)), (1, (513,)), (1, (1100,)), (2, (300, 1)),
                                    (3, (1100, 63, 1000)), (16, tuple(range(60, 1100, 66))[:16])])
@pytest.mark.parametrize("heads", [(32, 8), (32, 4), (14, 2)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cluster", ["0", "1"])
def test_decode_attention_cluster_combine(monkeypatch, cluster, dtype, d, heads, b, lens):
    # FASTAWQ_ATTN_CLUSTER=1: splits in clusters of up to 8 (Llama / Qwen3 / Qwen2 heads at batch 1:
    # 32 splits, clusters of 8; batch 16: 3 or 5 splits, one cluster), combining in distributed
    # shared memory while the working splits fit in the first cluster (65-512 keys) and through
    # the global partials past it (513, 1100); every block of a cluster takes its barriers. "0": the
    # global combine everywhere (unset: clusters where rows x KV heads <= 16).
    monkeypatch.setenv("FASTAWQ_ATTN_CLUSTER", cluster)
    hq, hkv = heads
    assert len(lens) == b
    _out_matches_sdpa(S, hq, hkv, d, dtype, list(lens), seed=d + hq + b)


@needs_op
def test_decode_attention_cluster_graph_replay(monkeypatch):
    # One capture with the cluster launch; replays whose lengths move between the cluster combine,
    # the global one and a single split.
    monkeypatch.setenv("FASTAWQ_ATTN_CLUSTER", "1")
    b, s, hq, hkv, d, dtype = 1, 4096, 32, 4, 128, torch.bfloat16
    k, v = _caches(b, s, hkv, d, dtype, (s,))
    q = torch.randn(b, hq, d, device="cuda").to(dtype)
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ops.decode_attention(q, k, v, lens, d ** -0.5, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k, v, lens, d ** -0.5, backend="cuda")
    for new in (128, 4096, 65, 64, 1, 511, 2000, 129):
        lens.fill_(new)
        out.fill_(float("nan"))
        graph.replay()
        _check(out, q, k, v, lens, d ** -0.5)


@needs_op
def test_decode_attention_matches_triton():
    b, s, hq, hkv, d = 3, 1000, 32, 8, 128
    lens = (999, 1, 513)
    k, v = _caches(b, s, hkv, d, torch.float16, lens)
    q = torch.randn(b, hq, d, device="cuda").half()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert ops.decode_attention_backend(q, k, lens_t) == "cuda"
    got = ops.decode_attention(q, k, v, lens_t, 0.09)
    tri = ops.decode_attention(q, k, v, lens_t, 0.09, backend="triton")
    torch.testing.assert_close(got, tri, rtol=3e-3, atol=3e-3)


@needs_op
def test_decode_attention_opcheck():
    b, s, hq, hkv, d = 2, 128, 8, 2, 64
    k, v = _caches(b, s, hkv, d, torch.float16, (100, 7))
    q = torch.randn(b, hq, d, device="cuda").half()
    lens = torch.tensor([100, 7], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.fastawq.decode_attention.default, (q, k, v, lens, 0.125))
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.fastawq.decode_attention_out.default, (q, k, v, lens, 0.125, out))


def _err(fn, match):
    with pytest.raises(RuntimeError, match=match):
        fn()


@needs_op
def test_decode_attention_error_messages():
    op, op_out = torch.ops.fastawq.decode_attention, torch.ops.fastawq.decode_attention_out
    q = torch.randn(2, 32, 128, device="cuda").half()
    k = torch.randn(2, 64, 8, 128, device="cuda").half()
    lens = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    shapes = r"q \[2, 32, 128\], k_cache \[2, 64, 8, 128\]"
    _err(lambda: op(q, k, k, lens.long(), 0.1), shapes + r".*lens must be int32, got Long")
    _err(lambda: op(q.float(), k, k, lens, 0.1), r"q must be fp16 or bf16, got Float")
    _err(lambda: op(q, k.bfloat16(), k.bfloat16(), lens, 0.1), r"must have q's dtype Half, got BFloat16")
    _err(lambda: op(q[..., :96].contiguous(), k[..., :96].contiguous(), k[..., :96].contiguous(), lens, 0.1),
         r"head_dim D=96 is not supported")
    _err(lambda: op(q[:, :30].contiguous(), k, k, lens, 0.1), r"HQ=30 query heads are not a multiple of HKV=8")
    _err(lambda: op(q, k[:, :, :2].contiguous(), k[:, :, :2].contiguous(), lens, 0.1),
         r"16 query heads per KV head \(HQ=32, HKV=2\); at most 8")
    _err(lambda: op(q, k, k[:, :32], lens, 0.1), r"k_cache and v_cache must have one shape")
    _err(lambda: op(q, k[:1], k[:1], lens[:1], 0.1), r"the caches hold 1 rows, q has B=2")
    _err(lambda: op(q, k, k, lens[:1], 0.1), r"lens must be a contiguous \[B\] = \[2\] tensor")
    _err(lambda: op(q, k, k, lens.cpu(), 0.1), r"must be on one CUDA device")
    _err(lambda: op(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, lens, 0.1), r"q \(strides \[4096, 1, 32\]\)")
    _err(lambda: op_out(q, k, k, lens, 0.1, torch.empty(2, 32, 64, device="cuda").half()),
         r"out \[2, 32, 64\] Half on cuda:0 must match q \[2, 32, 128\]")
    _err(lambda: op_out(q, k, k, lens, 0.1, q), r"out must not share memory with q")


def _w4_model(model):
    """The decoder layers' attention and MLP Linears as 4-bit WQLinear (group 32), fp16, on the GPU."""
    from fastawq.modules import WQLinear

    model.eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, mod in list(parent.named_children()):
                    if isinstance(mod, torch.nn.Linear):
                        setattr(parent, name, WQLinear.from_linear(mod.half(), 32))
    return model.half().cuda()


@needs_op
def test_fused_model_cuda_kernel_matches_unfused():
    # A Llama of head_dim 64 (the tiny models of test_fused have 16, which the kernel declines),
    # decoded as CUDA-graph replays with the compiled attention against transformers.
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fastawq.generate import HFStepper
    from fastawq.modules.fused import fuse_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    ref = _w4_model(AutoModelForCausalLM.from_config(cfg))
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=300, batch_size=2, backend="cuda", use_cuda_graphs=True)
    rt, hf = fused.fastawq_runtime, HFStepper(ref)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), device="cuda")
    lf, lr = rt.prefill(ids)[:, -1], hf.prefill(ids)
    for _ in range(40):  # lengths 71..110: across tile and split edges
        tok = lr.argmax(-1)
        lf, lr = rt.decode(tok), hf.decode(tok)
        assert torch.isfinite(lf).all()
        assert float((lf.float() - lr.float()).norm() / lr.float().norm()) < 1e-2


# --- the rope form: rope_kv_cache and decode attention in one launch ----------------------------

HAS_ROPE_OP = HAS_OP and _ext.has_op("rope_decode_attention")
_skip_rope = pytest.mark.skipif(
    not HAS_ROPE_OP, reason="needs a CUDA device and fastawq._C with rope_decode_attention built for it")


def needs_rope_op(fn):
    return pytest.mark.gpu(_skip_rope(fn))


def _rope_tables(s: int, d: int, device="cuda", base: float = 10000.0):
    """HF's rotate-half tables [S, D] fp32 (each frequency twice)."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().float().to(device).contiguous(), emb.sin().float().to(device).contiguous()


def _rope_case(b, hq, hkv, d, dtype, lens, positions, qk_norm, s=1100, seed=0):
    """qkv rows (a view with a wider row stride), positions [B, 1], lens, tables, norm weights and
    caches whose rows at the new positions are NaN (the op must write them)."""
    gen = torch.Generator().manual_seed(seed)
    w = (hq + 2 * hkv) * d
    qkv = torch.randn(b, 1, w + 8, generator=gen).to("cuda", dtype)[..., :w]
    k, v = _caches(b, s, hkv, d, dtype, lens, seed=seed)
    pos = torch.tensor(positions, dtype=torch.int32, device="cuda").reshape(b, 1)
    for i, p in enumerate(positions):
        k[i, p], v[i, p] = float("nan"), float("nan")
    cos, sin = _rope_tables(s, d)
    qn = kn = None
    if qk_norm:
        qn = (1 + 0.2 * torch.randn(d, generator=gen)).to("cuda", dtype)
        kn = (1 + 0.2 * torch.randn(d, generator=gen)).to("cuda", dtype)
    return qkv, pos, torch.tensor(lens, dtype=torch.int32, device="cuda"), cos, sin, qn, kn, k, v


def _check_rope_form(got, kc, vc, want, before_k, before_v, positions, lens, scale):
    """The written rows within one rounding of rope_kv_cache's, every other cache byte unchanged,
    and the output against SDPA over the reference caches with the reference's q."""
    q, want_k, want_v = want
    for i, p in enumerate(positions):
        torch.testing.assert_close(kc[i, p], want_k[i, p], rtol=2 * torch.finfo(kc.dtype).eps, atol=1e-3)
        assert torch.equal(vc[i, p], want_v[i, p]), f"row {i}: V at {p} is not qkv's V"
    keep = torch.ones(kc.shape[:2], dtype=torch.bool, device=kc.device)
    for i, p in enumerate(positions):
        keep[i, p] = False
    assert torch.equal(kc[keep].view(torch.int16), before_k[keep].view(torch.int16)), "wrote outside the new rows"
    assert torch.equal(vc[keep].view(torch.int16), before_v[keep].view(torch.int16)), "wrote outside the new rows"
    _check(got, q, want_k, want_v, lens, scale)


def _reference_rope(qkv, pos, cos, sin, k, v, hq, hkv, d, qn, kn):
    """rope_kv_cache's reference on copies of the caches: (q [B, HQ, D], k, v)."""
    want_k, want_v = k.clone(), v.clone()
    q = reference.rope_kv_cache(qkv, pos, cos, sin, want_k, want_v, hq, hkv, d, qn, kn, 1e-6)
    return q.reshape(qkv.shape[0], hq, d), want_k, want_v


@needs_rope_op
@pytest.mark.parametrize("lens", [(1,), (64,), (65,), (200, 1), (1100, 63, 1000)])
@pytest.mark.parametrize("heads,qk_norm", [((32, 4), True), ((14, 2), False), ((8, 8), True), ((32, 8), False)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_decode_attention_matches_the_two_ops(dtype, d, heads, qk_norm, lens):
    hq, hkv = heads
    b = len(lens)
    positions = [n - 1 for n in lens]  # a decode step: the new token is the last key
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(b, hq, hkv, d, dtype, lens, positions, qk_norm, seed=d + hq)
    want = _reference_rope(qkv, pos, cos, sin, k, v, hq, hkv, d, qn, kn)
    before_k, before_v = k.clone(), v.clone()
    _poison_allocator(b * hq * d, dtype)
    got = torch.ops.fastawq.rope_decode_attention(qkv, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, d ** -0.5)
    assert got.shape == (b, hq, d) and got.dtype == dtype
    _check_rope_form(got, k, v, want, before_k, before_v, positions, lens_t, d ** -0.5)


@needs_rope_op
@pytest.mark.parametrize("lens", [(65,), (128,), (200, 1), (600,)])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_decode_attention_cluster_combine(monkeypatch, d, lens):
    monkeypatch.setenv("FASTAWQ_ATTN_CLUSTER", "1")
    hq, hkv, dtype = 32, 4, torch.bfloat16
    b = len(lens)
    positions = [n - 1 for n in lens]
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(b, hq, hkv, d, dtype, lens, positions, True, seed=d)
    want = _reference_rope(qkv, pos, cos, sin, k, v, hq, hkv, d, qn, kn)
    before_k, before_v = k.clone(), v.clone()
    got = torch.ops.fastawq.rope_decode_attention(qkv, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, d ** -0.5)
    _check_rope_form(got, k, v, want, before_k, before_v, positions, lens_t, d ** -0.5)


@needs_rope_op
def test_rope_decode_attention_new_row_past_the_length():
    # A position at or past the length: the row is written, and no key of the output reads it.
    hq, hkv, d, dtype = 16, 4, 128, torch.float16
    lens, positions = (65, 3, 0), (99, 1, 5)
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(3, hq, hkv, d, dtype, lens, positions, True)
    want = _reference_rope(qkv, pos, cos, sin, k, v, hq, hkv, d, qn, kn)
    before_k, before_v = k.clone(), v.clone()
    got = torch.ops.fastawq.rope_decode_attention(qkv, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.1)
    _check_rope_form(got, k, v, want, before_k, before_v, positions, lens_t, 0.1)
    assert (got[2] == 0).all(), "a row of length 0 gives zeros"


@needs_rope_op
def test_rope_decode_attention_in_a_cuda_graph():
    # One capture; positions and lengths move on the device between replays, as in decode.
    hq, hkv, d, dtype, s = 32, 4, 128, torch.bfloat16, 1024
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(2, hq, hkv, d, dtype, (10, 20), (9, 19), True, s=s)
    k.normal_(), v.normal_()  # every position holds a key: the replays' lengths reach the capacity
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.rope_decode_attention(qkv, pos, cos, sin, k, v, lens_t, hq, hkv, d, 0.1, qn, kn, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.rope_decode_attention(qkv, pos, cos, sin, k, v, lens_t, hq, hkv, d, 0.1, qn, kn, backend="cuda")
    for new in [(1, 64), (65, 129), (1024, 300), (513, 2)]:
        positions = [n - 1 for n in new]
        lens_t.copy_(torch.tensor(new, dtype=torch.int32))
        pos.copy_(torch.tensor(positions, dtype=torch.int32).reshape(2, 1))
        qkv.normal_()
        for i, p in enumerate(positions):
            k[i, p], v[i, p] = float("nan"), float("nan")
        want = _reference_rope(qkv, pos, cos, sin, k, v, hq, hkv, d, qn, kn)
        before_k, before_v = k.clone(), v.clone()
        graph.replay()
        _check_rope_form(out, k, v, want, before_k, before_v, positions, lens_t, 0.1)


@needs_rope_op
@pytest.mark.parametrize("lens", [(1,), (65,), (200, 1), (1100, 63, 1000)])
@pytest.mark.parametrize("heads,qk_norm,d", [((32, 4), True, 128), ((14, 2), False, 64), ((32, 8), False, 128),
                                             ((8, 8), True, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_decode_attention_reads_fp32_qkv_sums(dtype, d, heads, qk_norm, lens):
    # qkv as the QKV projection's fp32 sums (FASTAWQ_QKV_SUMS): the kernel rounds them to the caches'
    # dtype as it reads them, so output and cache rows are bit-for-bit those of qkv rounded first.
    # Sums with low bits the rounding drops, ~1e3 in size; the row has a pad (stride != width).
    hq, hkv = heads
    b = len(lens)
    positions = [n - 1 for n in lens]
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(b, hq, hkv, d, dtype, lens, positions, qk_norm, seed=d + 3)
    w = qkv.shape[-1]
    gen = torch.Generator().manual_seed(hq + d)
    sums = (torch.randn(b, 1, w + 8, generator=gen) * 300).to("cuda")[..., :w]
    k2, v2 = k.clone(), v.clone()
    _poison_allocator(b * hq * d, dtype)
    got = torch.ops.fastawq.rope_decode_attention(sums, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, d ** -0.5)
    want = torch.ops.fastawq.rope_decode_attention(sums.to(dtype), pos, cos, sin, k2, v2, lens_t, qn, kn, 1e-6, hq,
                                                   d ** -0.5)
    assert got.dtype == dtype and got.shape == (b, hq, d)
    assert torch.equal(got, want)
    # Bit patterns: the caches hold NaN garbage where no row may read (NaN != NaN under torch.equal).
    assert torch.equal(k.view(torch.int16), k2.view(torch.int16)), "K cache differs from qkv rounded first"
    assert torch.equal(v.view(torch.int16), v2.view(torch.int16)), "V cache differs from qkv rounded first"
    # The op's own path with fp32 qkv (the compiled launch where it serves, else rounded first).
    k3, v3 = k2.clone(), v2.clone()
    out = ops.rope_decode_attention(sums, pos, cos, sin, k3, v3, lens_t, hq, hkv, d, d ** -0.5, qn, kn)
    assert torch.equal(out, want)


@needs_rope_op
def test_rope_decode_attention_fp32_qkv_errors_name_the_dtypes():
    hq, hkv, d = 8, 2, 64
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(2, hq, hkv, d, torch.float16, (100, 7), (99, 6), True, s=128)
    op = torch.ops.fastawq.rope_decode_attention
    sums = qkv.float()
    torch.library.opcheck(op.default, (sums, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.125))
    _err(lambda: op(sums, pos, cos, sin, k.float(), v.float(), lens_t, qn, kn, 1e-6, hq, 0.1),
         r"with fp32 qkv sums the caches must be fp16 or bf16")
    _err(lambda: op(sums, pos, cos, sin, k, v, lens_t, qn.float(), kn.float(), 1e-6, hq, 0.1),
         r"norm weights must be .* in the caches' dtype")
    _err(lambda: torch.ops.fastawq.decode_attention(sums[:, 0, : hq * d].reshape(2, hq, d), k, v, lens_t, 0.1),
         r"q must be fp16 or bf16")


@needs_rope_op
def test_rope_decode_attention_opcheck_and_errors():
    hq, hkv, d = 8, 2, 64
    qkv, pos, lens_t, cos, sin, qn, kn, k, v = _rope_case(2, hq, hkv, d, torch.float16, (100, 7), (99, 6), True, s=128)
    op = torch.ops.fastawq.rope_decode_attention
    torch.library.opcheck(op.default, (qkv, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.125))
    shapes = r"rope_decode_attention \(qkv \[2, 1, 768\]"
    _err(lambda: op(qkv, pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq + 1, 0.1), shapes + r".*qkv's width 768 is not")
    _err(lambda: op(qkv, pos.long(), cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.1), r"positions must be a contiguous int32")
    _err(lambda: op(qkv, pos, cos.half(), sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.1), r"cos and sin must be contiguous")
    _err(lambda: op(qkv, pos, cos[:, :32].contiguous(), sin[:, :32].contiguous(), k, v, lens_t, qn, kn, 1e-6, hq, 0.1),
         r"fp32 \[S, 64\] tables")
    _err(lambda: op(qkv, pos, cos, sin, k, v, lens_t, qn, None, 1e-6, hq, 0.1), r"go together")
    _err(lambda: op(qkv, pos, cos, sin, k, v, lens_t, qn.float(), kn.float(), 1e-6, hq, 0.1), r"norm weights must be")
    _err(lambda: op(qkv.expand(2, 2, -1), pos, cos, sin, k, v, lens_t, qn, kn, 1e-6, hq, 0.1), r"one decode token a row")


@needs_rope_op
def test_fused_qwen3_decode_uses_the_rope_form(monkeypatch):
    # Qwen3 (q/k norms) decoded with CUDA graphs: the rope form serves each step, and the logits
    # follow the two-launch path's (backend.ROPE_ATTENTION_FUSED off) and transformers.
    from transformers import AutoModelForCausalLM, Qwen3Config

    from fastawq import backend
    from fastawq.generate import HFStepper
    from fastawq.modules.fused import fuse_model

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ref = _w4_model(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), device="cuda")
    from fastawq.ops import layer

    seen = []  # the lengths L of the rope_kv_cache launches
    real = layer.rope_kv_cache
    monkeypatch.setattr(layer, "rope_kv_cache", lambda qkv, *a, **k: (seen.append(qkv.shape[1]), real(qkv, *a, **k))[1])
    logits = {}
    for fused_rope in (True, False):
        seen.clear()
        backend.ROPE_ATTENTION_FUSED = fused_rope
        try:
            fused = fuse_model(copy.deepcopy(ref), max_seq_len=300, batch_size=2, backend="cuda", use_cuda_graphs=True)
            rt = fused.fastawq_runtime
            hf = HFStepper(ref)
            lf, lr = rt.prefill(ids)[:, -1], hf.prefill(ids)
            steps = []
            for _ in range(30):  # lengths 71..100: across tile and split edges
                tok = lr.argmax(-1)
                lf, lr = rt.decode(tok), hf.decode(tok)
                assert torch.isfinite(lf).all()
                assert float((lf.float() - lr.float()).norm() / lr.float().norm()) < 1e-2
                steps.append(lf.float())
            logits[fused_rope] = torch.stack(steps)
            # Prefill always runs rope_kv_cache; a decode step only without the rope form.
            assert (1 in seen) is not fused_rope, seen
        finally:
            backend.ROPE_ATTENTION_FUSED = True
    diff = float((logits[True] - logits[False]).norm() / logits[False].norm())
    assert diff < 2e-3, f"rope form vs two launches: relative difference {diff:.2g}"
    q = torch.randn(2, 1, (8 + 4) * 64, device="cuda").half()
    kc = torch.zeros(2, 300, 2, 64, device="cuda").half()
    assert ops.rope_attention_fused(q, kc, torch.ones(2, dtype=torch.int32, device="cuda"), 8)
    assert not ops.rope_attention_fused(q.expand(2, 2, -1), kc, torch.ones(2, dtype=torch.int32, device="cuda"), 8)


# --- CPU: the dispatch (runs in CI without a GPU) ---------------------------------------------


def _cpu_inputs(dtype=torch.float16, hq=8, hkv=2, d=64):
    q = torch.randn(2, hq, d).to(dtype)
    k = torch.randn(2, 16, hkv, d).to(dtype)
    return q, k, torch.tensor([16, 3], dtype=torch.int32)


def test_dispatch_falls_back_to_torch_without_the_op(monkeypatch):
    monkeypatch.delenv("FASTAWQ_BACKEND", raising=False)
    monkeypatch.setattr(_ext, "has_op", lambda name: False)
    q, k, lens = _cpu_inputs()
    assert ops.decode_attention_backend(q, k, lens) == "torch"
    assert ops.decode_attention_backend(q, k, lens, "torch") == "torch"
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run decode_attention: tensors are on cpu"):
        ops.decode_attention_backend(q, k, lens, "cuda")
    monkeypatch.setenv("FASTAWQ_BACKEND", "cpu")
    assert ops.decode_attention_backend(q, k, lens) == "torch"
    with pytest.raises(BackendUnavailableError, match="unknown backend 'cudnn'"):
        ops.decode_attention_backend(q, k, lens, "cudnn")


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,reason",
    [
        (torch.float16, 8, 2, 64, None),
        (torch.bfloat16, 32, 8, 128, None),
        (torch.float16, 8, 1, 256, None),
        (torch.float32, 8, 2, 64, "fp16 or bf16"),
        (torch.float16, 8, 2, 96, "head_dim 96"),
        (torch.float16, 32, 2, 64, "at most 8"),
    ],
)
def test_cuda_kernel_declines_what_it_cannot_take(dtype, hq, hkv, d, reason):
    q, k, lens = _cpu_inputs(dtype, hq, hkv, d)
    got = ops.cuda_decode_declines(q, k, lens)
    assert (got is None) if reason is None else (reason in got)


def test_torch_fallback_writes_out():
    q, k, lens = _cpu_inputs(torch.float32)
    v = torch.randn_like(k)
    out = torch.full_like(q, float("nan"))
    got = ops.decode_attention(q, k, v, lens, 0.2, backend="torch", out=out)
    assert got is out
    want = torch.stack([
        F.scaled_dot_product_attention(
            q[i, :, None], k[i, :n].transpose(0, 1).repeat_interleave(4, 0),
            v[i, :n].transpose(0, 1).repeat_interleave(4, 0), scale=0.2,
        )[:, 0]
        for i, n in enumerate(lens.tolist())
    ])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_decode_attention_falls_back_to_the_two_ops(qk_norm):
    # Off the compiled op (here: the CPU) it is rope_kv_cache, then decode_attention: bitwise.
    b, hq, hkv, d, s = 2, 8, 2, 64, 32
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, 1, (hq + 2 * hkv) * d, generator=gen).half()
    pos = torch.tensor([[5], [9]], dtype=torch.int32)
    lens = torch.tensor([6, 10], dtype=torch.int32)
    cos, sin = _rope_tables(s, d, "cpu")
    k, v = torch.randn(b, s, hkv, d, generator=gen).half(), torch.randn(b, s, hkv, d, generator=gen).half()
    qn = kn = None
    if qk_norm:
        qn, kn = (1 + 0.1 * torch.randn(2, d, generator=gen)).half().unbind(0)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    assert not ops.rope_attention_fused(qkv, k1, lens, hq)
    got = ops.rope_decode_attention(qkv, pos, cos, sin, k1, v1, lens, hq, hkv, d, 0.125, qn, kn, 1e-6, max_len=10)
    q = ops.rope_kv_cache(qkv, pos, cos, sin, k2, v2, hq, hkv, d, qn, kn, 1e-6)
    want = ops.decode_attention(q.reshape(b, hq, d), k2, v2, lens, 0.125, max_len=10)
    assert torch.equal(got, want) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(k1, k), "the new K rows were not written"
    with pytest.raises(ValueError, match="go together"):
        ops.rope_decode_attention(qkv, pos, cos, sin, k1, v1, lens, hq, hkv, d, 0.125, torch.ones(d).half(), None)


def test_rope_form_declines_inputs_it_does_not_convert(monkeypatch):
    # Where the compiled attention would serve, the rope form still declines fp32 norm weights,
    # non-fp32 tables and int64 positions: rope_kv_cache's launch converts those.
    from fastawq.ops import layer

    monkeypatch.setattr(layer._ext, "has_op", lambda name: True)
    monkeypatch.setattr(layer, "decode_attention_backend", lambda *a, **k: "cuda")
    hq, hkv, d = 8, 2, 64
    qkv = torch.zeros(2, 1, (hq + 2 * hkv) * d, dtype=torch.float16)
    kc = torch.zeros(2, 16, hkv, d, dtype=torch.float16)
    lens = torch.ones(2, dtype=torch.int32)
    pos = torch.zeros(2, 1, dtype=torch.int32)
    cos, sin = _rope_tables(16, d, "cpu")
    w = torch.ones(d, dtype=torch.float16)
    ok = dict(positions=pos, cos=cos, sin=sin, q_norm_weight=w, k_norm_weight=w)
    assert ops.rope_attention_fused(qkv, kc, lens, hq, **ok)
    for bad in (dict(positions=pos.long()), dict(cos=cos.half()), dict(sin=sin[:, :32].contiguous()),
                dict(q_norm_weight=w.float()), dict(k_norm_weight=torch.ones(d + 1, dtype=torch.float16)[1:])):
        assert not ops.rope_attention_fused(qkv, kc, lens, hq, **{**ok, **bad}), bad
    assert not ops.rope_attention_fused(qkv[:, :, :-8], kc, lens, hq, **ok)
