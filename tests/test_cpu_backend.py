"""The CPU backend (fastawq.cpu: kernel choice, repack cache, fallbacks) against reference.py,
with each of its kernels forced in turn (fastawq's own, torch's packed int4).

torch's kernel computes in bf16 whatever the activation dtype (see fastawq/cpu.py), so the
yardstick here is plain torch in bf16 against the fp32 oracle (fastawq's kernel is held to its
own dtype's yardstick in test_cpu_kernel.py); the repacks are checked for exactness separately,
on inputs where every product and sum is exact in bf16.
"""
from __future__ import annotations

import gc

import pytest
import torch

from fastawq import backend, ops, reference
from fastawq import cpu as cpu_backend
from fastawq.modules import WQLinear, cpu_linear
from conftest import exact_awq_problem, random_awq, random_input, same_dtype_error

KERNELS = [
    name for name, why in ((cpu_backend.FASTAWQ, cpu_backend.fast_kernel_available()),
                           (cpu_backend.TORCH_INT4, cpu_backend.kernel_available()))
    if why is None
]
pytestmark = pytest.mark.skipif(not KERNELS, reason="neither CPU kernel is available")
needs_int4 = pytest.mark.skipif(cpu_backend.TORCH_INT4 not in KERNELS, reason=f"{cpu_backend.kernel_available()}")
needs_fast = pytest.mark.skipif(cpu_backend.FASTAWQ not in KERNELS, reason=f"{cpu_backend.fast_kernel_available()}")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Each available CPU kernel in turn, forced through FASTAWQ_CPU_KERNEL."""
    monkeypatch.setenv("FASTAWQ_CPU_KERNEL", request.param)
    return request.param


@pytest.fixture
def int4_kernel(monkeypatch):
    if cpu_backend.TORCH_INT4 not in KERNELS:
        pytest.skip(f"{cpu_backend.kernel_available()}")
    monkeypatch.setenv("FASTAWQ_CPU_KERNEL", cpu_backend.TORCH_INT4)

# (K, N): N straddles torch's 64-column (AVX-512) / 32-column (AVX2) blocks and their 16-column
# tails; K is a multiple of 128 so every group size applies.
SHAPES = [(128, 16), (384, 176), (640, 80)]
MS = [1, 7, 16, 33, 128]
DTYPES = [torch.float32, torch.bfloat16]


def _poison_allocator(m: int, n: int) -> None:
    """Leave NaN in freed memory the output may be carved from, so an unwritten element shows."""
    junk = torch.full((m, n), float("nan"), dtype=torch.float32)
    del junk


def _check(out, x, qweight, scales, qzeros, g, bias=None, factor: float = 4.0) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], qweight.shape[1] * 8)
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten?)"
    ref = reference.awq_gemm(x.float(), qweight, scales, qzeros, g, None if bias is None else bias.float())
    err = (out.float() - ref).abs().max().item()
    yard = same_dtype_error(x.to(torch.bfloat16), qweight, scales, qzeros, g, None if bias is None else bias.to(torch.bfloat16))
    budget = factor * yard + 2**-8 * ref.abs().max().item() * 1e-2
    assert err <= budget, f"max error {err:.4g} > budget {budget:.4g} (bf16 torch {yard:.4g}, ref max {ref.abs().max().item():.4g})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}N{s[1]}")
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gemm_matches_reference(kernel, shape, group_size, m, dtype, with_bias):
    k, n = shape
    g = reference.resolve_group_size(group_size, k)
    qweight, scales, qzeros = random_awq(k, n, group_size, seed=k + n + g)
    x = random_input((m, k), dtype=dtype, seed=m)
    bias = random_input((n,), dtype=dtype, seed=7) if with_bias else None
    assert cpu_backend.awq_gemm_fits(x, qweight, g) is None
    _poison_allocator(m, n)
    out = cpu_backend.awq_gemm(x, qweight, scales, qzeros, g, bias)
    _check(out, x, qweight, scales, qzeros, g, bias)
    assert cpu_backend.prepare(qweight, scales, qzeros, g).kernel == kernel


@pytest.mark.parametrize("k,group_size", [(96, -1), (576, -1), (576, 64), (192, 96), (256, 256)])
def test_groups_wider_than_the_kernel_are_split(int4_kernel, k, group_size):
    # K=576 (SmolLM2's hidden size) and groups 96 / 256 / -1 run as repeated 32/64/128 groups.
    qweight, scales, qzeros = random_awq(k, 48, group_size, seed=3)
    g = reference.resolve_group_size(group_size, k)
    x = random_input((5, k), dtype=torch.bfloat16)
    out = cpu_backend.awq_gemm(x, qweight, scales, qzeros, g)
    _check(out, x, qweight, scales, qzeros, g)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_repack_is_exact(kernel, group_size, scale_dtype, x_dtype):
    x, qweight, s, qzeros, g = exact_awq_problem(256, 80, group_size, 6, scale_dtype, x_dtype)
    out = cpu_backend.awq_gemm(x, qweight, s, qzeros, g)
    ref = reference.awq_gemm(x, qweight, s, qzeros, g)
    assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_dequantize_is_bit_identical(group_size, scale_dtype):
    qweight, scales, qzeros = random_awq(384, 176, group_size, dtype=scale_dtype, seed=5)
    g = reference.resolve_group_size(group_size, 384)
    out = cpu_backend.awq_dequantize(qweight, scales, qzeros, g)
    assert out.dtype == scale_dtype
    assert torch.equal(out, reference.dequantize(qweight, scales, qzeros, g))


def test_fp16_activations(kernel):
    qweight, scales, qzeros = random_awq(384, 176, 128)
    x = random_input((3, 384), dtype=torch.float16)
    out = cpu_backend.awq_gemm(x, qweight, scales, qzeros, 128)
    _check(out, x, qweight, scales, qzeros, 128)


def test_dispatch_picks_cpu_for_cpu_tensors(kernel, monkeypatch):
    calls = []
    real = cpu_backend.bind_gemm  # the plan binds the CPU backend's repacked weight
    monkeypatch.setattr(cpu_backend, "bind_gemm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("FASTAWQ_BACKEND", raising=False)
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input((2, 3, 256), dtype=torch.float32)
    out = ops.awq_gemm(x, qweight, scales, qzeros, 64)
    assert calls == [1] and out.shape == (2, 3, 64)
    _check(out.reshape(6, 64), x.reshape(6, 256), qweight, scales, qzeros, 64)
    w = ops.awq_dequantize(qweight, scales, qzeros, 64)
    assert torch.equal(w, reference.dequantize(qweight, scales, qzeros, 64))


def test_strided_input(kernel):
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input((256, 10), dtype=torch.bfloat16).t()  # [10, 256], not contiguous
    out = ops.awq_gemm(x, qweight, scales, qzeros, 64, backend="cpu")
    _check(out, x, qweight, scales, qzeros, 64)


@pytest.mark.parametrize(
    "kernel_name,k,n,group_size,dtype,why",
    [
        ("torch-int4", 64, 64, 16, torch.float32, "group_size=16 is not a multiple of 32"),
        ("torch-int4", 240, 64, -1, torch.float32, "group_size=240 is not a multiple of 32"),
        ("torch-int4", 64, 24, 32, torch.float32, "N=24 is not a multiple of 16"),
        ("torch-int4", 64, 64, 32, torch.float64, "take fp32, bf16 or fp16"),
        ("fastawq", 48, 64, 12, torch.float32, "group_size=12 is not a multiple of 8"),
        ("fastawq", 60, 64, -1, torch.float32, "group_size=60 is not a multiple of 8"),
        ("fastawq", 64, 64, 32, torch.float64, "take fp32, bf16 or fp16"),
    ],
)
def test_unfit_calls_are_declined_and_fall_back(monkeypatch, kernel_name, k, n, group_size, dtype, why):
    if kernel_name not in KERNELS:
        pytest.skip(f"{kernel_name} is not available")
    monkeypatch.setenv("FASTAWQ_CPU_KERNEL", kernel_name)
    qweight, scales, qzeros = random_awq(k, n, group_size)
    g = reference.resolve_group_size(group_size, k)
    x = random_input((3, k), dtype=dtype)
    assert why in cpu_backend.awq_gemm_fits(x, qweight, g)
    with pytest.raises(ValueError, match="CPU int4 kernel cannot run"):
        cpu_backend.awq_gemm(x, qweight, scales, qzeros, g)
    with pytest.raises(backend.BackendUnavailableError, match=why):
        ops.awq_gemm(x, qweight, scales, qzeros, g, backend="cpu")
    out = ops.awq_gemm(x, qweight, scales, qzeros, g)  # dispatch falls back to the torch path
    assert torch.equal(out, reference.awq_gemm(x, qweight, scales, qzeros, g))


def test_exact_fp32_env_declines_fp32(int4_kernel, monkeypatch):
    monkeypatch.setenv("FASTAWQ_CPU_FP32", "exact")
    qweight, scales, qzeros = random_awq(128, 64, 64)
    x = random_input((2, 128), dtype=torch.float32)
    assert "FASTAWQ_CPU_FP32=exact" in cpu_backend.awq_gemm_fits(x, qweight, 64)
    assert cpu_backend.awq_gemm_fits(x.bfloat16(), qweight, 64) is None
    assert torch.equal(ops.awq_gemm(x, qweight, scales, qzeros, 64), reference.awq_gemm(x, qweight, scales, qzeros, 64))


@needs_fast
def test_fastawq_kernel_is_preferred_and_exact_in_fp32(monkeypatch):
    # fastawq's kernel accumulates exact fp32 products: FASTAWQ_CPU_FP32=exact keeps it.
    monkeypatch.delenv("FASTAWQ_CPU_KERNEL", raising=False)
    monkeypatch.setenv("FASTAWQ_CPU_FP32", "exact")
    qweight, scales, qzeros = random_awq(128, 64, 64)
    x = random_input((2, 128), dtype=torch.float32)
    assert cpu_backend.kernel_for(torch.float32, qweight, 64) == ("fastawq", "")
    out = ops.awq_gemm(x, qweight, scales, qzeros, 64)
    assert cpu_backend.prepare(qweight, scales, qzeros, 64).kernel == "fastawq"
    ref = reference.awq_gemm(x, qweight, scales, qzeros, 64)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_int4
def test_without_compiled_kernel_torch_int4_serves(monkeypatch):
    monkeypatch.delenv("FASTAWQ_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_backend, "_FAST_MISSING", "fastawq._C is not loaded (test)")
    qweight, scales, qzeros = random_awq(128, 64, 64)
    x = random_input((2, 128), dtype=torch.bfloat16)
    assert cpu_backend.kernel_for(x.dtype, qweight, 64) == ("torch-int4", "")
    out = cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64)
    assert cpu_backend.prepare(qweight, scales, qzeros, 64).kernel == "torch-int4"
    _check(out, x, qweight, scales, qzeros, 64)


def test_bad_kernel_name_is_an_error(monkeypatch):
    monkeypatch.setenv("FASTAWQ_CPU_KERNEL", "ipex")
    qweight, _, _ = random_awq(128, 64, 64)
    with pytest.raises(ValueError, match="FASTAWQ_CPU_KERNEL='ipex'"):
        cpu_backend.kernel_for(torch.float32, qweight, 64)


def test_torch_without_the_kernel_declines(monkeypatch):
    monkeypatch.delenv("FASTAWQ_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu_backend, "_FAST_MISSING", "fastawq._C is not loaded (test)")
    monkeypatch.setattr(cpu_backend, "_KERNEL_MISSING", "torch 2.3 has no _weight_int4pack_mm_for_cpu")
    qweight, scales, qzeros = random_awq(128, 64, 64)
    x = random_input((2, 128), dtype=torch.bfloat16)
    assert "no _weight_int4pack_mm_for_cpu" in cpu_backend.awq_gemm_fits(x, qweight, 64)
    out = ops.awq_gemm(x, qweight, scales, qzeros, 64)
    assert torch.equal(out, reference.awq_gemm(x, qweight, scales, qzeros, 64))


def test_bad_inputs_name_the_shapes(kernel):
    qweight, scales, qzeros = random_awq(128, 64, 64)
    with pytest.raises(ValueError, match=r"x \(3, 64\) has K=64 but qweight \(128, 8\)"):
        cpu_backend.awq_gemm(random_input((3, 64)).float(), qweight, scales, qzeros, 64)
    with pytest.raises(ValueError, match=r"bias \(32,\) must have shape \(64,\)"):
        cpu_backend.awq_gemm(random_input((3, 128)).float(), qweight, scales, qzeros, 64, torch.zeros(32))
    with pytest.raises(ValueError, match="must be 2-D"):
        cpu_backend.awq_gemm(random_input((128,)).float(), qweight, scales, qzeros, 64)
    with pytest.raises(ValueError, match="inconsistent AWQ shapes"):
        cpu_backend.prepare(qweight, scales[:1], qzeros, 64)


def test_repack_is_cached_and_invalidated_by_writes(kernel):
    cpu_backend.clear_cache()
    qweight, scales, qzeros = random_awq(256, 64, 64, seed=1)
    x = random_input((4, 256), dtype=torch.bfloat16)
    first = cpu_backend.prepare(qweight, scales, qzeros, 64)
    assert cpu_backend.prepare(qweight, scales, qzeros, 64) is first
    out1 = cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64)
    assert cpu_backend.cache_size() == 1
    # In-place writes (load_state_dict copies into the buffers) must reach the kernel.
    new_q, new_s, new_z = random_awq(256, 64, 64, seed=2)
    qweight.copy_(new_q)
    out2 = cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64)
    _check(out2, x, qweight, scales, qzeros, 64)
    assert not torch.equal(out1, out2)
    scales.copy_(new_s)
    _check(cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64), x, qweight, scales, qzeros, 64)
    qzeros.copy_(new_z)
    _check(cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64), x, qweight, scales, qzeros, 64)
    assert cpu_backend.cache_size() == 1
    del qweight
    gc.collect()
    assert cpu_backend.cache_size() == 0


def _tiny_w4_llama(seed: int):
    """A 2-layer random Llama whose decoder linears are WQLinear (groups of 32)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, WQLinear.from_linear(child, 32))
    return model


