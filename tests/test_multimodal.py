"""Vision-language models (tiny random configs of Gemma 3, Qwen2.5-VL, Qwen2-VL, Mistral 3, LLaVA,
LLaVA-NeXT and Llama 4 (a dense and an MoE text layer); CPU, float32): only the language model is quantized, the vision tower and projector stay
bit-identical, and the packed checkpoint generates from an image.

Pixel inputs are built directly (input_ids with the image token ids + pixel_values in each
family's layout), so the core tests need neither Pillow nor torchvision. The processor tests (the
family's real processor class over a tiny word-level vocabulary and a small image processor, fed
synthetic images) need Pillow; the Qwen-VL, Mistral 3 (Pixtral) and Llama 4 processors also need torchvision
and skip without it. LLaVA-NeXT's images are sized so that anyres tiling picks 2-4 tiles."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.models import UnsupportedModelError, architecture_of
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig, pseudo_quantize_model

VOCAB = 128
IMG = 120  # the image token id of every tiny config
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # sections sum to head_dim / 2
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]  # LLaVA-NeXT's anyres grids (tiles of 28 px)
# Llama 4: dense layer 0, MoE layer 1 (top-1 of 4 experts, a shared expert; a router of 4 outputs, which
# quantize()'s up-front check once refused as unpackable). Its vision MLP's width is
# 4x its hidden size (the pixel shuffle's 2x2 merge feeds the adapter), so tiles of 56 px give 4 tokens.
_LLAMA4_TEXT = dict(_TEXT, head_dim=16, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2)
_LLAMA4_VISION = dict(_VISION, intermediate_size=128, image_size=56, vision_output_dim=64, projector_input_dim=64,
                      projector_output_dim=64)


def tiny_config(family: str):
    if family == "gemma3":
        return transformers.Gemma3Config(
            text_config=dict(_TEXT, head_dim=16, sliding_window=16,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(_VISION, image_size=28), mm_tokens_per_image=4, image_token_index=IMG,
            boi_token_index=121, eoi_token_index=122)
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_parameters=dict(_MROPE), bos_token_id=1, eos_token_id=2),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[0]),
            image_token_id=IMG, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    if family == "qwen2_vl":
        return transformers.Qwen2VLConfig(
            text_config=dict(_TEXT, rope_parameters=dict(_MROPE), bos_token_id=1, eos_token_id=2),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=IMG, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    if family == "mistral3":
        return transformers.Mistral3Config(
            text_config=dict(_TEXT, model_type="mistral", head_dim=16),
            vision_config=dict(_VISION, model_type="pixtral", image_size=56, head_dim=16),
            image_token_index=IMG, spatial_merge_size=2)
    if family == "llava":
        return transformers.LlavaConfig(
            text_config=dict(_TEXT, model_type="llama"),
            vision_config=dict(_VISION, model_type="clip_vision_model", image_size=28, projection_dim=32),
            image_token_index=IMG, image_seq_length=4)
    if family == "llava_next":
        return transformers.LlavaNextConfig(
            text_config=dict(_TEXT, model_type="mistral", head_dim=16),
            vision_config=dict(_VISION, model_type="clip_vision_model", image_size=28, projection_dim=32),
            image_token_index=IMG, image_grid_pinpoints=_PINPOINTS)
    if family == "llama4":
        return transformers.Llama4Config(text_config=_LLAMA4_TEXT, vision_config=_LLAMA4_VISION,
                                         image_token_index=IMG, boi_token_index=122, eoi_token_index=123)
    raise KeyError(family)


def tiny_vlm(family: str, seed: int = 0) -> torch.nn.Module:
    from fastawq.multimodal import repair_forward

    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a wrong scale fold
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 3 or name.endswith("router.weight"):
                p.normal_(0, 0.2)  # transformers leaves fused experts and routers near zero
    # The float reference runs outside AWQModel, which applies this itself (transformers 5.24's
    # Llama 4 wrapper cannot return its output otherwise).
    return repair_forward(model)


def image_inputs(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids with the image tokens in place, and pixel inputs for one small image."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 100, (1, 6), generator=g)
    pixels = torch.randn(1, 3, 28, 28, generator=g)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        # 2x2 patches of 14 px over 2 frames, flattened; the 2x2 merge makes one image token.
        grid = torch.tensor([[1, 2, 2]])
        pv = torch.randn(4, 3 * 2 * 14 * 14, generator=g)
        ids = torch.cat([text[:, :2], torch.tensor([[122, IMG, 123]]), text[:, 2:]], dim=1)
        out = {"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid}
        if family == "qwen2_vl":  # its mrope reads which tokens are image tokens from this
            out["mm_token_type_ids"] = (ids == IMG).long()
        return out
    if family in ("mistral3", "llama4"):
        # 56 px: 4x4 patches merged 2x2 into 4 tokens (a single image token trips transformers'
        # squeeze of the feature batch); Llama 4's pixel shuffle merges them 2x2 the same way.
        pixels = torch.randn(1, 3, 56, 56, generator=g)
    n_img = 4
    if family == "llava_next":
        # A 40x80 image: anyres picks the 28x56 grid, so a base tile + 2 tiles of 28 px. Tokens: the
        # base tile's 2x2 features + the 2x4 grid features (no unpadding: same aspect) + one newline
        # per grid row = 14 (transformers refuses a mismatch).
        pixels = torch.randn(1, 3, 3, 28, 28, generator=g)
        n_img = 4 + 8 + 2
    ids = torch.cat([text[:, :2], torch.full((1, n_img), IMG), text[:, 2:]], dim=1)
    out = {"input_ids": ids, "pixel_values": pixels}
    if family == "llava_next":
        out["image_sizes"] = torch.tensor([[40, 80]])
    if family == "mistral3":
        out["image_sizes"] = torch.tensor([[56, 56]])
    if family == "gemma3":
        out["token_type_ids"] = (ids == IMG).long()
    return out


def text_ids(n: int = 4, seq_len: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (n, seq_len), generator=torch.Generator().manual_seed(seed))


def vision_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "language_model" not in k and not k.startswith("lm_head")}


FAMILIES = ["gemma3", "qwen2_5_vl", "qwen2_vl", "mistral3", "llava", "llava_next", "llama4"]
# What modules_to_not_convert must name: transformers matches from the start of the name, vLLM a
# substring of its own name. Llama 4's wrapper has no inner `model`: its names are both at once.
_FULL_PRECISION = {"qwen2_vl": ["model.visual", "visual"], "qwen2_5_vl": ["model.visual", "visual"],
                   "llama4": ["vision_model", "multi_modal_projector"]}


@pytest.fixture(scope="module", params=FAMILIES)
def quantized(request, tmp_path_factory):
    """(family, float original, pseudo-quantized float model, loaded packed model, checkpoint dir)."""
    family = request.param
    model = tiny_vlm(family)
    original = copy.deepcopy(model)
    w = AWQModel(model)
    w.quantize(None, {"q_group_size": 32}, calib_data=text_ids(), max_calib_samples=4, max_calib_seq_len=32,
               export_compatible=True)
    pseudo = pseudo_quantize_model(copy.deepcopy(model), w.quant_config)
    w.pack()
    d = tmp_path_factory.mktemp(family)
    w.save_quantized(d)
    loaded = AutoAWQForCausalLM.from_quantized(d, device_map="cpu")
    return family, original, pseudo, loaded, d


def test_language_model_packed_vision_kept_full_precision(quantized):
    """Every linear of the decoder layers is packed (an MoE layer's experts and shared expert
    included) except the routers; nothing outside the language model is."""
    from fastawq.models.moe import moe_spec_of

    family, original, _, loaded, d = quantized
    arch = architecture_of(loaded.model)
    spec = moe_spec_of(loaded.model)
    routers = {f"{spec.block}.{n}" for n in spec.float_consumers()} if spec else set()
    for layer in loaded.model.get_submodule(arch.layers_path):
        lins = {n: m for n, m in layer.named_modules() if isinstance(m, (torch.nn.Linear, WQLinear))}
        assert {*arch.attn_linears()} <= set(lins)
        assert all(isinstance(m, WQLinear) != (n in routers) for n, m in lins.items()), lins
    if spec is not None:
        assert any(".experts.0." in n and isinstance(m, WQLinear) for n, m in loaded.model.named_modules())
    lm = arch.layers_path.rsplit(".", 2)[0]
    assert not any(isinstance(m, WQLinear) for n, m in loaded.model.named_modules() if not n.startswith(lm))
    ref, got = vision_state(original), vision_state(loaded.model)
    assert ref.keys() == got.keys() and ref
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    skip = json.loads((d / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert set(_FULL_PRECISION.get(family, ["model.vision_tower", "vision_tower"])) <= set(skip)


def assert_matches_pseudo(original, pseudo, loaded, inputs, what) -> None:
    """The packed model's logits are the pseudo-quantized float model's, up to the fp16 rounding of
    the packed scales (a fifth of the quantization error itself)."""
    with torch.no_grad():
        fp = original(**inputs).logits
        ref = pseudo(**inputs).logits
        out = loaded(**inputs).logits
    assert torch.isfinite(out).all()
    quant_err = (ref - fp).abs().max().item()
    err = (out - ref).abs().max().item()
    assert quant_err > 0
    assert err <= 0.2 * quant_err + 1e-4, (what, err, quant_err)


def test_logits_equal_pseudo_quantized(quantized):
    """Text-only and with an image: the packed model computes what the pseudo-quantized float
    model computes."""
    family, original, pseudo, loaded, _ = quantized
    for inputs in ({"input_ids": text_ids(2, 16, seed=7)}, image_inputs(family)):
        assert_matches_pseudo(original, pseudo, loaded, inputs, family)


def test_generate_with_image(quantized):
    family, _, pseudo, loaded, _ = quantized
    inputs = image_inputs(family, seed=3)
    n = inputs["input_ids"].shape[1]
    out = loaded.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, n + 4)
    with torch.no_grad():
        ref = pseudo.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert out[0, n] == ref[0, n]  # the first new token depends on the image features


def test_checkpoint_in_transformers_saved_layout_loads(quantized, tmp_path):
    """AutoAWQ and transformers' save_pretrained write the legacy names (language_model.model.layers.N,
    Qwen2-VL's model.layers.N): the loader renames them to the model's own."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import revert_weight_conversion

    family, _, _, loaded, d = quantized
    sd = load_file(str(d / "model.safetensors"))
    legacy = revert_weight_conversion(loaded.model, dict(sd))
    if family == "llama4":  # its module names are the saved ones (language_model.model.layers.N): nothing to rename
        assert set(legacy) == set(sd)
        return
    assert set(legacy) != set(sd)
    for f in d.iterdir():
        # No manifest: AutoAWQ and transformers write none (fastawq's would name the old shard).
        if f.suffix != ".safetensors" and f.name != "fastawq_manifest.json":
            shutil.copy(f, tmp_path / f.name)
    save_file({k: v.contiguous() for k, v in legacy.items()}, str(tmp_path / "model.safetensors"))
    again = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")
    inputs = image_inputs(family, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs).logits, loaded(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_transformers_loads_the_checkpoint(quantized):
    """transformers' image-text auto class (fastawq as its AWQ backend) skips the vision modules
    named in modules_to_not_convert and computes what from_quantized's model computes."""
    from fastawq.integrations import transformers as fit
    from fastawq.multimodal import repair_forward

    if fit.gptqmodel_installed():
        pytest.skip("GPTQModel installed: transformers keeps it as the AWQ backend")
    family, original, _, loaded, d = quantized
    assert fit.register()
    hf, info = transformers.AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                                       output_loading_info=True)
    # Llama 4's per-expert tensors land in unfused experts: nothing missing, nothing left over.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf = repair_forward(hf).eval()  # transformers 5.24's Llama 4 forward (multimodal.repair_forward says why)
    assert not [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    assert sum(isinstance(m, WQLinear) for m in hf.modules()) == sum(isinstance(m, WQLinear) for m in loaded.modules())
    ref, got = vision_state(original), vision_state(hf)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    inputs = image_inputs(family, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(hf(**inputs).logits, loaded(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_fused_engine(quantized):
    """LLaVA / LLaVA-NeXT / Mistral 3 (Llama-layout text): the fused language model prefills the merged
    image+text embeddings and decodes what the unfused packed model decodes. Gemma 3, Qwen2-VL,
    Qwen2.5-VL and Llama 4: a clear reason."""
    from fastawq.multimodal import fuse_model

    family, _, _, loaded, d = quantized
    blocked = {"gemma3": "gemma3_text: the post-attention", "qwen2_5_vl": "mrope", "qwen2_vl": "mrope",
               "llama4": "llama4_text: chunked attention"}
    if family in blocked:
        why = blocked[family]
        with pytest.raises(NotImplementedError, match=why):
            fuse_model(loaded.model, max_seq_len=64, batch_size=1)
        with pytest.raises(NotImplementedError, match=why):
            AutoAWQForCausalLM.from_quantized(d, device_map="cpu", fuse_layers=True)
        return
    inputs = image_inputs(family, seed=6)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref_logits = loaded.model(**inputs).logits
    ref = loaded.model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    fused = fuse_model(copy.deepcopy(loaded.model), max_seq_len=64, batch_size=1, backend="torch")
    with torch.no_grad():
        logits = fused(**inputs).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    out = fused.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, n + 6) and torch.equal(out, ref)
    assert fused.fastawq_runtime.embed.pending is None  # decoded tokens use the token embedding again
    assert hasattr(AutoAWQForCausalLM.from_quantized(d, device_map="cpu", fuse_layers=True), "fastawq_runtime")


def test_image_text_pairs_calibrate_through_the_vision_tower():
    """The image+text quantizer runs each pair through the whole wrapper: its per-pair masks and
    positions reach the layers, and the statistics differ from text-only calibration."""
    from fastawq.multimodal import PairQuantizer

    family = "qwen2_5_vl"  # mrope positions differ per pair: the per-pair keyword path matters here
    batches = [image_inputs(family, seed=s) for s in range(3)]
    model = tiny_vlm(family)
    original = copy.deepcopy(model)
    qc = QuantConfig(q_group_size=32)
    PairQuantizer(model, qc, batches, export_compatible=True).quantize()
    text_model = tiny_vlm(family)
    PairQuantizer(text_model, qc, [{"input_ids": text_ids(1, 9, seed=s)} for s in range(3)],
                  export_compatible=True).quantize()
    ref, got = vision_state(original), vision_state(model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    lin = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[lin], text_model.state_dict()[lin])
    inputs = image_inputs(family, seed=9)
    with torch.no_grad():
        fp = original(**inputs).logits
        q = pseudo_quantize_model(model, qc)(**inputs).logits
    assert torch.isfinite(q).all() and (q - fp).abs().max() < fp.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_record_paths_resolve(family):
    """Every path of the wrapper's record exists in the transformers model, its text family fits the
    record, and modules_to_not_convert names every non-language part (and nothing of the LM)."""
    from fastawq.models import get_submodule
    from fastawq.multimodal import check_language_model, full_precision_modules

    model = transformers.AutoModelForImageTextToText.from_config(tiny_config(family))
    arch = architecture_of(model)
    check_language_model(model)
    for path in (arch.layers_path, arch.embed_path, arch.final_norm_path, arch.lm_head_path, arch.rotary_path):
        get_submodule(model, path)
    layer = get_submodule(model, arch.layers_path)[0]
    for name in (*arch.attn_linears(), *arch.mlp_linears(), arch.attn_norm, arch.mlp_norm):
        get_submodule(layer, name)
    skip = full_precision_modules(model)
    qc = QuantConfig(modules_to_not_convert=skip)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != arch.lm_head_path]
    assert all(qc.skips(n) != n.startswith(arch.layers_path) for n in names)
    assert any(qc.skips(n) for n in names)


def test_wrapper_with_an_unsupported_text_family_is_refused():
    from fastawq.multimodal import check_language_model

    cfg = transformers.LlavaConfig(
        text_config=dict(_TEXT, model_type="gemma", head_dim=16),
        vision_config=dict(_VISION, model_type="clip_vision_model", image_size=28, projection_dim=32),
        image_token_index=IMG)
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match=r"'gemma' language model.*norm_offset"):
        check_language_model(model)


def test_calibration_pairs_from_jsonl(tmp_path):
    from fastawq.multimodal import as_pairs

    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "calib.jsonl").write_text(
        json.dumps({"text": "a cat", "image": "a.png"}) + "\n" + json.dumps({"text": "no image"}) + "\n")
    pairs = as_pairs(str(tmp_path / "calib.jsonl"))
    assert pairs == [{"text": "a cat", "image": str(tmp_path / "a.png")}, {"text": "no image", "image": None}]
    assert as_pairs(["plain", "strings"]) is None
    with pytest.raises(ValueError, match="pair 0 has no text"):
        as_pairs([{"image": "x.png"}])


