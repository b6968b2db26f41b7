"""fastawq as transformers' AWQ backend: `AutoModelForCausalLM.from_pretrained(awq_dir)` without
GPTQModel loads fastawq's WQLinear and gives from_quantized's logits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import requires_cuda
from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.generate import HFStepper
from fastawq.integrations import transformers as fit
from fastawq.models import architecture_of
from fastawq.models.moe import moe_spec_of, router_names
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig, pack_model, quantize
from test_layouts import _rewrite
from test_models import calib_ids, tiny_model
from test_moe_models import ids_, tiny_moe

pytestmark = pytest.mark.skipif(fit.gptqmodel_installed(), reason="GPTQModel installed: transformers keeps it")


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    model = tiny_model("llama")
    qc = QuantConfig(q_group_size=32)
    pack_model(model, qc)
    d = tmp_path_factory.mktemp("awq")
    AWQModel(model, qc).save_quantized(d)
    return d


@pytest.fixture
def registered():
    assert fit.register()
    yield
    fit.register()


def _hf(awq_dir, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(awq_dir), **kw).eval()


def test_transformers_load_matches_from_quantized(awq_dir, registered):
    ids = calib_ids(2, 12, seed=3)
    hf = _hf(awq_dir, dtype=torch.float32)
    packed = {n for n, m in hf.named_modules() if isinstance(m, WQLinear)}
    assert len(packed) == 2 * 7 and "lm_head" not in packed
    ref = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cpu", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        greedy = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(hf.generate(ids[:1], **greedy), ref.generate(ids[:1], **greedy))



def test_both_loaders_build_the_same_model(awq_dir, registered):
    """Decode speed may differ only by the process's state, not by the model each loader builds."""
    hf = _hf(awq_dir, dtype=torch.float32)
    fq = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cpu", torch_dtype=torch.float32).model
    assert {n: type(m) for n, m in hf.named_modules()} == {n: type(m) for n, m in fq.named_modules()}
    assert hf.config._attn_implementation == fq.config._attn_implementation == "sdpa"
    assert hf.generation_config.to_diff_dict() == fq.generation_config.to_diff_dict()
    tensors = [dict(list(m.named_parameters()) + list(m.named_buffers())) for m in (hf, fq)]
    assert tensors[0].keys() == tensors[1].keys()
    for name, a in tensors[0].items():
        b = tensors[1][name]
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
        assert torch.equal(a, b), name
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert fq.lm_head.weight is fq.model.embed_tokens.weight

def _tensors(model) -> dict[str, torch.Tensor]:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def _moe_dir(arch: str, d):
    """A round-to-nearest packed tiny MoE checkpoint (experts saved one by one, routers in full precision)."""
    model = tiny_moe(arch)
    spec, layers = moe_spec_of(model), architecture_of(model).layers_path
    qc = QuantConfig(q_group_size=32, modules_to_not_convert=router_names(model, layers, spec))
    pack_model(model, qc)
    AWQModel(model, qc).save_quantized(d)
    return d


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "llama4_text"])
def test_moe_checkpoint_loads_into_unfused_experts(arch, registered, tmp_path):
    """transformers 5 builds MoE experts fused (3-D); the checkpoint stores them one by one: the backend
    unfuses them first, every packed tensor lands by name (Mixtral's `block_sparse_moe` included) and
    the model is from_quantized's, tensor for tensor."""
    d = _moe_dir(arch, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                                 output_loading_info=True)
    hf.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got = _tensors(hf)
    assert not [n for n, t in got.items() if t.is_meta]
    fq = AutoAWQForCausalLM.from_quantized(d, device_map="cpu", torch_dtype=torch.float32).model
    assert {n: type(m) for n, m in hf.named_modules()} == {n: type(m) for n, m in fq.named_modules()}
    assert any(".experts." in n for n, m in hf.named_modules() if isinstance(m, WQLinear)) or any(
        type(m).__name__ == "WQExperts" for m in hf.modules())
    ref = _tensors(fq)
    assert got.keys() == ref.keys()
    # Equal to what from_quantized read: no expert left as transformers' initialisation drew it.
    assert [n for n in ref if not torch.equal(got[n], ref[n])] == []
    ids = ids_(2, 12, 3)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, fq(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "llama4_text"])
