"""Named model shapes with random weights, built straight in packed W4 form (or fp16), so speed and
memory are measurable without a checkpoint. No full-precision model is ever built for W4: the
decoder linears are created as WQLinear with random qweight/qzeros and small random scales."""
from __future__ import annotations

import logging

import torch
from torch import nn

from fastawq.models import architecture_of
from fastawq.models.base import get_submodule, set_submodule
from fastawq.modules.qlinear import WQLinear

log = logging.getLogger(__name__)

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The config fields every shape sets, in the order of the rows below.
_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def _shape(cls_name: str, values: tuple, group_size: int, **extra) -> tuple[str, dict, int]:
    return cls_name, {**dict(zip(_FIELDS, values, strict=True)), **extra}, group_size


# name -> (config class name, config kwargs, W4 group size)
SHAPES: dict[str, tuple[str, dict, int]] = {
    # values: vocab, hidden, intermediate, layers, heads, KV heads, max positions, rope theta, norm eps, tied
    "llama-3-8b": _shape("LlamaConfig", (128256, 4096, 14336, 32, 32, 8, 131072, 500000.0, 1e-5, False), 128,
                         rope_scaling=_LLAMA3_ROPE),
    "llama-2-7b": _shape("LlamaConfig", (32000, 4096, 11008, 32, 32, 32, 4096, 10000.0, 1e-5, False), 128),
    "qwen2.5-7b": _shape("Qwen2Config", (152064, 3584, 18944, 28, 28, 4, 32768, 1000000.0, 1e-6, False), 128),
    # Hidden 576 is not a multiple of 128: this shape is quantized with groups of 64.
    "smollm2-135m": _shape("LlamaConfig", (49152, 576, 1536, 30, 9, 3, 8192, 100000.0, 1e-5, True), 64),
    # Mixture-of-experts shapes: 128 experts of 768, top-8 / 8 experts of 14336, top-2.
    "qwen3-30b-a3b": _shape("Qwen3MoeConfig", (151936, 2048, 6144, 48, 32, 4, 40960, 1000000.0, 1e-6, False), 128,
                            moe_intermediate_size=768, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True),
    "mixtral-8x7b": _shape("MixtralConfig", (32000, 4096, 14336, 32, 32, 8, 32768, 1000000.0, 1e-5, False), 128,
                           num_local_experts=8, num_experts_per_tok=2),
    # For tests and CPU smoke runs.
    "tiny": _shape("LlamaConfig", (512, 128, 256, 2, 4, 2, 2048, 10000.0, 1e-5, False), 64),
}


def shape_config(name: str, num_layers: int | None = None):
    """The transformers config of a named shape (with num_layers decoder layers if given)."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    cls_name, kwargs, _ = SHAPES[name]
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be positive")
        kwargs = dict(kwargs, num_hidden_layers=num_layers)
    cfg = getattr(transformers, cls_name)(**kwargs)
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
        cfg.sliding_window = None
    return cfg


def _is_decoder_linear(name: str, mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) and ".layers." in f".{name}"


def _fill_random_w4(layer: WQLinear, gen: torch.Generator) -> None:
    dev = layer.qweight.device
    k = layer.in_features
    # Every nibble uniform in 0..15 (full int32 range); scales such that (q - z) * s keeps
    # activations O(1): |q - z| ~ 6 on average, summed over K inputs.
    layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, dtype=torch.int32, device=dev, generator=gen))
    layer.qzeros.copy_(torch.randint(-2**31, 2**31 - 1, layer.qzeros.shape, dtype=torch.int32, device=dev, generator=gen))
    s = torch.rand(layer.scales.shape, device=dev, generator=gen, dtype=torch.float32)
    layer.scales.copy_(((0.5 + s) / (6.0 * k ** 0.5)).to(layer.scales.dtype))
    if layer.bias is not None:
        layer.bias.copy_((torch.randn(layer.bias.shape, device=dev, generator=gen) * 0.02).to(layer.bias.dtype))


def _fresh_rotary(model: nn.Module, device: torch.device) -> None:
    # Built under the meta device, the rotary module's inverse frequencies are garbage: rebuild it.
    path = architecture_of(model).rotary_path
    if path is not None:
        set_submodule(model, path, type(get_submodule(model, path))(config=model.config).to(device))


def _fill_moe(model: nn.Module, spec, gen: torch.Generator) -> None:
    # Routers (not nn.Linear), fused fp16 experts and router biases are not reached by the
    # generic fill above; unit-variance routing spreads tokens over the experts.
    from fastawq.models import architecture_of
    from fastawq.models.moe import use_fast_experts

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if f".{spec.experts}." in f"{name}." and p.dim() == 3:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        elif any(f".{spec.block}.{r}." in f"{name}." for r in spec.float_consumers()) and p.is_floating_point():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            else:
                p.zero_()
    use_fast_experts(model, architecture_of(model).layers_path, spec)


def build_random_model(
    name: str,
    *,
    quantized: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float16,
    group_size: int | None = None,
    seed: int = 0,
    num_layers: int | None = None,
) -> nn.Module:
    """A transformers causal LM of the named shape with random weights on `device`.

    quantized=True: decoder linears are WQLinear (W4, group size of the shape unless given),
    generated directly in packed form; embeddings, norms and lm_head stay in `dtype`.
    quantized=False: the plain fp16 model (the baseline). num_layers: fewer decoder layers than the
    shape has (a quick benchmark whose per-layer time is scaled to full depth)."""
    from transformers import AutoModelForCausalLM

    from fastawq.models import get_architecture
    from fastawq.models.moe import moe_spec_of, unfuse_model

    cfg = shape_config(name, num_layers)
    g = group_size or SHAPES[name][2]
    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        moe_spec = moe_spec_of(model)
        if quantized:  # per-expert linears, so the W4 pass below packs every expert
            unfuse_model(model, get_architecture(cfg.model_type).layers_path, moe_spec, empty=True)
    if quantized:
        for mname, mod in list(model.named_modules()):
            if _is_decoder_linear(mname, mod):
                set_submodule(model, mname, WQLinear(mod.in_features, mod.out_features, g, mod.bias is not None,
                                                     device="meta", dtype=dtype))
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for mname, mod in model.named_modules():
            if isinstance(mod, WQLinear):
                _fill_random_w4(mod, gen)
            elif isinstance(mod, (nn.Linear, nn.Embedding)):
                std = 0.02 if isinstance(mod, nn.Embedding) or ".layers." not in f".{mname}" else mod.in_features ** -0.5
                mod.weight.normal_(0.0, std, generator=gen)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.normal_(0.0, 0.02, generator=gen)
            elif mname.endswith("norm") and hasattr(mod, "weight"):
                mod.weight.fill_(1.0)
        if cfg.tie_word_embeddings:
            model.tie_weights()
        if moe_spec is not None:
            _fill_moe(model, moe_spec, gen)
    _fresh_rotary(model, device)
    model.eval()
    log.info("built random %s model %r on %s", "W4" if quantized else str(dtype), name, device)
    return model