def test_tiny_llama_wqlinear_matches_torch_backend(kernel):
    model = _tiny_w4_llama(seed=0)
    qlayers = [mod for mod in model.modules() if isinstance(mod, WQLinear)]
    assert len(qlayers) == 14
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    cpu_backend.clear_cache()
    with torch.no_grad():
        fast = model(ids).logits
        assert cpu_backend.cache_size() == 14  # every layer went through the CPU kernel
        for mod in qlayers:
            mod.backend = "torch"
        slow = model(ids).logits
    assert torch.isfinite(fast).all()
    rel = (fast - slow).abs().max() / slow.abs().max()
    assert rel < 3e-2, f"relative logit difference {rel:.3g}"
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() > 0.9


def test_convert_model_gives_the_same_logits_as_dispatch(kernel):
    model = _tiny_w4_llama(seed=1)
    # One layer no kernel takes (group size 12) must stay a WQLinear.
    model.model.layers[0].mlp.extra = WQLinear.from_linear(torch.nn.Linear(48, 24), 12)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
        assert cpu_linear.convert_model(model) == 14
        assert isinstance(model.model.layers[0].mlp.extra, WQLinear)
        assert isinstance(model.model.layers[1].self_attn.q_proj, cpu_linear.CPUInt4Linear)
        assert model.model.layers[1].self_attn.q_proj.packed.kernel == kernel
        after = model(ids).logits
    assert torch.equal(before, after)


