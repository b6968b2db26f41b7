"""Fused decoder layers against the unfused W4 model (same packed weights); the layer ops
themselves are tested against reference.py in test_layer_ops.py."""
import copy
import os

import pytest
import torch

from fastawq import ops
from fastawq.modules import WQLinear
from fastawq.modules.qlinear import set_layout
from fastawq.modules.fused import CacheOverflowError, fuse_model
from fastawq.generate import HFStepper

from conftest import spy_fp32_first_argument

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _config(arch: str, **over):
    """A tiny config of `arch`; `over` replaces COMMON's entries or adds others (e.g. head_dim)."""
    import transformers as tf

    common = {**COMMON, **over}
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 32, **common})
    if arch == "phi3":
        return tf.Phi3Config(**common, pad_token_id=0, sliding_window=None)
    if arch == "gemma":
        return tf.GemmaConfig(**{"head_dim": 16, **common, "num_key_value_heads": 1})
    raise ValueError(arch)


def tiny_w4_model(arch: str, seed: int = 0, device: str = "cpu", **over) -> torch.nn.Module:
    """A tiny transformers model whose decoder linears are RTN-packed WQLinear (g32), fp16; `over`
    as _config's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **over)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            # Non-trivial norm weights (Gemma's init to zero would hide a missing 1 + w).
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
            for parent in (layer.self_attn, layer.mlp):
                for name, mod in list(parent.named_children()):
                    if isinstance(mod, torch.nn.Linear):
                        if mod.bias is not None:
                            mod.bias.normal_(0, 0.1)
                        setattr(parent, name, WQLinear.from_linear(mod.half(), 32))
    return model.half().to(device)


# fp16 fused vs fp16 unfused: both round differently (rotary and norms in fp32 here, fp16 in
# transformers); seen ~2.5e-3 on these tiny models, a wrong norm, rope or cache slot gives ~1.
TOL = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _match_over_decode(arch: str, backend: str | None, steps: int, device: str = "cpu", graphs: bool = False,
                       batch: int = 2, layout: str | None = None, **over) -> None:
    ref = tiny_w4_model(arch, device=device, **over)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=64, batch_size=batch, backend=backend, use_cuda_graphs=graphs)
    if layout is not None:
        set_layout(fused, layout)  # after fusing, which concatenates AWQ tensors (as commands/bench.py)
    ids = torch.randint(0, COMMON["vocab_size"], (batch, 11), device=device)
    rt = fused.fastawq_runtime
    hf = HFStepper(ref)
    lf = rt.prefill(ids)[:, -1]
    lr = hf.prefill(ids)
    assert _rel(lf, lr) < TOL
    for _ in range(steps):
        tok = lr.argmax(-1)  # teacher-force both on the reference's choice
        lf, lr = rt.decode(tok), hf.decode(tok)
        assert torch.isfinite(lf).all()
        assert _rel(lf, lr) < TOL
    assert rt.length == 11 + steps


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_fused_matches_unfused_torch_ops(arch):
    _match_over_decode(arch, "torch", 32)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_matches_unfused_triton_ops(arch):
    # Under the interpreter on CPU this runs every Triton kernel of the layer; fewer steps keep CI short.
    _match_over_decode(arch, "triton", 32 if CUDA else 6, device="cuda" if CUDA else "cpu")


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_fused_cuda_graph_decode_matches_unfused(arch):
    _match_over_decode(arch, None, 32, device="cuda", graphs=True)


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "phi3"])
def test_fused_dense_sums_decode_matches_unfused(monkeypatch, arch):
    # FASTAWQ_DENSE_SUMS=1 (read at each call): o_proj and down add into fp32 sums that the norm before
    # each zeroes and the norm after each rounds (FusedDecoderLayer._forward_sums); decode with CUDA
    # graphs still matches transformers (Qwen2's biases, Gemma's offset norms and gelu, Phi-3's
    # fused gate_up), and the sums kernels ran where the compiled GEMV forms exist.
    from fastawq import _ext

    monkeypatch.setenv("FASTAWQ_DENSE_SUMS", "1")
    calls = []
    for name in ("awq_gemv_packed_sums", "awq_gemv_packed_act_sums"):
        if _ext.has_op(name):
            real = getattr(torch.ops.fastawq, name)

            def spy(*args, _real=real, _name=name):
                calls.append(_name)
                return _real(*args)

            monkeypatch.setattr(torch.ops.fastawq, name, spy)
    _match_over_decode(arch, None, 24, device="cuda", graphs=True, layout="packed")
    if _ext.has_op("awq_gemv_packed_sums"):
        assert set(calls) == {"awq_gemv_packed_sums", "awq_gemv_packed_act_sums"}


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_fused_dense_gu_sums_decode_matches_unfused(monkeypatch, arch):
    # FASTAWQ_DENSE_GU_SUMS=1 on top of the dense sums: gate_up adds into fp32 sums that o_proj's
    # launch zeroes (its `zero` argument) and the down projection's act prologue reads as fp32;
    # decode with CUDA graphs still matches transformers (Gemma: gelu, Phi-3: its own fused gate_up).
    from fastawq import _ext

    monkeypatch.setenv("FASTAWQ_DENSE_SUMS", "1")
    monkeypatch.setenv("FASTAWQ_DENSE_GU_SUMS", "1")
    zeroing, f32_gate_up = [], []
    if _ext.has_op("awq_gemv_packed_sums"):
        sums_op, act_op = torch.ops.fastawq.awq_gemv_packed_sums, torch.ops.fastawq.awq_gemv_packed_act_sums

        def sums_spy(*args):
            zeroing.append(len(args) > 7 and args[7] is not None)
            return sums_op(*args)

        def act_spy(gate_up, *args):
            f32_gate_up.append(gate_up.dtype == torch.float32)
            return act_op(gate_up, *args)

        monkeypatch.setattr(torch.ops.fastawq, "awq_gemv_packed_sums", sums_spy)
        monkeypatch.setattr(torch.ops.fastawq, "awq_gemv_packed_act_sums", act_spy)
    _match_over_decode(arch, None, 24, device="cuda", graphs=True, layout="packed")
    if _ext.has_op("awq_gemv_packed_sums"):
        assert any(zeroing) and f32_gate_up and all(f32_gate_up)


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
def test_fused_qkv_sums_decode_matches_unfused(monkeypatch, arch):
    # FASTAWQ_QKV_SUMS=1 on top of the dense sums: a decode step's QKV projection adds into fp32 sums
    # beside o_proj's (one buffer the input norm zeroes) and the compiled rope attention reads them;
    # decode with CUDA graphs still matches transformers (Qwen2: the QKV bias, added once; Qwen3: the
    # q/k norms of the rope form; Gemma: offset norms), and the rope form saw fp32 qkv.
    from fastawq import _ext

    # head_dim 64: the compiled decode attention takes 64, 128 or 256 (the default tiny heads, 16
    # and 32, take the two-op path, which never sees the sums).
    monkeypatch.setenv("FASTAWQ_DENSE_SUMS", "1")
    monkeypatch.setenv("FASTAWQ_QKV_SUMS", "1")
    f32_qkv = spy_fp32_first_argument(monkeypatch, "rope_decode_attention")
    _match_over_decode(arch, None, 24, device="cuda", graphs=True, layout="packed", head_dim=64)
    if _ext.has_op("awq_gemv_packed_sums") and _ext.has_op("rope_decode_attention"):
        assert any(f32_qkv)


def _spy_wgmma_rows(monkeypatch, op_name: str) -> tuple[bool, list[int]]:
    """(whether the wgmma ops run here, the rows of each call of torch.ops.fastawq.<op_name>, which
    is wrapped to record them where they run)."""
    from fastawq import _ext

    rows: list[int] = []
    runs = _ext.has_op(op_name) and not torch.ops.fastawq.awq_wgmma_packed_declines()
    if runs:
        real = getattr(torch.ops.fastawq, op_name)

        def spy(x, *args):
            rows.append(x.shape[0])
            return real(x, *args)

        monkeypatch.setattr(torch.ops.fastawq, op_name, spy)
    return runs, rows


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_wgmma_decode_matches_unfused(monkeypatch, arch):
    # backend.PACKED_WGMMA at every M (PACKED_WGMMA_MAX_M None): at a batch of 20, above the compiled
    # buckets, the fused engine's packed layers run awq_wgmma_packed for the prefill (220 rows) and
    # every decode step (20 rows), with CUDA graphs, and still match transformers (Qwen2: biases).
    # Where the op cannot run (no sm_90a build or not an sm_90 GPU) the plans fall back to Triton and
    # only the match is checked.
    from fastawq import backend as backend_mod

    monkeypatch.setattr(backend_mod, "PACKED_WGMMA", True)
    monkeypatch.setattr(backend_mod, "PACKED_WGMMA_MAX_M", None)
    runs, calls = _spy_wgmma_rows(monkeypatch, "awq_wgmma_packed")
    _match_over_decode(arch, None, 12, device="cuda", graphs=True, batch=20, layout="packed")
    if runs:
        assert {20, 220} <= set(calls)


@needs_cuda
@pytest.mark.parametrize("gu_sums", ["0", "1", None])
@pytest.mark.parametrize("arch, batch, head_dim", [("llama", 16, 64), ("qwen3", 16, 64), ("qwen2", 12, None),
                                                   ("phi3", 24, None), ("llama", 64, 64)])
def test_fused_wgmma_sums_decode_matches_unfused(monkeypatch, arch, batch, head_dim, gu_sums):
    # FASTAWQ_WGMMA_SUMS (the default): at the rows awq_wgmma_packed takes on sm_90 (batches 9-64), o_proj and down
    # add into fp32 sums (awq_wgmma_packed_sums) that the norms after them round, and with head_dim 64
    # (the compiled rope attention's) QKV too, which the rope attention reads as fp32; decode with CUDA
    # graphs still matches transformers (Qwen3: q/k norms; Qwen2: biases, added once; Phi-3: its fused
    # gate_up), and the sums op ran where it can (elsewhere only the match is checked). With
    # FASTAWQ_WGMMA_GU_SUMS "1" (unset: the default, except at 17-32 rows since session 39; "0" off)
    # gate_up adds into fp32 sums too, which act_mul_sums rounds: a layer's decode step then makes one
    # more sums call. Batch 64: the 64-token tile.
    from fastawq import _ext

    if gu_sums is None:
        monkeypatch.delenv("FASTAWQ_WGMMA_GU_SUMS", raising=False)
    else:
        monkeypatch.setenv("FASTAWQ_WGMMA_GU_SUMS", gu_sums)
    gu_on = gu_sums == "1" or (gu_sums is None and not 16 < batch <= 32)
    monkeypatch.setenv("FASTAWQ_DENSE_SUMS", "1")
    monkeypatch.setenv("FASTAWQ_QKV_SUMS", "1")
    monkeypatch.delenv("FASTAWQ_WGMMA_SUMS", raising=False)
    f32_qkv = spy_fp32_first_argument(monkeypatch, "rope_decode_attention")
    over = {} if head_dim is None else {"head_dim": head_dim}
    runs, rows = _spy_wgmma_rows(monkeypatch, "awq_wgmma_packed_sums")
    acts = []
    if gu_on:
        real_act = ops.act_mul_sums

        def spy_act(sums, *args, **kwargs):
            acts.append(sums.shape[0])
            return real_act(sums, *args, **kwargs)

        monkeypatch.setattr(ops, "act_mul_sums", spy_act)
    _match_over_decode(arch, None, 12, device="cuda", graphs=True, batch=batch, layout="packed", **over)
    if runs:
        assert batch in rows
        if head_dim is not None and _ext.has_op("rope_decode_attention"):
            assert any(f32_qkv)
        assert (batch in acts) == gu_on


def test_wgmma_sums_switch_and_fit_off_the_gpu(monkeypatch):
    # FASTAWQ_WGMMA_SUMS is on unless "0"; FASTAWQ_WGMMA_GU_SUMS "1" / "0" forces gate_up's sums on /
    # off, unset (or anything else) leaves them on except at 17-32 rows (the 32-token tile, whose
    # plain op's splits meet in a cluster). Off CUDA (or with it off) the wgmma sums never serve a layer.
    from fastawq.modules.fused import _wgmma_sums_fits, wgmma_gu_sums_out, wgmma_sums_out

    for value, on in ((None, True), ("0", False), ("1", True), ("", True)):
        if value is None:
            monkeypatch.delenv("FASTAWQ_WGMMA_SUMS", raising=False)
        else:
            monkeypatch.setenv("FASTAWQ_WGMMA_SUMS", value)
        assert wgmma_sums_out() is on, value
    for value, rows_on in ((None, (9, 16, 33, 64)), ("", (9, 16, 33, 64)), ("0", ()), ("1", (9, 16, 17, 32, 33, 64))):
        if value is None:
            monkeypatch.delenv("FASTAWQ_WGMMA_GU_SUMS", raising=False)
        else:
            monkeypatch.setenv("FASTAWQ_WGMMA_GU_SUMS", value)
        for rows in (9, 16, 17, 32, 33, 64):
            assert wgmma_gu_sums_out(rows) is (rows in rows_on), (value, rows)
    lin = WQLinear.from_linear(torch.nn.Linear(64, 64).half(), 32)
    assert not _wgmma_sums_fits(16, torch.float16, torch.device("cpu"), lin, None)


def test_full_logits_forward_matches_unfused():
    ref = tiny_w4_model("qwen2", seed=1)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, backend="torch")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 17))
    with torch.inference_mode():
        assert _rel(fused(ids).logits, ref(ids).logits) < TOL


def test_qkv_concat_is_exact():
    ref = tiny_w4_model("qwen2")
    attn = ref.model.layers[0].self_attn
    from fastawq.modules.fused import concat_wqlinear

    cat = concat_wqlinear([attn.q_proj, attn.k_proj, attn.v_proj])
    x = torch.randn(3, COMMON["hidden_size"], dtype=torch.float16)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    torch.testing.assert_close(cat(x), want, rtol=0, atol=0)


def test_cache_overflow_is_an_error_before_any_work():
    from fastawq.generate import generate

    model = fuse_model(tiny_w4_model("llama"), max_seq_len=16, batch_size=1, backend="torch")
    rt = model.fastawq_runtime
    with pytest.raises(CacheOverflowError, match="max_seq_len=16"):
        generate(model, None, torch.randint(0, 300, (1, 10)), max_new_tokens=7)
    assert rt.length == 0
    with pytest.raises(CacheOverflowError, match="batch_size=1"):
        generate(model, None, torch.randint(0, 300, (2, 4)), max_new_tokens=2)
    with pytest.raises(CacheOverflowError, match="max_seq_len=16"):
        rt.prefill(torch.randint(0, 300, (1, 17)))
    rt.prefill(torch.randint(0, 300, (1, 16)))
    with pytest.raises(CacheOverflowError):
        rt.decode(torch.tensor([1]))
    assert rt.length == 16


def test_unsupported_architecture_is_refused():
    model = tiny_w4_model("llama")
    model.config.model_type = "gpt_neox"
    with pytest.raises(NotImplementedError, match="gpt_neox"):
        fuse_model(model, 16, 1)


def test_fusing_needs_quantized_linears():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config("llama"))
    with pytest.raises(TypeError, match="WQLinear"):
        fuse_model(model, 16, 1)


def test_sliding_window_longer_than_cache_is_refused():
    from transformers import AutoModelForCausalLM, MistralConfig

    model = AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=32))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        fuse_model(model, 64, 1)


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 32), (8, 1, 64), (6, 2, 24)])
def test_decode_attention_kernel_matches_sdpa(hq, hkv, d, dtype, splits):
    from fastawq.triton_kernels.attention import decode_attention

    dev = "cuda" if CUDA else "cpu"
    b, s = 3, 80
    kc = torch.randn(b + 1, s, hkv, d, dtype=dtype, device=dev)
    vc = torch.randn(b + 1, s, hkv, d, dtype=dtype, device=dev)
    q = torch.randn(b, hq, d, dtype=dtype, device=dev)
    # Lengths straddle the 16/64-key blocks; keys past a row's length are poisoned.
    lens = torch.tensor([1, 17, 64], dtype=torch.int32, device=dev)
    for i, n in enumerate(lens.tolist()):
        kc[i, n:] = float("nan")
        vc[i, n:] = float("nan")
    out = torch.full_like(q, float("nan"))
    for _ in range(2):  # twice: the arrival counters must re-arm themselves
        decode_attention(q, kc, vc, lens, d ** -0.5, out=out, num_splits=splits)
    for i, n in enumerate(lens.tolist()):
        k = kc[i, :n].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        v = vc[i, :n].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
        want = torch.nn.functional.scaled_dot_product_attention(q[i, :, None].double(), k, v)[:, 0]
        # The kernel multiplies fp16 probabilities by fp16 values: fp16-level error; fp32 dots
        # run as tf32 on the GPU (Triton's default).
        tol = 3e-3 if dtype == torch.float16 or CUDA else 1e-4
        torch.testing.assert_close(out[i].double(), want, rtol=tol, atol=tol)


@needs_triton
def test_decode_attention_many_splits_matches_sdpa():
    from fastawq.triton_kernels.attention import decode_attention

    dev = "cuda" if CUDA else "cpu"
    kc, vc = torch.randn(2, 2, 200, 2, 32, device=dev).unbind(0)
    q = torch.randn(1, 4, 32, device=dev)
    lens = torch.tensor([199], dtype=torch.int32, device=dev)
    got = decode_attention(q, kc, vc, lens, 0.2, num_splits=8)
    k = kc[0, :199].transpose(0, 1).repeat_interleave(2, 0)
    v = vc[0, :199].transpose(0, 1).repeat_interleave(2, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q[0, :, None], k, v, scale=0.2)[:, 0]
    tol = 3e-3 if CUDA else 1e-4  # tf32 dots on the GPU
    torch.testing.assert_close(got[0], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("start, seq", [(0, 37), (5, 1), (64, 37), (200, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_prefill_attention_over_a_cached_prefix_matches_reference(start, seq, dtype):
    # A chunk after the first attends to every cached key and causally to its own: on CUDA through
    # torch's lower-right causal bias (the flash kernel), on the CPU through an explicit mask.
    if dtype != torch.float32 and not CUDA:
        pytest.skip("half-precision SDPA is checked on the GPU")
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(start + seq)
    b, hq, hkv, d, cap = 2, 8, 2, 64, 512
    kc, vc = torch.randn(2, b, cap, hkv, d, generator=g).to(dev, dtype).unbind(0)
    q = torch.randn(b, seq, hq, d, generator=g).to(dev, dtype)
    out = ops.prefill_attention(q, kc, vc, start, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    end = start + seq
    k = kc[:, :end].double().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    v = vc[:, :end].double().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    mask = torch.arange(end, device=dev)[None, :] <= torch.arange(start, end, device=dev)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(1, 2), k, v, attn_mask=mask,
                                                           scale=0.125).transpose(1, 2)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4 if not CUDA else 2e-3}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk", [1, 2, 8, 14])
def test_chunked_prefill_matches_one_pass(chunk):
    # prefill_chunk counts tokens over the batch's two rows: 1 and 2 give one position a chunk, 8 four,
    # 14 seven (13 positions: a short last chunk).
    ref = tiny_w4_model("llama", seed=2)
    one = fuse_model(copy.deepcopy(ref), max_seq_len=40, batch_size=2, backend="torch", prefill_chunk=None)
    chunked = fuse_model(ref, max_seq_len=40, batch_size=2, backend="torch", prefill_chunk=chunk)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    a, b = one.fastawq_runtime, chunked.fastawq_runtime
    assert _rel(b.prefill(ids, last_only=False), a.prefill(ids, last_only=False)) < TOL
    assert _rel(b.prefill(ids)[:, -1], a.prefill(ids)[:, -1]) < TOL
    assert b.length == 13
    tok = ids[:, -1]
    assert _rel(b.decode(tok), a.decode(tok)) < TOL


def test_prefill_computes_only_the_logits_it_returns():
    # The lm_head of a 128k vocabulary on every prompt position is 0.5 GiB per 2048 tokens: a
    # prefill runs it on the kept positions only, chunk by chunk (8 tokens over 2 rows: 4 positions
    # a chunk), and returns them in one tensor.
    model = fuse_model(tiny_w4_model("llama", seed=3), max_seq_len=40, batch_size=2, backend="torch", prefill_chunk=8)
    rt = model.fastawq_runtime
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    want = rt.prefill(ids, last_only=False)
    rows = []
    rt.lm_head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    torch.testing.assert_close(rt.prefill(ids), want[:, -1:])
    assert rows == [1]
    rows.clear()
    torch.testing.assert_close(rt.prefill(ids, logits_to_keep=5), want[:, -5:])
    assert rows == [4, 1]
    rows.clear()
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, logits_to_keep=2).logits, want[:, -2:])
        assert rows == [1, 1]
        assert torch.equal(model(ids).logits, want)
    with pytest.raises(ValueError, match="logits_to_keep"):
        rt.prefill(ids, logits_to_keep=-1)


def test_fp32_activations_on_cpu():
    # from_quantized on CPU keeps packed layers as saved and casts everything else to fp32.
    ref = tiny_w4_model("qwen3", seed=5)
    packed = {id(t) for m in ref.modules() if isinstance(m, WQLinear) for t in m.buffers()}
    for p in ref.parameters():
        if id(p) not in packed:
            p.data = p.data.float()
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=24, batch_size=1, backend="torch")
    assert fused.model.layers[0].self_attn.k_cache.dtype == torch.float32
    ids = torch.randint(0, COMMON["vocab_size"], (1, 9))
    hf = HFStepper(ref)
    rt = fused.fastawq_runtime
    assert _rel(rt.prefill(ids)[:, -1], hf.prefill(ids)) < TOL
    tok = ids[:, -1]
    assert _rel(rt.decode(tok), hf.decode(tok)) < TOL


def test_backend_reaches_every_wqlinear():
    # fuse_model(kernels=...) used to stop at the norms and attention: the GEMMs kept dispatching.
    model = fuse_model(tiny_w4_model("llama"), max_seq_len=16, batch_size=1, backend="torch")
    layers = [m for m in model.modules() if isinstance(m, WQLinear)]
    assert layers and all(m.backend == "torch" for m in layers)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 5))
    model.fastawq_runtime.prefill(ids)
    assert all(m._plan.backend == "torch" for m in layers)


def test_kernels_is_a_deprecated_alias_of_backend():
    with pytest.warns(DeprecationWarning, match="use backend="):
        model = fuse_model(tiny_w4_model("llama"), max_seq_len=16, batch_size=1, kernels="torch")
    assert model.fastawq_runtime.backend == "torch"
    with pytest.raises(ValueError, match="disagree"):
        fuse_model(tiny_w4_model("llama"), max_seq_len=16, batch_size=1, kernels="torch", backend="triton")


@pytest.mark.parametrize("hooked", [False, True])
def test_rope_tables_come_from_a_cpu_copy_of_the_rotary_module(hooked):
    # fused._rope_tables runs a CPU copy of the model's rotary module (on a GPU the module's matmul
    # would leave a cuBLAS workspace behind on the current stream) and gives exactly the module's
    # own tables; a module under an accelerate hook (`_hf_hook`) runs in place.
    from fastawq.models import architecture_of
    from fastawq.models.base import get_submodule
    from fastawq.modules.fused import _rope_tables

    model = tiny_w4_model("llama")
    rot = get_submodule(model, architecture_of(model).rotary_path)
    if hooked:
        rot._hf_hook = object()
    ran_on = []
    rot.register_forward_pre_hook(lambda module, args: ran_on.append(module is rot))
    inv_freq = rot.inv_freq.clone()
    cos, sin = _rope_tables(model, 40, torch.device("cpu"))
    assert ran_on == [hooked]
    assert torch.equal(rot.inv_freq, inv_freq)
    ref_cos, ref_sin = rot(torch.zeros(1), torch.arange(40)[None])
    assert cos.shape == (40, rot.inv_freq.numel() * 2) and cos.dtype == torch.float32
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
