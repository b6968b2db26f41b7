"""Tiny randomly initialised transformers models, one per supported architecture (CPU, float32),
and the registry's end-to-end test: quantize -> save -> load -> generate for every one."""
from __future__ import annotations

import torch
import transformers

VOCAB = 128

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256)
# Default special-token ids of some configs lie outside the tiny vocabulary.
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GPT = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, **_IDS)

# test id -> (config class, kwargs). Ids without a registered model type of their own are variants
# of one (their config's model_type decides the record).
CONFIGS = {
    "llama": ("LlamaConfig", dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(_COMMON, num_key_value_heads=4, sliding_window=16)),
    "qwen2": ("Qwen2Config", dict(_COMMON, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(_COMMON, num_key_value_heads=2, head_dim=16)),
    "gemma": ("GemmaConfig", dict(_COMMON, num_key_value_heads=4, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16)),
    "gemma3": ("Gemma3TextConfig", dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", dict(_COMMON, num_key_value_heads=4, pad_token_id=0)),
    "opt": ("OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(_COMMON, rotary_pct=0.5)),
    "glm": ("GlmConfig", dict(_COMMON, num_key_value_heads=2, head_dim=16, **_IDS)),
    "glm4": ("Glm4Config", dict(_COMMON, num_key_value_heads=4, head_dim=16, **_IDS)),
    "olmo": ("OlmoConfig", dict(_COMMON, num_key_value_heads=4, **_IDS)),
    "olmo2": ("Olmo2Config", dict(_COMMON, num_key_value_heads=2, **_IDS)),
    "olmo3": ("Olmo3Config", dict(_COMMON, num_key_value_heads=2, sliding_window=16, **_IDS)),
    "granite": ("GraniteConfig", dict(_COMMON, num_key_value_heads=2, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)),
    "starcoder2": ("Starcoder2Config", dict(_COMMON, num_key_value_heads=4, **_IDS)),
    "cohere": ("CohereConfig", dict(_COMMON, num_key_value_heads=4, use_qk_norm=True, **_IDS)),
    "cohere2": ("Cohere2Config", dict(_COMMON, num_key_value_heads=2, sliding_window=16, **_IDS)),
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    **_IDS)),
    # Falcon 40B / 180B: grouped q/k/v and separate ln_attn / ln_mlp.
    "falcon_new_arch": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                             **_IDS)),
    "stablelm": ("StableLmConfig", dict(_COMMON, num_key_value_heads=2, **_IDS)),
    "stablelm_parallel": ("StableLmConfig", dict(_COMMON, num_key_value_heads=4, use_parallel_residual=True,
                                                 qk_layernorm=True, **_IDS)),
    "phi": ("PhiConfig", dict(_COMMON, num_key_value_heads=4, **_IDS)),
    "gptj": ("GPTJConfig", dict(_GPT, rotary_dim=8, n_positions=256)),
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, **_IDS)),
    "mpt": ("MptConfig", dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=256,
                              expansion_ratio=2, **_IDS)),
    "exaone": ("ExaoneConfig", dict(_COMMON, num_key_value_heads=2, **_IDS)),
    "exaone4": ("Exaone4Config", dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16, **_IDS)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(_GPT, n_inner=128, n_positions=256)),
    "ministral": ("MinistralConfig", dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16, **_IDS)),
    "seed_oss": ("SeedOssConfig", dict(_COMMON, num_key_value_heads=4, head_dim=16, attention_out_bias=True, **_IDS)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(_COMMON, num_key_value_heads=2, head_dim=16, **_IDS)),
    "helium": ("HeliumConfig", dict(_COMMON, num_key_value_heads=2, head_dim=16, **_IDS)),
    "ernie4_5": ("Ernie4_5Config", dict(_COMMON, num_key_value_heads=2, head_dim=16, **_IDS)),
    "smollm3": ("SmolLM3Config", dict(_COMMON, num_key_value_heads=2, **_IDS)),
    "arcee": ("ArceeConfig", dict(_COMMON, num_key_value_heads=4, **_IDS)),
    "minicpm3": ("MiniCPM3Config", dict(_COMMON, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **_IDS)),
}


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    cls_name, kwargs = CONFIGS[arch]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so folding a scale is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def calib_ids(n: int = 4, seq_len: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- tests
import copy  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

from fastawq.auto import AutoAWQForCausalLM, AWQModel  # noqa: E402
from fastawq.models import SUPPORTED_MODEL_TYPES, UnsupportedModelError, architecture_of, get_architecture  # noqa: E402
from fastawq.modules import WQLinear  # noqa: E402
from fastawq.modules.fused import fuse_model  # noqa: E402
from fastawq.quantize import QuantConfig, pack_model, pseudo_quantize_model, quantize  # noqa: E402
from fastawq.quantize.scale import apply_scale  # noqa: E402

ARCHS = list(CONFIGS)


def test_every_registered_type_has_a_tiny_model_here():
    from fastawq.models import MOE_SPECS, multimodal

    tested = {getattr(transformers, cls).model_type for cls, _ in CONFIGS.values()}
    wrappers = {t for a in multimodal.ARCHS for t in a.model_types}
    # Mixture-of-experts and vision-language types: tests/test_moe_models.py, tests/test_multimodal.py.
    assert tested == set(SUPPORTED_MODEL_TYPES) - set(MOE_SPECS) - wrappers


def test_readme_model_table_lists_every_type_with_its_fused_status():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Models"):readme.index("### Adding an architecture")]
    for t in SUPPORTED_MODEL_TYPES:
        spec = get_architecture(t)
        assert f"| `{t}` | {spec.family} | {'yes' if spec.fusable else 'no: ' + spec.fused_blocker} |" in table, t


def test_unknown_model_type_names_the_nearest_and_how_to_add_one():
    with pytest.raises(UnsupportedModelError) as e:
        get_architecture("lama")
    msg = str(e.value)
    assert "'llama'" in msg and "Adding an architecture" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)