def test_cpu_int4_linear_with_bias_and_3d_input(kernel):
    from fastawq.modules.qlinear import WQLinear

    torch.manual_seed(2)
    layer = WQLinear.from_linear(torch.nn.Linear(256, 80), 64)
    lean = cpu_linear.CPUInt4Linear.from_wqlinear(layer)
    x = random_input((2, 3, 256), dtype=torch.float32)
    out = lean(x)
    assert out.shape == (2, 3, 80) and out.dtype == torch.float32
    _check(out.reshape(6, 80), x.reshape(6, 256), layer.qweight, layer.scales, layer.qzeros, 64, layer.bias.float())


def test_inference_mode_tensors(kernel):
    # Inference tensors keep no version counter; the cache must still work with them.
    with torch.inference_mode():
        qweight, scales, qzeros = random_awq(128, 64, 64)
        x = random_input((2, 128), dtype=torch.bfloat16)
        out = cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64)
        assert cpu_backend.prepare(qweight, scales, qzeros, 64) is cpu_backend.prepare(qweight, scales, qzeros, 64)
    _check(out, x, qweight, scales, qzeros, 64)


def test_layer_loaded_in_inference_mode_runs_everywhere():
    # A checkpoint loaded inside torch.inference_mode() could not generate: WQLinear's plan key
    # read the weights' version counter, which inference tensors do not keep.
    torch.manual_seed(4)
    with torch.inference_mode():
        layer = WQLinear.from_linear(torch.nn.Linear(128, 64), 64)
    x = random_input((3, 128), dtype=torch.float32)
    for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            out = layer(x)
        _check(out, x, layer.qweight, layer.scales, layer.qzeros, 64, layer.bias.float())
    with torch.inference_mode():
        lean = cpu_linear.CPUInt4Linear.from_wqlinear(layer)
    _check(lean(x), x, layer.qweight, layer.scales, layer.qzeros, 64, layer.bias.float())