def test_save_pretrained_writes_grouped_experts_as_the_checkpoint_had_them(arch, registered, tmp_path):
    """save_pretrained of a model whose experts the backend grouped into WQExperts (strided
    per-expert views) writes the same per-expert tensors the checkpoint held, and both loaders
    read it back to the same model."""
    from safetensors.torch import load_file

    d = _moe_dir(arch, tmp_path / "src")
    hf = _hf(d, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "saved")
    src, saved = load_file(d / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(src)
    assert all(torch.equal(saved[k], src[k]) for k in src)
    ids = ids_(2, 12, 5)
    fq = AutoAWQForCausalLM.from_quantized(d, device_map="cpu", torch_dtype=torch.float32).model
    again = AutoAWQForCausalLM.from_quantized(tmp_path / "saved", device_map="cpu", torch_dtype=torch.float32).model
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, fq(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(_hf(tmp_path / "saved", dtype=torch.float32)(ids).logits, hf(ids).logits,
                                   rtol=0, atol=0)


def test_moe_float_experts_stay_fused(registered, tmp_path):
    """Experts kept in full precision are saved as per-expert `.weight`s: only packed experts are
    unfused, so transformers' own converters still merge these into its fused experts."""
    model = tiny_moe("mixtral")
    qc = QuantConfig(q_group_size=32, modules_to_not_convert=["experts"])
    pack_model(model, qc)
    AWQModel(model, qc).save_quantized(tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    fq = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", torch_dtype=torch.float32).model
    ids = ids_(2, 12, 4)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, fq(ids).logits, rtol=1e-5, atol=1e-5)


def test_moe_older_layout_loads_repacked(registered, tmp_path):
    """A gemv Mixtral checkpoint: its per-expert tensors are repacked to gemm, then the experts grouped."""
    src = _moe_dir("mixtral", tmp_path / "gemm")
    _rewrite(src, tmp_path / "gemv", "gemv", 32)
    hf = _hf(tmp_path / "gemv", dtype=torch.float32)
    assert all(type(m).__name__ != "_LayoutTensors" for m in hf.modules())
    fq = AutoAWQForCausalLM.from_quantized(src, device_map="cpu", torch_dtype=torch.float32).model
    assert {n: type(m) for n, m in hf.named_modules()} == {n: type(m) for n, m in fq.named_modules()}
    ids = ids_(2, 12, 4)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, fq(ids).logits, rtol=1e-5, atol=1e-5)


def test_activation_scales_load(registered, tmp_path):
    """GPT-NeoX checkpoints carry AWQ's `mlp.act.scales`: the backend gives them a ScaledActivation."""
    model = tiny_model("gpt_neox")
    qc = QuantConfig(q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(), max_calib_samples=2, max_calib_seq_len=16)
    AWQModel(model, qc).save_quantized(tmp_path)
    ids = calib_ids(1, 12, seed=4)
    hf = _hf(tmp_path, dtype=torch.float32)
    assert type(hf.gpt_neox.layers[0].mlp.act).__name__ == "ScaledActivation"
    ref = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@requires_cuda
def test_transformers_load_on_gpu(awq_dir, registered):
    ids = calib_ids(2, 12, seed=3).cuda()
    hf = _hf(awq_dir, dtype=torch.float16, device_map="cuda")
    assert hf.model.layers[0].mlp.down_proj.qweight.is_cuda
    ref = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cuda", torch_dtype=torch.float16, fuse_layers=False)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("layout", ["gemv", "gemv_fast"])
def test_older_autoawq_layouts_load_repacked(awq_dir, registered, tmp_path, layout):
    # transformers' AwqConfig knows gemv and gemv_fast (not marlin: its config is refused before any backend).
    _rewrite(awq_dir, tmp_path / layout, layout, 32)
    ids = calib_ids(1, 12, seed=4)
    hf = _hf(tmp_path / layout, dtype=torch.float32)
    assert hf.config.quantization_config.format == "gemm"
    assert all(type(m).__name__ != "_LayoutTensors" for m in hf.modules())
    ref = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cpu", torch_dtype=torch.float32)
    # What transformers saves from it is a gemm checkpoint that fastawq reads back unchanged.
    hf.save_pretrained(tmp_path / "saved")
    again = AutoAWQForCausalLM.from_quantized(tmp_path / "saved", device_map="cpu", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_unknown_layout_is_a_clear_error(awq_dir, registered, tmp_path):
    for f in awq_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["version"] = "llm-awq"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="llm-awq"):
        _hf(tmp_path)


def test_an_installed_gptqmodel_keeps_awq(monkeypatch):
    from transformers.quantizers import auto
    from transformers.quantizers.quantizer_awq import AwqQuantizer

    fit.unregister()
    try:
        assert auto.AUTO_QUANTIZER_MAPPING["awq"] is AwqQuantizer
        monkeypatch.setattr(fit, "gptqmodel_installed", lambda: True)
        assert not fit.register() and auto.AUTO_QUANTIZER_MAPPING["awq"] is AwqQuantizer
        fit.register_on_import()
        assert not fit.is_registered()
        assert fit.register(force=True) and fit.is_registered()
        fit.unregister()
        monkeypatch.setattr(fit, "gptqmodel_installed", lambda: False)
        monkeypatch.setenv("FASTAWQ_TRANSFORMERS_BACKEND", "0")
        fit.register_on_import()
        assert not fit.is_registered()
    finally:
        fit.register()


def test_import_fastawq_registers_lazily():
    """`import fastawq` must not import transformers, yet the registry gets fastawq when it loads."""
    code = (
        "import sys, fastawq\n"
        "assert 'transformers.quantizers.auto' not in sys.modules\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m\n"
        "print(m['awq'].__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "fastawq.integrations.hf_quantizer"


def _spy_sdpa(monkeypatch):
    """Records, per call of transformers' sdpa attention, whether cuDNN SDPA was enabled."""
    from transformers.integrations import sdpa_attention

    seen, real = [], sdpa_attention.sdpa_attention_forward

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    return seen


def test_sdpa_without_cudnn_gives_sdpa_logits(awq_dir, monkeypatch):
    # Padded batch: the 2-D mask must reach the attention as transformers' sdpa mask does.
    ids = calib_ids(2, 12, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    model = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cpu", torch_dtype=torch.float32).model
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        assert fit.use_sdpa_without_cudnn(model)
        assert model.config._attn_implementation == fit.SDPA_NO_CUDNN
        assert not fit.use_sdpa_without_cudnn(model)  # already switched: nothing to do
        seen = _spy_sdpa(monkeypatch)
        out = model(ids, attention_mask=mask).logits
    assert len(seen) == model.config.num_hidden_layers
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@requires_cuda
def test_sdpa_without_cudnn_on_gpu(awq_dir, monkeypatch):
    """from_quantized's unfused GPU model attends without cuDNN (no plan per KV length)."""
    ids = calib_ids(2, 12, seed=5).cuda()
    model = AutoAWQForCausalLM.from_quantized(awq_dir, device_map="cuda", torch_dtype=torch.float16,
                                              fuse_layers=False).model
    assert model.config._attn_implementation == fit.SDPA_NO_CUDNN

    def prefill_and_step():  # a prefill, then one decode step against its KV cache
        step = HFStepper(model)
        return step.prefill(ids[:, :-1]), step.decode(ids[:, -1])

    saved = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        seen = _spy_sdpa(monkeypatch)
        out = prefill_and_step()
        assert len(seen) == 2 * model.config.num_hidden_layers and not any(seen), "cuDNN SDPA off inside attention"
        assert torch.backends.cuda.cudnn_sdp_enabled(), "and back on after it"
        model.set_attn_implementation("sdpa")
        ref = prefill_and_step()
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r, rtol=2e-3, atol=2e-3)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved)