def test_set_submodule_replaces_by_dotted_path():
    from fastawq.models import get_submodule, set_submodule

    model = tiny_model("llama")
    new = torch.nn.Identity()
    set_submodule(model, "model.layers.1.mlp.act_fn", new)
    assert model.model.layers[1].mlp.act_fn is new
    with pytest.raises(AttributeError, match="model.layers.9"):
        get_submodule(model, "model.layers.9.mlp")


@pytest.mark.parametrize("arch", ARCHS)
def test_record_paths_resolve(arch):
    """Every path the record names, and every module its scale groups name, exists in the
    transformers model it describes (norm names may vary by config where a groups function picks)."""
    from fastawq.models import get_submodule

    model = tiny_model(arch)
    spec = architecture_of(model)
    for path in (spec.layers_path, spec.embed_path, spec.final_norm_path, spec.lm_head_path, spec.rotary_path):
        if path is not None:
            get_submodule(model, path)
    layer = get_submodule(model, spec.layers_path)[0]
    norms = (spec.attn_norm, spec.mlp_norm) if spec.groups is None or spec.fusable else ()
    for name in (*spec.attn_linears(), *spec.mlp_linears(), *norms, spec.act_path):
        if name is not None:
            get_submodule(layer, name)
    for g in spec.scale_groups(layer, model.config):
        for name in (*g.linears, g.prev):
            if name is not None:
                get_submodule(layer, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_scale_folding_is_exact(arch):
    """Folding any positive scale into every group leaves the float model's function unchanged."""
    model = tiny_model(arch)
    ids = calib_ids(2, 16)
    with torch.no_grad():
        ref = model(ids).logits
        spec = architecture_of(model)
        gen = torch.Generator().manual_seed(3)
        for layer in model.get_submodule(spec.layers_path):
            for g in spec.scale_groups(layer, model.config):
                if g.kind == "none":
                    continue
                k = layer.get_submodule(g.linears[0]).in_features
                apply_scale(layer, g, torch.rand(k, generator=gen) * 1.5 + 0.25)
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_save_load_generate(arch, tmp_path):
    """quantize -> save -> load -> generate; the loaded packed model computes what the
    pseudo-quantized float model computes, and so does the fused engine where the record allows it
    (elsewhere fuse_layers=True raises the record's reason)."""
    model = tiny_model(arch)
    spec = architecture_of(model)
    ids = calib_ids(2, 16, seed=7)
    with torch.no_grad():
        fp = model(ids).logits
    n_linears = sum(isinstance(m, torch.nn.Linear) for m in model.get_submodule(spec.layers_path).modules())
    qc = QuantConfig(w_bit=4, q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(2, 32), max_calib_samples=2, max_calib_seq_len=32,
             export_compatible=True)
    pseudo = pseudo_quantize_model(copy.deepcopy(model), qc)
    pack_model(model, qc)
    AWQModel(model, qc).save_quantized(tmp_path / "q")
    loaded = AutoAWQForCausalLM.from_quantized(tmp_path / "q", device_map="cpu")
    assert sum(isinstance(m, WQLinear) for m in loaded.modules()) == n_linears
    with torch.no_grad():
        ref = pseudo(ids).logits
        out = loaded(ids).logits
    assert torch.isfinite(out).all()
    quant_err = (ref - fp).abs().max().item()
    err = (out - ref).abs().max().item()
    # Packed scales are fp16: the loaded model may differ from the fp32 pseudo-quantized one by
    # that rounding only, far less than quantization itself moved the logits.
    assert err <= 0.2 * quant_err + 1e-4, (err, quant_err)
    gen = loaded.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 12)
    if spec.fusable:
        fused = fuse_model(copy.deepcopy(loaded.model), max_seq_len=16, batch_size=2)
        with torch.no_grad():
            got = fused(ids).logits
        # Same W4 backend as the unfused model; a wrong norm, rope or cache slot is an O(1) error.
        assert (got - out).norm() / out.norm() < 1e-2
    else:
        with pytest.raises(NotImplementedError, match=re.escape(spec.fused_blocker)):
            fuse_model(loaded.model, max_seq_len=16, batch_size=1)