@needs_fast
@pytest.mark.parametrize("group_size", [64, -1])
def test_int8_linear_matches_its_quantized_weight(group_size):
    torch.manual_seed(3)
    lin = torch.nn.Linear(192, 72)
    layer = cpu_linear.CPUInt8Linear.from_linear(lin, group_size)
    q, s, z = reference.quantize_groupwise(lin.weight, group_size, 8, True)
    g = reference.resolve_group_size(group_size, 192)
    w = ((q.view(72, 192 // g, g) - z.unsqueeze(-1)) * s.unsqueeze(-1)).view(72, 192)
    x = random_input((2, 5, 192), dtype=torch.float32)
    out = layer(x)
    ref = torch.nn.functional.linear(x, w, lin.bias)
    assert out.shape == (2, 5, 72) and out.dtype == torch.float32
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    # 8 bits per group: within 1% of the float layer on random weights.
    full = lin(x)
    assert (out - full).abs().max() <= 1e-2 * full.abs().max()
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@needs_fast
@pytest.mark.parametrize("bits", [8, 4])
def test_convert_model_lm_head(bits):
    transformers = pytest.importorskip("transformers")
    from fastawq.modules.qlinear import WQLinear

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).eval()
    mlp = model.model.layers[0].mlp
    mlp.up_proj = WQLinear.from_linear(mlp.up_proj, 32)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(ids).logits
        assert cpu_linear.convert_model(model, lm_head_bits=bits) == 1
        head = model.lm_head
        assert isinstance(head, cpu_linear.CPUInt8Linear if bits == 8 else cpu_linear.CPUInt4Linear)
        assert model.model.embed_tokens.weight.dtype == torch.float32  # the tied embedding is untouched
        after = model(ids).logits
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert rel < (2e-2 if bits == 8 else 2e-1), rel
    with pytest.raises(ValueError, match="lm_head_bits must be 4, 8 or None"):
        model.lm_head = torch.nn.Linear(64, 256, bias=False)
        cpu_linear.convert_model(model, lm_head_bits=6)


def _save_tiny_llama(path) -> None:
    """A tiny random Llama, AWQ-quantized (group 32) and saved at path."""
    from fastawq.auto import AWQModel
    from fastawq.quantize import QuantConfig, quantize
    from test_models import calib_ids, tiny_model

    model = tiny_model("llama")
    qc = QuantConfig(q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(), max_calib_samples=4, max_calib_seq_len=32)
    AWQModel(model, qc).save_quantized(path)


@needs_fast
def test_from_quantized_use_ipex_converts_and_heads(tmp_path):
    # AutoAWQ's use_ipex=True lands on this backend: packed layers become CPUInt4Linear (same
    # logits as dispatch), and cpu_lm_head_bits=8 makes the float head an 8-bit layer.
    from fastawq.auto import AutoAWQForCausalLM
    from test_models import calib_ids

    _save_tiny_llama(tmp_path)
    ids = calib_ids(1, 10)
    plain = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")
    lean = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", use_ipex=True)
    head8 = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", use_ipex=True, cpu_lm_head_bits=8)
    assert any(isinstance(m, cpu_linear.CPUInt4Linear) for m in lean.modules())
    assert isinstance(head8.model.lm_head, cpu_linear.CPUInt8Linear)
    with torch.no_grad():
        ref = plain(ids).logits
        assert torch.equal(lean(ids).logits, ref)
        rel = ((head8(ids).logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 2e-2, rel
    with pytest.raises(ValueError, match="cpu_lm_head_bits needs the fused CPU engine"):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", cpu_lm_head_bits=8)


@needs_fast
def test_from_quantized_fuses_on_the_cpu(tmp_path, monkeypatch):
    # fuse_layers=True on the CPU: decode through fused_cpu.CPUDecodeStep with the engine's 8-bit
    # head (cpu_lm_head_bits=None keeps it float); FASTAWQ_CPU_FUSE=1 makes that the default;
    # without it a CPU load stays unfused. The saved checkpoint is untouched throughout.
    from fastawq.auto import AutoAWQForCausalLM
    from fastawq.modules.qlinear import WQLinear
    from test_models import calib_ids

    _save_tiny_llama(tmp_path)
    saved = sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir())
    monkeypatch.delenv("FASTAWQ_CPU_FUSE", raising=False)
    plain = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")
    head8 = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", max_seq_len=64, fuse_layers=True)
    fused = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", max_seq_len=64, fuse_layers=True,
                                              cpu_lm_head_bits=None)
    monkeypatch.setenv("FASTAWQ_CPU_FUSE", "1")
    auto = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", max_seq_len=64, cpu_lm_head_bits=None)
    assert not hasattr(plain.model, "fastawq_runtime") and any(isinstance(m, WQLinear) for m in plain.modules())
    assert isinstance(head8.model.fastawq_runtime.lm_head, cpu_linear.CPUInt8Linear)
    for m in (fused, auto):
        rt = m.model.fastawq_runtime
        assert rt.cpu_step is not None and type(rt.lm_head) is torch.nn.Linear
    ids = calib_ids(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    out = auto.generate(ids, max_new_tokens=6, do_sample=False)
    ref = plain.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(out[:, :12], ref[:, :12])
    assert head8.generate(ids, max_new_tokens=6, do_sample=False).shape[1] >= 11
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir()) == saved
    with pytest.raises(ValueError, match="cpu_lm_head_bits must be 8, 4, None or 'auto'"):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", cpu_lm_head_bits="eight")


@needs_fast
def test_cached_fast_path_sees_writes_and_bias(monkeypatch):
    # awq_gemm's shortcut to a cached fastawq repack must still notice in-place writes, a bias
    # and activations it does not take as they are (fp16).
    monkeypatch.delenv("FASTAWQ_CPU_KERNEL", raising=False)
    qweight, scales, qzeros = random_awq(256, 72, 64, seed=1)
    x = random_input((3, 256), dtype=torch.float32)
    bias = random_input((72,), dtype=torch.float32, seed=9)
    cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64)
    for target, new in zip((qweight, scales, qzeros), random_awq(256, 72, 64, seed=2)):
        target.copy_(new)
        _check(cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64), x, qweight, scales, qzeros, 64)
    _check(cpu_backend.awq_gemm(x, qweight, scales, qzeros, 64, bias), x, qweight, scales, qzeros, 64, bias)
    _check(cpu_backend.awq_gemm(x.half(), qweight, scales, qzeros, 64), x.half(), qweight, scales, qzeros, 64)
    assert cpu_backend.prepare(qweight, scales, qzeros, 64).kernel == "fastawq"


