"""The fused engine's CPU decode step (fastawq.modules.fused_cpu) against the unfused model."""
import copy

import pytest
import torch

from fastawq import cpu as cpu_backend
from fastawq.generate import HFStepper
from fastawq.modules import WQLinear
from fastawq.modules.cpu_linear import CPUInt8Linear
from fastawq.modules.fused import fuse_model
from test_fused import COMMON, _rel, tiny_w4_model

pytestmark = pytest.mark.skipif(cpu_backend.fast_kernel_available() is not None,
                                reason="needs fastawq's compiled CPU kernel")


def _fp32(model: torch.nn.Module) -> torch.nn.Module:
    """What from_quantized does on the CPU: packed layers as saved, every other tensor fp32."""
    packed = {id(t) for m in model.modules() if isinstance(m, WQLinear) for t in m.buffers()}
    for p in model.parameters():
        if id(p) not in packed:
            p.data = p.data.float()
    return model


def _check_decode(ref, fused, batch: int, steps: int, tol: float) -> None:
    ids = torch.randint(0, COMMON["vocab_size"], (batch, 7), generator=torch.Generator().manual_seed(3))
    rt, hf = fused.fastawq_runtime, HFStepper(ref)
    assert rt.cpu_step is not None
    assert _rel(rt.prefill(ids)[:, -1], hf.prefill(ids)) < tol
    for _ in range(steps):
        tok = torch.randint(0, COMMON["vocab_size"], (batch,))
        lf, lr = rt.decode(tok), hf.decode(tok)
        assert lf.shape == lr.shape and torch.isfinite(lf).all()
        assert _rel(lf, lr) < tol


# fp32 on both sides: only summation order differs (seen ~1e-6); a wrong rope, cache slot or
# norm gives O(1).
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "mistral"])
@pytest.mark.parametrize("batch", [1, 2])
def test_cpu_step_matches_unfused_fp32(arch, batch):
    ref = _fp32(tiny_w4_model(arch, seed=batch))
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=2, cpu_lm_head_bits=None)
    _check_decode(ref, fused, batch, steps=6, tol=1e-4)


def test_cpu_step_with_fp16_model_matches_unfused():
    # The step computes in fp32 and keeps the fp16 cache and logits: fp16 roundings differ.
    ref = tiny_w4_model("llama", seed=7)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, cpu_lm_head_bits=None)
    assert fused.model.layers[0].self_attn.k_cache.dtype == torch.float16
    _check_decode(ref, fused, 1, steps=4, tol=1e-2)


def test_8bit_head_is_the_default_and_matches_cpu_int8_linear():
    ref = _fp32(tiny_w4_model("llama", seed=11))
    head = ref.lm_head
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1)
    rt = fused.fastawq_runtime
    assert isinstance(rt.lm_head, CPUInt8Linear)
    ref.lm_head = CPUInt8Linear.from_linear(head, 64)  # the same head on the unfused model
    _check_decode(ref, fused, 1, steps=4, tol=1e-4)


def test_forced_backend_keeps_the_generic_step():
    fused = fuse_model(_fp32(tiny_w4_model("llama")), max_seq_len=16, batch_size=1, backend="torch")
    assert fused.fastawq_runtime.cpu_step is None


def test_model_loaded_in_inference_mode_decodes():
    # Inference tensors keep no version counter: the repack cache must key them on identity.
    with torch.inference_mode():
        ref = _fp32(tiny_w4_model("qwen3", seed=2))
        fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, cpu_lm_head_bits=None)
        _check_decode(ref, fused, 1, steps=3, tol=1e-4)


