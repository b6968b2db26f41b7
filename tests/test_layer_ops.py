"""The decoder-layer ops of fastawq.ops (add + RMSNorm, act*mul, rope + KV-cache write, decode
attention) against reference.py on every backend that runs here, their torch.library schemas
under opcheck, and the one backend vocabulary."""
import os

import pytest
import torch

from fastawq import backend, ops, reference

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = "cuda" if CUDA else "cpu"
# Triton runs on the GPU, or on the CPU under the interpreter (conftest sets it).
BACKENDS = ["torch", "triton"] if (CUDA or INTERPRET) else ["torch"]


def _tol(be: str) -> dict:
    # The torch backend is the reference itself; the kernels round fp16 once more than fp32 math.
    return dict(rtol=0, atol=0) if be == "torch" else dict(rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("h", [48, 200, 4096])  # 4096: 16 warps a block
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("form", ["0", "1", "2"])
def test_add_rms_norm_matches_reference(be, h, offset, form, monkeypatch):
    monkeypatch.setenv("FASTAWQ_NORM_FORM", form)  # the Triton kernel's forms (triton_kernels/norm.py)
    x, r = torch.randn(2, 3, 5, h, dtype=torch.float16, device=DEV).unbind(0)
    w = torch.randn(h, dtype=torch.float16, device=DEV)
    for res in (None, r):
        y, r_out = ops.add_rms_norm(x, res, w, 1e-5, offset, backend=be)
        y_ref, r_ref = reference.add_rms_norm(x, res, w, 1e-5, offset)
        torch.testing.assert_close(y, y_ref, **_tol(be))
        assert torch.equal(r_out, r_ref)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rms_norm_takes_fp32_sums(be, dtype):
    # An MoE block's one-token output may arrive as fp32 sums (WQExperts.sums, FASTAWQ_MOE_SUMS=1): the
    # norm rounds them to the residual's dtype first, so the outputs equal those of the rounded input,
    # and both take the residual's dtype. Values up to ~3e4 and with low bits that the rounding drops.
    if be == "triton" and dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's CPU interpreter computes this kernel's bf16 sums as NaN (either input dtype)")
    h = 200
    r = torch.randn(3, h, dtype=dtype, device=DEV)
    sums = torch.randn(3, h, dtype=torch.float32, device=DEV) * torch.logspace(-3, 4, h, device=DEV)
    w = torch.randn(h, dtype=dtype, device=DEV)
    y, r_out = ops.add_rms_norm(sums, r, w, 1e-5, 0.0, backend=be)
    y_want, r_want = ops.add_rms_norm(sums.to(dtype), r, w, 1e-5, 0.0, backend=be)
    assert y.dtype == r_out.dtype == dtype
    assert torch.equal(r_out, r_want) and torch.equal(y, y_want)
    y_ref, r_ref = reference.add_rms_norm(sums, r, w, 1e-5, 0.0)
    assert torch.equal(r_out, r_ref)
    torch.testing.assert_close(y, y_ref, **_tol(be))
    with pytest.raises(ValueError, match="x must have the residual's dtype, or be fp32 sums"):
        ops.add_rms_norm(sums.to(torch.bfloat16 if dtype == torch.float16 else torch.float16), r, w, 1e-5, backend=be)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("form", ["0", "1", "2"])
@pytest.mark.parametrize("h", [200, 4096])
def test_add_rms_norm_zeroes_a_later_projections_sums(be, form, h, monkeypatch):
    # zero= (FASTAWQ_DENSE_SUMS): the same launch fills a later projection's fp32 sums with zeros;
    # the norm's outputs are those of the call without it, with x in the activation dtype or fp32,
    # in each of the Triton kernel's forms (FASTAWQ_NORM_FORM: 2 zeroes from a second grid dimension)
    # bit for bit those of the first form.
    r = torch.randn(3, h, dtype=torch.float16, device=DEV)
    w = torch.randn(h, dtype=torch.float16, device=DEV)
    # Widths other than H (FASTAWQ_QKV_SUMS: o_proj's sums and the QKV projection's side by side, a
    # row of H + 3.5 H here; one narrower than the norm's block; several blocks a row), in a buffer
    # whose neighbours must stay as they are.
    for x in (torch.randn(3, h, dtype=torch.float16, device=DEV), torch.randn(3, h, device=DEV) * 30):
        for width in (h, 7, 3 * h + 100):
            buf = torch.full((3 * width + 5,), float("nan"), device=DEV)
            zero = buf[:3 * width].view(3, width)
            monkeypatch.setenv("FASTAWQ_NORM_FORM", form)
            y, r_out = ops.add_rms_norm(x, r, w, 1e-5, 1.0, backend=be, zero=zero)
            monkeypatch.setenv("FASTAWQ_NORM_FORM", "0")
            y_want, r_want = ops.add_rms_norm(x, r, w, 1e-5, 1.0, backend=be)
            assert torch.equal(zero, torch.zeros_like(zero)) and buf[3 * width:].isnan().all()
            assert torch.equal(y, y_want) and torch.equal(r_out, r_want)
    with pytest.raises(ValueError, match=r"zero must be a contiguous fp32 tensor \[rows=3, Z\]"):
        ops.add_rms_norm(x, r, w, 1e-5, backend=be, zero=torch.zeros(3, h, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"zero must be a contiguous fp32 tensor \[rows=3, Z\]"):
        ops.add_rms_norm(x, None, w, 1e-5, backend=be, zero=torch.zeros(3, h, device=DEV))
    with pytest.raises(ValueError, match=r"zero must be a contiguous fp32 tensor \[rows=3, Z\]"):
        ops.add_rms_norm(x, r, w, 1e-5, backend=be, zero=torch.zeros(4, h, device=DEV))
    if be == "triton":
        monkeypatch.setenv("FASTAWQ_NORM_FORM", "3")
        with pytest.raises(ValueError, match="FASTAWQ_NORM_FORM must be 0, 1 or 2, got '3'"):
            ops.add_rms_norm(x, r, w, 1e-5, backend=be)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("act", ops.ACTIVATIONS)
def test_act_mul_matches_reference(be, act):
    gu = torch.randn(3, 2, 2 * 1100, dtype=torch.float16, device=DEV)  # I = 1100 straddles 1024-column blocks
    torch.testing.assert_close(ops.act_mul(gu, act, backend=be), reference.act_mul(gu, act), **_tol(be))


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("act", ops.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_act_mul_sums_rounds_the_sums_first(be, act, dtype):
    # A gate_up projection's fp32 sums (FASTAWQ_WGMMA_GU_SUMS): the result equals act_mul of the sums
    # rounded to the activation dtype, in that dtype; values with low bits the rounding drops, and I =
    # 1100 straddling 1024-column blocks.
    sums = torch.randn(3, 2, 2 * 1100, device=DEV) * torch.logspace(-2, 1, 2 * 1100, device=DEV)
    out = ops.act_mul_sums(sums, act, dtype, backend=be)
    want = ops.act_mul(sums.to(dtype), act, backend=be)
    assert out.dtype == dtype and out.shape == (3, 2, 1100)
    if be == "triton" and dtype == torch.bfloat16 and not CUDA:
        # Triton's CPU interpreter rounds fp32 to bf16 its own way (not to nearest): up to two bf16 steps
        # apart (the input's rounding and the output's).
        torch.testing.assert_close(out, want, rtol=3.2e-2, atol=1e-5)
    else:
        assert torch.equal(out, want)
    tol = dict(rtol=3.2e-2, atol=1e-3) if be != "torch" and dtype == torch.bfloat16 else _tol(be)
    torch.testing.assert_close(out, reference.act_mul(sums.to(dtype), act), **tol)
    with pytest.raises(ValueError, match=r"gu_sums must be fp32 with an even last dimension, got torch.float16"):
        ops.act_mul_sums(sums.half(), act, dtype, backend=be)
    with pytest.raises(ValueError, match=r"dtype must be float16 or bfloat16, got torch.float32"):
        ops.act_mul_sums(sums, act, torch.float32, backend=be)
    with pytest.raises(ValueError, match="activation 'relu' is not fused"):
        ops.act_mul_sums(sums, "relu", dtype, backend=be)


def _rope_inputs(qk_norm: bool, dtype=torch.float16):
    b, seq, hq, hkv, d, s = 2, 5, 4, 2, 32, 24
    qkv = torch.randn(b, seq, (hq + 2 * hkv) * d, dtype=dtype, device=DEV)
    positions = (torch.arange(seq, device=DEV) + torch.tensor([[0], [7]], device=DEV)).to(torch.int32)
    cos, sin = torch.randn(2, s, d, device=DEV).unbind(0)
    w = (torch.rand(d, dtype=dtype, device=DEV), torch.rand(d, dtype=dtype, device=DEV)) if qk_norm else (None, None)
    # Poisoned caches: only the slots at `positions` may change.
    caches = [torch.full((b, s, hkv, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
    return qkv, positions, cos, sin, caches, (hq, hkv, d), w


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_cache_matches_reference(be, qk_norm):
    qkv, positions, cos, sin, (kc, vc), heads, w = _rope_inputs(qk_norm)
    kr, vr = kc.clone(), vc.clone()
    q = ops.rope_kv_cache(qkv, positions, cos, sin, kc, vc, *heads, *w, backend=be)
    q_ref = reference.rope_kv_cache(qkv, positions, cos, sin, kr, vr, *heads, *w)
    torch.testing.assert_close(q, q_ref, **_tol(be))
    for got, want in ((kc, kr), (vc, vr)):
        assert torch.equal(got.isnan(), want.isnan())  # the same cache slots written, the rest untouched
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **_tol(be))


def _decode_inputs(b=2, hq=4, hkv=2, d=32, s=40, dtype=torch.float16):
    q = torch.randn(b, hq, d, dtype=dtype, device=DEV)
    kc, vc = torch.randn(2, b + 1, s, hkv, d, dtype=dtype, device=DEV).unbind(0)
    lens = torch.tensor([17, s][:b], dtype=torch.int32, device=DEV)
    return q, kc, vc, lens


@pytest.mark.parametrize("be", BACKENDS)
def test_decode_attention_matches_reference(be):
    q, kc, vc, lens = _decode_inputs()
    want = reference.decode_attention(q, kc, vc, lens, 0.2)
    out = torch.full_like(q, float("nan"))
    got = ops.decode_attention(q, kc, vc, lens, 0.2, backend=be, max_len=40, out=out)
    assert got is out
    tol = 3e-3 if (be != "torch" and CUDA) else 1e-3  # tf32 dots on the GPU
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(ops.decode_attention(q, kc, vc, lens, 0.2, backend=be), want, rtol=tol, atol=tol)


def test_bad_layer_inputs_are_named():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"norm weight \(8,\) does not match hidden size 16"):
        ops.add_rms_norm(x, None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"gate_up \(3, 15\) must have an even last dimension"):
        ops.act_mul(torch.randn(3, 15))
    with pytest.raises(ValueError, match="activation 'relu' is not fused"):
        ops.act_mul(x, "relu")
    q, kc, vc, lens = _decode_inputs()
    with pytest.raises(ValueError, match=r"lens \(3,\) must be \(2,\)"):
        ops.decode_attention(q, kc, vc, torch.ones(3, dtype=torch.int32, device=DEV), 0.2)


# --- opcheck: schema, fake impl, autograd registration and aliasing of each custom op ---------


def _opcheck_cases(be: str):
    h = 40
    x, r = torch.randn(2, 3, h, dtype=torch.float16, device=DEV).unbind(0)
    w = torch.randn(h, dtype=torch.float16, device=DEV)
    yield torch.ops.fastawq.rms_norm.default, (x, w, 1e-5, 1.0, be)
    yield torch.ops.fastawq.add_rms_norm.default, (x, r, w, 1e-5, 0.0, be)
    yield torch.ops.fastawq.add_rms_norm.default, (x.float(), r, w, 1e-5, 0.0, be)  # fp32 sums
    yield torch.ops.fastawq.add_rms_norm_zero.default, (x, r, w, 1e-5, 0.0, be, torch.ones(3, h, device=DEV))
    yield torch.ops.fastawq.act_mul.default, (torch.randn(3, 2 * 24, dtype=torch.float16, device=DEV), "silu", be)
    qkv, positions, cos, sin, (kc, vc), heads, wn = _rope_inputs(True)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()  # opcheck compares cache contents, NaN != NaN
    yield torch.ops.fastawq.rope_kv_cache.default, (qkv, positions, cos, sin, kc, vc, *heads, *wn, 1e-6, be)
    q, kc, vc, lens = _decode_inputs()
    yield torch.ops.fastawq.decode_attention_into.default, (q, kc, vc, lens, 0.2, -1, be, torch.empty_like(q))


@pytest.mark.parametrize("be", BACKENDS)
def test_layer_ops_pass_opcheck(be):
    for op, args in _opcheck_cases(be):
        torch.library.opcheck(op, args)


def test_layer_ops_trace_under_compile():
    """The fused path's ops trace with their fake impls (one graph, no graph break)."""

    def layer(x, r, w, gu):
        y, r2 = ops.add_rms_norm(x, r, w, 1e-5, backend="torch")
        return y + r2, ops.act_mul(gu, backend="torch")

    x, r = torch.randn(2, 4, 32).unbind(0)
    w, gu = torch.randn(32), torch.randn(4, 64)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    for got, want in zip(compiled(x, r, w, gu), layer(x, r, w, gu)):
        torch.testing.assert_close(got, want)


# --- one backend vocabulary -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["add_rms_norm", "act_mul", "rope_kv_cache", "decode_attention"])
def test_forced_cpu_without_cpu_kernel_runs_the_reference(op, monkeypatch):
    # Documented in backend.py: the CPU backend's contract is "run on the CPU".
    assert backend.select_backend(op, torch.device("cpu"), backend="cpu") == "torch"
    monkeypatch.setenv("FASTAWQ_BACKEND", "cpu")
    assert backend.select_backend(op, torch.device("cpu")) == "torch"


def test_env_backend_reaches_layer_ops(monkeypatch):
    x = torch.randn(3, 16)
    monkeypatch.setenv("FASTAWQ_BACKEND", "cuda")
    with pytest.raises(backend.BackendUnavailableError, match="backend 'cuda' cannot run add_rms_norm: tensors are on cpu"):
        ops.add_rms_norm(x, None, torch.ones(16), 1e-5)
    monkeypatch.setenv("FASTAWQ_BACKEND", "torch")
    y, _ = ops.add_rms_norm(x, None, torch.ones(16), 1e-5)
    assert torch.equal(y, reference.rms_norm(x, torch.ones(16), 1e-5))


def test_decode_attention_backend_choice_on_cpu():
    q, k, v, lens = (t.cpu() for t in _decode_inputs())
    assert ops.decode_attention_backend(q, k, lens) == "torch"
    assert ops.decode_attention_backend(q, k, lens, "torch") == "torch"
    with pytest.raises(backend.BackendUnavailableError, match="'cuda' cannot run decode_attention: tensors are on cpu"):
        ops.decode_attention_backend(q, k, lens, "cuda")
    with pytest.raises(backend.BackendUnavailableError, match="unknown backend 'cudnn'"):
        ops.decode_attention_backend(q, k, lens, "cudnn")


@pytest.mark.parametrize("op", ["add_rms_norm", "act_mul", "rope_kv_cache"])
def test_python_custom_ops_never_count_as_compiled(op, monkeypatch):
    # Regression: the layer ops' Python custom ops share the fastawq namespace with _C's ops, so a
    # hasattr(torch.ops.fastawq, op) check took them for compiled kernels and the fused engine ran
    # the torch reference for its norms and rope on the GPU (decode at half speed).
    from fastawq import _ext

    monkeypatch.setattr(_ext, "is_loaded", lambda: True)
    monkeypatch.setattr(_ext, "supports_device", lambda device: True)
    assert hasattr(torch.ops.fastawq, op)
    reason = backend._why_not("cuda", op, torch.device("cuda"), backend._always)
    assert reason == f"the compiled extension has no op {op!r}"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["add_rms_norm", "act_mul", "rope_kv_cache"])
def test_layer_ops_run_triton_on_cuda_by_default(op):
    assert backend.select_backend(op, torch.device("cuda")) == "triton"


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_decode_attention_takes_fp32_qkv_sums(be, qk_norm):
    # qkv as the QKV projection's fp32 sums (FASTAWQ_QKV_SUMS) beside fp16 caches: rounded to the
    # caches' dtype (as read by the compiled launch, first on the other paths), so output and caches
    # are exactly those of qkv rounded first.
    b, hq, hkv, d, s = 2, 8, 2, 64, 32
    gen = torch.Generator().manual_seed(5)
    sums = (torch.randn(b, 1, (hq + 2 * hkv) * d, generator=gen) * 30).to(DEV)
    pos = torch.tensor([[5], [17]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([6, 18], dtype=torch.int32, device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = (torch.cat([f(ang), f(ang)], dim=-1).to(DEV) for f in (torch.cos, torch.sin))
    qn = kn = None
    if qk_norm:
        qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEV, torch.float16)
        kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEV, torch.float16)
    k = torch.randn(b, s, hkv, d, generator=gen).to(DEV, torch.float16)
    v = torch.randn(b, s, hkv, d, generator=gen).to(DEV, torch.float16)
    k2, v2 = k.clone(), v.clone()
    got = ops.rope_decode_attention(sums, pos, cos, sin, k, v, lens, hq, hkv, d, 0.125, qn, kn, max_len=s, backend=be)
    want = ops.rope_decode_attention(sums.half(), pos, cos, sin, k2, v2, lens, hq, hkv, d, 0.125, qn, kn, max_len=s,
                                     backend=be)
    assert got.dtype == torch.float16
    assert torch.equal(got, want) and torch.equal(k, k2) and torch.equal(v, v2)