# ---------------------------------------------------------------- processors (need Pillow)
# family -> (the tokenizer's special image tokens, in id order from IMG; what the chat template
# writes for an image; whether the processor class needs torchvision)
_PROC_TOKENS = {
    "llava": (dict(image_token="<image>"), "<image>", False),
    "llava_next": (dict(image_token="<image>"), "<image>", False),
    "gemma3": (dict(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>"),
               "<start_of_image>", False),
    "mistral3": (dict(image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"),
                 "[IMG]", True),
    # The chat template writes <|image|>; the processor expands it to tiles of <|patch|> tokens (the
    # config's image token) between separators, with <|image|> before the global tile.
    "llama4": (dict(patch_token="<|patch|>", image_token="<|image|>", start_of_image_token="<|image_start|>",
                    end_of_image_token="<|image_end|>", tile_x_separator_token="<|tile_x_separator|>",
                    tile_y_separator_token="<|tile_y_separator|>"), "<|image|>", True),
}
_PROC_TOKENS["qwen2_vl"] = _PROC_TOKENS["qwen2_5_vl"] = (
    dict(image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
         vision_end_token="<|vision_end|>"), "<|vision_start|><|image_pad|><|vision_end|>", True)


def tiny_processor(family: str):
    """The family's processor over a word-level vocabulary (w0 w1 ...) whose image tokens sit at the
    config's ids, with an image processor sized for the tiny vision towers."""
    pytest.importorskip("PIL")
    names, image_text, needs_torchvision = _PROC_TOKENS[family]
    if needs_torchvision:
        pytest.importorskip("torchvision", reason=f"the {family} processor needs torchvision")
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + [f"w{i}" for i in range(IMG - len(special))])}
    for i, token in enumerate(names.values()):
        vocab[token] = IMG + i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                                               eos_token="</s>", unk_token="<unk>", extra_special_tokens=names)
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                + image_text + " {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}")
    common = dict(tokenizer=tok, chat_template=template)
    if family == "llava":
        ip = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        return transformers.LlavaProcessor(image_processor=ip, patch_size=14, vision_feature_select_strategy="default",
                                           num_additional_image_tokens=1, **common)
    if family == "llava_next":
        ip = transformers.LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                  image_grid_pinpoints=_PINPOINTS)
        return transformers.LlavaNextProcessor(image_processor=ip, patch_size=14,
                                               vision_feature_select_strategy="default",
                                               num_additional_image_tokens=1, **common)
    if family == "gemma3":
        ip = transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28})
        return transformers.Gemma3Processor(image_processor=ip, image_seq_length=4, **common)
    if family == "mistral3":
        ip = transformers.PixtralImageProcessor(size={"longest_edge": 84}, patch_size=14)
        return transformers.PixtralProcessor(image_processor=ip, patch_size=14, spatial_merge_size=2,
                                             **names, **common)
    if family == "llama4":
        # Tiles of 56 px, at most 4 of them (plus a global tile when there are several).
        ip = transformers.Llama4ImageProcessor(size={"height": 56, "width": 56}, max_patches=4)
        return transformers.Llama4Processor(image_processor=ip, patch_size=14, pixel_shuffle_ratio=0.5, **names,
                                            **common)
    # Qwen-VL: images resized to multiples of 28 px between 1 and 8 merged tokens.
    px = dict(size={"shortest_edge": 28 * 28, "longest_edge": 8 * 28 * 28}, patch_size=14, merge_size=2,
              temporal_patch_size=2)
    cls = transformers.Qwen2_5_VLProcessor if family == "qwen2_5_vl" else transformers.Qwen2VLProcessor
    return cls(image_processor=transformers.Qwen2VLImageProcessor(**px),
               video_processor=transformers.Qwen2VLVideoProcessor(**px), **common)