@needs_fast
def test_default_activation_mode_is_int8_only_on_avx2_without_avx512(monkeypatch):
    monkeypatch.delenv("FASTAWQ_CPU_ACT", raising=False)
    isas = cpu_backend.fast_kernel_isas()
    avx2_only = "avx2_int8" in isas and "avx512" not in isas
    assert cpu_backend.DEFAULT_ACT == "auto"
    assert cpu_backend.act_isa() == ("int8" if avx2_only else "auto")
    assert cpu_backend.act_isa("exact") == "auto"
    monkeypatch.setenv("FASTAWQ_CPU_ACT", "sometimes")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_backend.act_isa()


@needs_fast
@pytest.mark.parametrize("mode", ["exact", "auto"] + (["int8"] if "avx2_int8" in cpu_backend.fast_kernel_isas() else []))
def test_public_op_and_layer_follow_the_activation_mode(mode, monkeypatch):
    # ops.awq_gemm (first call and cached repack) and a WQLinear's bound plan must run the kernel
    # in the configured mode: bit-equal to awq_cpu_gemm called with that mode's isa.
    monkeypatch.delenv("FASTAWQ_CPU_KERNEL", raising=False)
    monkeypatch.setenv("FASTAWQ_CPU_ACT", mode)
    k, n, g = 256, 72, 64
    qweight, scales, qzeros = random_awq(k, n, g, seed=5)
    x = random_input((3, k), dtype=torch.float32, seed=6)
    isa = cpu_backend.act_isa()
    p = cpu_backend.repack_fast(qweight, scales, qzeros, g)
    want = torch.ops.fastawq.awq_cpu_gemm(x, p.w, p.scales, p.zeros16, g, n, None, isa)
    first = ops.awq_gemm(x, qweight, scales, qzeros, g)
    cached = ops.awq_gemm(x, qweight, scales, qzeros, g)
    assert torch.equal(first, want) and torch.equal(cached, want)
    layer = WQLinear(k, n, g, bias=False, dtype=scales.dtype)
    with torch.no_grad():
        layer.qweight.copy_(qweight)
        layer.scales.copy_(scales)
        layer.qzeros.copy_(qzeros)
    p2 = cpu_backend.repack_fast(layer.qweight, layer.scales, layer.qzeros, g)
    want2 = torch.ops.fastawq.awq_cpu_gemm(x, p2.w, p2.scales, p2.zeros16, g, n, None, isa)
    assert torch.equal(layer(x), want2)
    ref = reference.awq_gemm(x, qweight, scales, qzeros, g)
    rel = float((first - ref).norm() / ref.norm())
    assert rel < (2e-2 if isa == "int8" else 1e-6), f"mode {mode} (isa {isa}): relative error {rel:.3g}"


def test_env_switch_follows_os_environ(monkeypatch):
    # The hot path reads switches without os.environ's key encoding; it must see every change
    # made through os.environ (monkeypatch, a user's os.environ[...] = ...), set, emptied or removed.
    monkeypatch.delenv("FASTAWQ_TEST_SWITCH", raising=False)
    assert backend.env_switch(b"FASTAWQ_TEST_SWITCH") is None
    monkeypatch.setenv("FASTAWQ_TEST_SWITCH", "int8")
    assert backend.env_switch(b"FASTAWQ_TEST_SWITCH") == "int8"
    monkeypatch.setenv("FASTAWQ_TEST_SWITCH", "")
    assert backend.env_switch(b"FASTAWQ_TEST_SWITCH") == ""
    monkeypatch.delenv("FASTAWQ_TEST_SWITCH")
    assert backend.env_switch(b"FASTAWQ_TEST_SWITCH") is None
