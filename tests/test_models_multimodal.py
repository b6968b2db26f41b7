"""Vision-language wrappers: the language model is AWQ-quantized, the vision tower and projector
stay bit-identical in float and are listed in modules_to_not_convert (tiny random configs, CPU)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.models import architecture_of
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig, pack_model, pseudo_quantize_model, quantize

VOCAB = 256
IMAGE = 255  # image placeholder token of every config here
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_VIT = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=32, patch_size=8)

# test id -> (config, image tokens per 32x32 image or None when this test feeds no image)
CONFIGS = {
    "gemma3": (lambda: transformers.Gemma3Config(
        text_config=dict(_TEXT, sliding_window=16), vision_config=dict(_VIT, num_hidden_layers=1),
        mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=253, eoi_token_index=254), 4),
    "llava": (lambda: transformers.LlavaConfig(
        text_config=dict(_TEXT, model_type="llama"),
        vision_config=dict(_VIT, model_type="clip_vision_model", num_hidden_layers=2, projection_dim=32),
        image_token_index=IMAGE), 16),
    "llava_next": (lambda: transformers.LlavaNextConfig(
        text_config=dict(_TEXT, model_type="llama"),
        vision_config=dict(_VIT, model_type="clip_vision_model", num_hidden_layers=2, projection_dim=32),
        image_grid_pinpoints=[[32, 32]], image_token_index=IMAGE), None),
    "mistral3": (lambda: transformers.Mistral3Config(
        text_config=dict(_TEXT, model_type="mistral"),
        vision_config=dict(_VIT, model_type="pixtral", num_hidden_layers=1, head_dim=16),
        image_token_index=IMAGE), None),
    "qwen2_5_vl": (lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(_TEXT, model_type="qwen2_5_vl_text",
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=254, vision_start_token_id=253), None),
    "qwen2_vl": (lambda: transformers.Qwen2VLConfig(
        text_config=dict(_TEXT, model_type="qwen2_vl_text",
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE, video_token_id=254, vision_start_token_id=253), None),
}


def test_every_image_text_type_has_a_tiny_model_here():
    from fastawq.models import REGISTRY

    wrappers = {t for t, a in REGISTRY.items() if a.auto_class != "AutoModelForCausalLM"}
    assert wrappers == set(CONFIGS)


def tiny_vlm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(CONFIGS[name][0](), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _vision_state(model, keep) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if any(f".{m}." in f".{k}" for m in keep)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_vlm_quantize_save_load_generate(name, tmp_path):
    model = tiny_vlm(name)
    spec = architecture_of(model)
    vision = _vision_state(model, spec.keep_float)
    assert vision
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        fp = model(input_ids=ids).logits
    qc = QuantConfig(w_bit=4, q_group_size=32)
    calib = torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    quantize(model, None, qc, calib=calib, max_calib_samples=2, max_calib_seq_len=32, export_compatible=True)
    assert all(m in qc.modules_to_not_convert for m in spec.keep_float)
    pseudo = pseudo_quantize_model(copy.deepcopy(model), qc)
    pack_model(model, qc)
    n_packed = sum(isinstance(m, WQLinear) for m in model.modules())
    assert n_packed == sum(isinstance(m, WQLinear) for m in model.get_submodule(spec.layers_path).modules()) > 0
    AWQModel(model, qc).save_quantized(tmp_path / "q")
    try:
        loaded = AutoAWQForCausalLM.from_quantized(tmp_path / "q", device_map="cpu").model
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        pytest.skip(f"checkpoint.load_quantized builds AutoModelForCausalLM, which has no {name}: "
                    f"it needs the record's auto_class ({spec.auto_class})")
    state = loaded.state_dict()
    for k, v in vision.items():
        assert torch.equal(state[k], v), k  # the vision tower is untouched, bit for bit
    with torch.no_grad():
        ref = pseudo(input_ids=ids).logits
        out = loaded(input_ids=ids).logits
    # As in test_models: fp16 packed scales move the logits far less than quantization did.
    assert (out - ref).abs().max() <= 0.2 * (ref - fp).abs().max() + 1e-4
    per_image = CONFIGS[name][1]
    if per_image is not None:
        prompt = torch.tensor([[1, 5, 6] + [IMAGE] * per_image + [7, 8]])
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        gen = loaded.generate(input_ids=prompt, pixel_values=pixels, max_new_tokens=3, do_sample=False)
        assert gen.shape == (1, prompt.shape[1] + 3)