def test_bad_head_bits_is_an_error():
    with pytest.raises(ValueError, match="lm_head_bits"):
        fuse_model(_fp32(tiny_w4_model("llama")), max_seq_len=16, batch_size=1, cpu_lm_head_bits=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma"])
def test_cpp_layer_op_matches_the_torch_loop(arch):
    # awq_cpu_decode_layer (one C++ call per layer) against the step's torch loop on the same
    # fused model: same kernel calls, only the norm / rope / attention arithmetic differs.
    if not hasattr(torch.ops.fastawq, "awq_cpu_decode_layer"):
        pytest.skip("fastawq._C predates awq_cpu_decode_layer")
    ref = _fp32(tiny_w4_model(arch, seed=5))
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=2, cpu_lm_head_bits=None)
    step = fused.fastawq_runtime.cpu_step
    assert step.layer_args is not None, "an fp32 model's step should take the C++ layer op"
    twin = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=2, cpu_lm_head_bits=None)
    twin.fastawq_runtime.cpu_step.layer_args = None  # the torch loop
    ids = torch.randint(0, COMMON["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(4))
    a, t = fused.fastawq_runtime, twin.fastawq_runtime
    torch.testing.assert_close(a.prefill(ids), t.prefill(ids))
    for _ in range(5):
        tok = torch.randint(0, COMMON["vocab_size"], (2,))
        la, lt = a.decode(tok), t.decode(tok)
        assert torch.isfinite(la).all() and _rel(la, lt) < 1e-5
    for la, lt in zip(a.layers, t.layers):
        torch.testing.assert_close(la.self_attn.k_cache, lt.self_attn.k_cache, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la.self_attn.v_cache, lt.self_attn.v_cache, rtol=1e-5, atol=1e-5)


def test_cpp_layer_op_rejects_bad_inputs():
    if not hasattr(torch.ops.fastawq, "awq_cpu_decode_layer"):
        pytest.skip("fastawq._C predates awq_cpu_decode_layer")
    fused = fuse_model(_fp32(tiny_w4_model("llama", seed=6)), max_seq_len=8, batch_size=1, cpu_lm_head_bits=None)
    step = fused.fastawq_runtime.cpu_step
    n1, n2, weights, groups, ns, biases, kc, vc, qn, kn = step.layer_args[0]
    c = step.cfg
    res = torch.randn(1, n1.numel())
    args = (n1, n2, weights, groups, ns, biases, kc, vc)
    tail = (step.cos[0].contiguous(), step.sin_signed[0].contiguous(), qn, kn, c.num_heads, c.num_kv_heads, c.eps,
            c.scale)
    op = torch.ops.fastawq.awq_cpu_decode_layer
    with pytest.raises(RuntimeError, match="position 8 is outside the cache's 8 slots"):
        op(res, None, *args, 8, *tail, c.act)
    with pytest.raises(RuntimeError, match="res must be a contiguous CPU fp32"):
        op(res.double(), None, *args, 0, *tail, c.act)
    with pytest.raises(RuntimeError, match="activation must be silu, gelu_pytorch_tanh or gelu, got relu"):
        op(res, None, *args, 0, *tail, "relu")
    with pytest.raises(RuntimeError, match="k_cache / v_cache must be contiguous fp32"):
        op(res, None, n1, n2, weights, groups, ns, biases, kc.half(), vc.half(), 0, *tail, c.act)


@pytest.mark.skipif("avx2_int8" not in cpu_backend.fast_kernel_isas(), reason="no AVX2 int8-activation kernel")
def test_int8_activations_stay_close(monkeypatch):
    # FASTAWQ_CPU_ACT=int8: every decode GEMM rounds its activations to int8 (blocks of 32):
    # close to the exact step (a few 1e-3 relative on this tiny model), not equal.
    ref = _fp32(tiny_w4_model("llama", seed=9))
    monkeypatch.setenv("FASTAWQ_CPU_ACT", "int8")
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, cpu_lm_head_bits=None)
    assert fused.fastawq_runtime.cpu_step.isa == "int8"
    _check_decode(ref, fused, 1, steps=4, tol=3e-2)
    monkeypatch.setenv("FASTAWQ_CPU_ACT", "fp16")
    with pytest.raises(ValueError, match="expected one of"):
        fuse_model(copy.deepcopy(ref), max_seq_len=32, batch_size=1, cpu_lm_head_bits=None)