def _image(path=None, seed: int = 0, size: tuple[int, int] = (40, 80)):
    """A random RGB image of `size` (height, width), saved to `path` (returned) or returned itself."""
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8))
    if path is None:
        return img
    img.save(path)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_round_trip_pairs_and_cli(family, tmp_path, capsys):
    """from_pretrained finds the processor; `fastawq quantize --calib pairs.jsonl` calibrates on
    image+text pairs and saves the processor with its chat template; `fastawq generate DIR prompt
    --image` answers."""
    from fastawq.cli import main

    proc = tiny_processor(family)
    src = tmp_path / "float"
    tiny_vlm(family).save_pretrained(src)
    proc.save_pretrained(src)
    model = AutoAWQForCausalLM.from_pretrained(src)
    assert model.processor is not None and model.tokenizer is not None
    img = _image(tmp_path / "x.png")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}", "image": "x.png"}) for i in range(3)))
    assert main(["quantize", str(src), str(tmp_path / "q"), "--group-size", "32", "--calib", str(calib),
                 "--max-calib-samples", "3", "--device", "cpu"]) == 0
    loaded = AutoAWQForCausalLM.from_quantized(tmp_path / "q", device_map="cpu")
    assert loaded.processor is not None and loaded.processor.chat_template == proc.chat_template
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "q"), "w5 w6", "--image", str(img), "--max-new-tokens", "3"]) == 0
    assert "tokens/s" in capsys.readouterr().out