def test_awq_beats_round_to_nearest_on_outlier_channels():
    """A few input channels 20x larger than the rest (what AWQ is for): the searched model is
    closer to full precision than plain round-to-nearest."""
    model = tiny_model("llama", seed=5)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, :4] *= 20.0
    ids = calib_ids(4, 32, seed=9)
    with torch.no_grad():
        fp = model(ids).logits
    qc = QuantConfig(q_group_size=32)
    rtn = pseudo_quantize_model(copy.deepcopy(model), qc)
    quantize(model, None, qc, calib=calib_ids(8, 32, seed=2), max_calib_samples=8, max_calib_seq_len=32)
    with torch.no_grad():
        e_rtn = (rtn(ids).logits - fp).pow(2).mean()
        e_awq = (model(ids).logits - fp).pow(2).mean()
    assert e_awq < e_rtn


def test_pseudo_quantized_bits_keep_float_layers():
    model = tiny_model("qwen2")
    quantize(model, None, {"w_bit": 3, "q_group_size": 32}, calib=calib_ids(), max_calib_samples=4,
             max_calib_seq_len=32)
    assert not any(isinstance(m, WQLinear) for m in model.modules())
    w = model.model.layers[0].mlp.up_proj.weight
    for row in w.view(-1, 32)[:8]:
        assert row.unique().numel() <= 8  # 3 bits: at most 8 levels per group


def test_modules_to_not_convert_stay_float():
    model = tiny_model("llama")
    quantize(model, None, {"q_group_size": 32, "modules_to_not_convert": ["down_proj"]}, calib=calib_ids(),
             max_calib_samples=4, max_calib_seq_len=32)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, torch.nn.Linear) and isinstance(layer.mlp.up_proj, WQLinear)


def test_nan_activations_name_the_layer():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = float("inf")
    with pytest.raises(FloatingPointError, match=r"model\.layers\.1\."):
        quantize(model, None, {"q_group_size": 32}, calib=calib_ids(), max_calib_samples=4, max_calib_seq_len=32)


def test_quantizer_subclass_is_used():
    from fastawq.quantize import AwqQuantizer

    calls = []

    class NoClip(AwqQuantizer):
        def search_best_clip(self, linear, name, st):
            calls.append(name)
            return super().search_best_clip(linear, name, st)

    model = tiny_model("llama")
    quantize(model, None, {"q_group_size": 32}, calib=calib_ids(), max_calib_samples=4, max_calib_seq_len=32,
             quantizer_cls=NoClip)
    assert calls and not any("q_proj" in c or "k_proj" in c for c in calls)