# (height, width) of the synthetic images: for LLaVA-NeXT a wide (28x56 grid, 3 tiles), a tall (56x28)
# and a square-ish one (56x56 grid, 5 tiles, unpadded rows); the others resize or tile each their way.
_SIZES = [(40, 80), (90, 44), (50, 60)]


def test_processor_inputs_match_pseudo_quantized(quantized):
    """Synthetic images through the family's real processor: the loaded packed model's logits equal
    the pseudo-quantized model's (fp16 scale rounding), its vision tower is the float one bit for
    bit, and generation's first token is the pseudo-quantized model's."""
    from fastawq.multimodal import encode_prompt

    family, original, pseudo, loaded, _ = quantized
    proc = tiny_processor(family)
    ref_vision, got_vision = vision_state(original), vision_state(loaded.model)
    assert all(torch.equal(ref_vision[k], got_vision[k]) for k in ref_vision)
    tiles = set()
    for i, size in enumerate(_SIZES):
        inputs = encode_prompt(proc, f"w{i + 3} w{i + 4} w{i + 5}", _image(seed=i, size=size))
        # Llama 4's image processor normalizes in bfloat16 (as Meta's code does): cast as the CLI does.
        inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
        if family == "llava_next":
            tiles.add(inputs["pixel_values"].shape[1])
        if family == "llama4":  # the tile grid, by its column and row separator tokens
            tiles.add(tuple((inputs["input_ids"] == IMG + k).sum().item() for k in (4, 5)))
        assert (inputs["input_ids"] == IMG).sum() > 1
        assert_matches_pseudo(original, pseudo, loaded, inputs, (family, size))
        n = inputs["input_ids"].shape[1]
        got = loaded.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
        want = pseudo.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)
        assert got.shape == (1, n + 3) and got[0, n] == want[0, n], (family, size)
    if family in ("llava_next", "llama4"):
        assert len(tiles) > 1, f"the tiling picked one grid for every image size: {tiles}"
