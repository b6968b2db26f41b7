"""Vision-language models: load with the image-text auto class, quantize only the language model's
decoder layers, keep the vision tower / projector / audio tower in full precision (and name them
in `modules_to_not_convert`), save the processor and its chat template with the checkpoint,
calibrate on text alone or on the user's image+text pairs, and let the fused engine serve the
language model of a wrapper whose text family it fuses.

The records live in models/multimodal.py; this module holds what the loader, the quantizer and the
CLI need beyond a record."""
from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from fastawq.models import UnsupportedModelError, architecture_of, get_architecture
from fastawq.models.base import set_submodule
from fastawq.quantize.awq import AwqQuantizer, search_kwargs
from fastawq.quantize.config import QuantConfig

log = logging.getLogger(__name__)

# Record fields that describe a decoder layer (not where it lives): a wrapper's text family must
# agree with the wrapper's record on all of them.
_LAYOUT_FIELDS = ("attn", "mlp", "attn_norm", "mlp_norm", "qkv", "o_proj", "qk_norm", "gate_up", "down_proj",
                  "gated_mlp", "norm", "norm_offset", "act_path")


def is_multimodal(config: Any) -> bool:
    """A wrapper config: a text model behind a vision (or audio) encoder."""
    return getattr(config, "text_config", None) is not None and any(
        getattr(config, a, None) is not None for a in ("vision_config", "audio_config")
    )


def auto_model_class(config: Any) -> type:
    """The transformers auto class that builds `config`'s model with its generation head."""
    import transformers

    if is_multimodal(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def check_language_model(model: nn.Module) -> None:
    """Refuse a wrapper whose language model's layers differ from its record's (e.g. a LLaVA
    checkpoint around a Gemma text model, whose (1 + w) norms the llava record does not fold)."""
    if not is_multimodal(model.config):
        return
    arch = architecture_of(model)
    text_type = getattr(model.config.get_text_config(), "model_type", None)
    if text_type == f"{model.config.model_type}_text":
        return  # the wrapper's own text model (Qwen2-VL's qwen2_vl_text): the record describes it
    try:
        text = get_architecture(text_type)
    except UnsupportedModelError:
        raise UnsupportedModelError(
            f"{model.config.model_type} wraps a {text_type!r} language model, which fastawq does not support; "
            f"the {arch.name} record expects the layout of {arch.notes or arch.name}"
        ) from None
    diff = [f.name for f in fields(arch) if f.name in _LAYOUT_FIELDS and getattr(arch, f.name) != getattr(text, f.name)]
    if diff:
        raise UnsupportedModelError(
            f"{model.config.model_type} wraps a {text_type!r} language model whose layers differ from the "
            f"{arch.name} record in {diff}; add a record for this combination in python/fastawq/models/multimodal.py"
        )


def full_precision_modules(model: nn.Module) -> list[str]:
    """Names for `modules_to_not_convert`: every module beside the path from the wrapper down to
    its language model, except the output head (vision tower, projector, audio tower), each with
    and without its prefix: transformers matches from the start of the full name
    ("model.vision_tower"), vLLM and SGLang match substrings of their own names ("vision_tower",
    "visual"). The language model sits at `model.language_model` in most wrappers and at
    `language_model.model` in Llama 4's (whose head is `language_model.lm_head`)."""
    arch = architecture_of(model)
    head = model.get_output_embeddings()
    path = arch.layers_path.split(".")[:-1]  # from the wrapper down to the language model
    out: list[str] = []
    for depth, on_path in enumerate(path):
        prefix = ".".join(path[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        for name, child in parent.named_children():
            if name == on_path or child is head:
                continue
            for n in (f"{prefix}.{name}" if prefix else name, name):
                if n not in out:
                    out.append(n)
    return out


def add_full_precision_modules(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """`config` with the wrapper's non-language modules added to modules_to_not_convert."""
    if not is_multimodal(model.config):
        return config
    check_language_model(model)
    names = list(config.modules_to_not_convert or [])
    names += [n for n in full_precision_modules(model) if n not in names]
    config.modules_to_not_convert = names
    return config


def _with_image_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    if not isinstance(output, tuple) and not hasattr(output, "image_outputs"):
        output.image_outputs = None
    return output


def repair_forward(model: nn.Module) -> nn.Module:
    """Work around transformers bugs in a wrapper's own forward, on this instance (idempotent; a
    no-op where transformers is fixed)."""
    # transformers 5.24's Llama4ForConditionalGeneration.forward copies `image_outputs` from its
    # language model's MoeCausalLMOutputWithPast, which has no such field: every call that returns
    # a ModelOutput (generate's included) raises AttributeError. The language model's output gets
    # the field as None (the wrapper's output then carries no vision-tower features; fastawq reads none).
    lm = getattr(model, "language_model", None)
    if getattr(model.config, "model_type", None) == "llama4" and isinstance(lm, nn.Module):
        if _with_image_outputs not in lm._forward_hooks.values():
            lm.register_forward_hook(_with_image_outputs)
    return model


def load_processor(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The folder's AutoProcessor (tokenizer + image processor + chat template), or None."""
    try:
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        # A folder that ships an image processor config but cannot build it (e.g. Pixtral's needs
        # torchvision) deserves more than a silent None: image prompts will fail later.
        has_config = any((Path(path) / f).exists() for f in ("preprocessor_config.json", "processor_config.json"))
        (log.warning if has_config else log.info)("no processor loaded from %s: %s", path, e)
        return None
    # A text-only folder gives back a bare tokenizer; only a processor with an image part counts.
    return proc if getattr(proc, "image_processor", None) is not None else None


class _Renamed:
    """A safetensors handle read under a tensor's new name (the file keeps its old one)."""

    def __init__(self, handle: Any, old: str):
        self.handle, self.old = handle, old

    def get_tensor(self, _name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.old)

    def get_slice(self, _name: str) -> Any:
        return self.handle.get_slice(self.old)


def rename_checkpoint_keys(model: nn.Module, tensors: dict[str, tuple[Path, Any]]) -> dict[str, tuple[Path, Any]]:
    """Checkpoint names in the layout transformers saves and AutoAWQ wrote (`language_model.model.layers.N`,
    Qwen2-VL's `model.layers.N` beside `visual`) mapped to the model's own (`model.language_model.layers.N`),
    with transformers' own renaming table for the model; names already in the new layout pass unchanged."""
    if not is_multimodal(model.config):
        return tensors
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x: the legacy names are the model's own
        return tensors
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    if not renamings:
        return tensors
    # Linears are still nn.Linear here: their packed tensors are named by the module.
    expected = model.state_dict()
    meta = dict(expected) | {k.rsplit(".", 1)[0] + f".{p}": True for k in expected if k.endswith(".weight")
                             for p in ("qweight", "qzeros", "scales")}
    out: dict[str, tuple[Path, Any]] = {}
    renamed = 0
    for old, (f, h) in tensors.items():
        new = old if old in expected else rename_source_key(old, renamings, [], model.base_model_prefix, meta)[0]
        if new != old:
            renamed += 1
            h = _Renamed(h, old)
        out[new] = (f, h)
    if renamed:
        log.info("renamed %d checkpoint tensor(s) from transformers' saved layout to the model's", renamed)
    return out


# ---------------------------------------------------------------- image+text calibration
def as_pairs(data: Any, text_column: str = "text") -> list[dict] | None:
    """Image+text calibration pairs from a list of {"text", "image"} dicts or a .jsonl file whose
    objects have an "image" field (a path relative to the file); None for any other data."""
    if isinstance(data, (str, Path)) and str(data).endswith(".jsonl") and Path(data).exists():
        path = Path(data)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not rows or not any("image" in r for r in rows):
            return None
        for r in rows:
            if r.get("image") is not None and not Path(r["image"]).is_absolute():
                r["image"] = str(path.parent / r["image"])
        data = rows
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or not data:
        return None
    if not all(isinstance(d, dict) for d in data):
        return None
    pairs = []
    for i, d in enumerate(data):
        text = d.get(text_column, d.get("text"))
        if not isinstance(text, str):
            raise ValueError(f"calibration pair {i} has no text under {text_column!r} (keys {sorted(d)})")
        pairs.append({"text": text, "image": d.get("image")})
    return pairs


def _open_image(image: Any) -> Any:
    if image is None or not isinstance(image, (str, Path)):
        return image
    from PIL import Image

    path = Path(image)
    if not path.exists():
        raise FileNotFoundError(f"calibration image {path} does not exist")
    return Image.open(path).convert("RGB")


def prompt_with_image(processor: Any, text: str, has_image: bool) -> str:
    """`text` in the processor's chat template with an image slot (or the bare image token)."""
    content = ([{"type": "image"}] if has_image else []) + [{"type": "text", "text": text}]
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    token = getattr(processor, "image_token", None) or getattr(processor.tokenizer, "image_token", None)
    if has_image and token is None:
        raise ValueError("the processor has neither a chat template nor an image token to place the image")
    return f"{token}{text}" if has_image else text


def encode_prompt(processor: Any, prompt: str, image: Any, chat: bool = True) -> dict[str, torch.Tensor]:
    """Model inputs (input_ids, pixel_values, ...) for one prompt about one image (a PIL image or a path)."""
    if processor is None:
        raise ValueError("an image prompt needs the model's processor (AutoProcessor), and the checkpoint has none")
    image = _open_image(image)
    if chat:
        text = prompt_with_image(processor, prompt, True)
    else:
        token = getattr(processor, "image_token", None) or getattr(processor.tokenizer, "image_token", None)
        text = f"{token}{prompt}" if token else prompt
    enc = processor(text=[text], images=[image], return_tensors="pt")
    return {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}


def encode_pairs(pairs: list[dict], processor: Any, max_samples: int) -> list[dict[str, torch.Tensor]]:
    """One processor batch (input_ids, pixel_values, ...) per pair, at most `max_samples`."""
    if processor is None:
        raise ValueError("image+text calibration pairs need the model's processor (AutoProcessor); none was found")
    batches = []
    for d in pairs[:max_samples]:
        image = _open_image(d["image"])
        text = prompt_with_image(processor, d["text"], image is not None)
        kw = {"images": [image]} if image is not None else {}
        enc = processor(text=[text], return_tensors="pt", **kw)
        batches.append({k: v for k, v in enc.items() if isinstance(v, torch.Tensor)})
    if len(pairs) > max_samples:
        log.info("using %d of %d calibration pairs (max_calib_samples)", max_samples, len(pairs))
    return batches


class _PerChunk(list):
    """One layer's keyword arguments per calibration chunk (masks and mrope positions differ per pair)."""


class PairQuantizer(AwqQuantizer):
    """AWQ over image+text batches: the wrapper's full forward (vision tower included) feeds the
    language model's first layer, and every pair keeps its own masks and positions."""

    def __init__(self, model: nn.Module, quant_config: QuantConfig, batches: list[dict], **kwargs: Any):
        if not batches:
            raise ValueError("no image+text calibration batches")
        # The base class wants an id tensor; the batches replace it in _capture_inputs.
        super().__init__(model, quant_config, torch.zeros(len(batches), 1, dtype=torch.long), **kwargs)
        self.batches = batches

    per_chunk_kwargs = True

    def _calibration_batches(self):
        float_dtype = next(p.dtype for p in self.model.base_model.parameters() if p.is_floating_point())
        for batch in self.batches:
            yield {k: v.to(self.device, float_dtype) if v.is_floating_point() else v.to(self.device)
                   for k, v in batch.items()}

    def _layer_kwargs(self, per_chunk: list[dict], dtype: torch.dtype) -> _PerChunk:
        return _PerChunk(search_kwargs(kw, self.device, dtype) for kw in per_chunk)

    def _run_layer(self, layer, name, groups, inps, kwargs, extra_hooks=None):
        if not isinstance(kwargs, _PerChunk):
            return super()._run_layer(layer, name, groups, inps, kwargs, extra_hooks)
        stats: dict = {}
        outs = []
        for x, kw in zip(inps, kwargs):
            st, out = super()._run_layer(layer, name, groups, [x], kw, extra_hooks)
            outs += out
            for k, s in st.items():
                if k not in stats:
                    stats[k] = s
                else:
                    stats[k].abs_sum += s.abs_sum
                    stats[k].gram += s.gram
                    stats[k].count += s.count
        return stats, outs


def quantize_pairs(model: nn.Module, processor: Any, config: QuantConfig, pairs: list[dict], *,
                   max_calib_samples: int = 128, **kwargs: Any) -> nn.Module:
    """AWQ-quantize `model`'s language model in place, calibrated on image+text `pairs`."""
    batches = encode_pairs(pairs, processor, max_calib_samples)
    return PairQuantizer(model, config, batches, **kwargs).quantize()


# ---------------------------------------------------------------- fused engine
# Keyword arguments of a wrapper's forward that carry the image (everything else goes to generate).
_IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask", "token_type_ids",
               "mm_token_type_ids", "vision_feature_layer", "vision_feature_select_strategy")


class _Captured(Exception):
    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.x = x


class _StopAtFirstLayer(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        raise _Captured(hidden_states)


class _PromptEmbedding(nn.Module):
    """The fused runtime's embedding: the prompt's merged text+image embeddings (served chunk by
    chunk as the prefill asks), then the token embedding for decoded tokens."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed
        self.pending: torch.Tensor | None = None
        self.cursor = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.pending
        if p is None:
            return self.embed(ids)
        n = ids.shape[1]
        if p.shape[0] != ids.shape[0] or self.cursor + n > p.shape[1]:
            raise ValueError(f"prompt embeddings {tuple(p.shape)} do not fit ids {tuple(ids.shape)} at {self.cursor}")
        x = p[:, self.cursor : self.cursor + n]
        self.cursor += n
        if self.cursor == p.shape[1]:
            self.pending = None
        return x


@torch.inference_mode()
def prompt_embeddings(model: nn.Module, input_ids: torch.Tensor, **image_inputs: Any) -> torch.Tensor:
    """What the wrapper feeds its first decoder layer for this prompt: token embeddings with the
    image features written over the image tokens (the wrapper's own merge, stopped at layer 0)."""
    arch = architecture_of(model)
    layers = model.get_submodule(arch.layers_path)
    set_submodule(model, arch.layers_path, nn.ModuleList([_StopAtFirstLayer()]))
    try:
        model.base_model(input_ids=input_ids, use_cache=False, **image_inputs)
    except _Captured as c:
        return c.x
    finally:
        set_submodule(model, arch.layers_path, layers)
    raise RuntimeError(f"{type(model).__name__} returned without calling its first decoder layer")


class _TextView(nn.Module):
    """A wrapper's language model seen as a text causal LM (`model.layers`, `lm_head`, the text
    config), sharing every module with the wrapper: what the fused engine takes."""

    def __init__(self, wrapper: nn.Module, lm: nn.Module):
        super().__init__()
        self.model = lm
        self.lm_head = wrapper.get_output_embeddings()
        self.config = wrapper.config.get_text_config()
        self.generation_config = getattr(wrapper, "generation_config", None)


def fuse_model(model: nn.Module, max_seq_len: int, batch_size: int, **kwargs: Any) -> nn.Module:
    """Fuse a packed vision-language model's language model (when its text family is fusable).
    Afterwards `model.generate(input_ids, pixel_values=..., ...)` prefills the merged image+text
    embeddings and decodes with the fused layers; the vision tower runs unfused once per prompt."""
    import types

    from fastawq.modules.fused import fuse_model as fuse_text

    arch = architecture_of(model)
    text_type = getattr(model.config.get_text_config(), "model_type", None)
    if arch.fused_blocker is not None:
        raise NotImplementedError(f"fuse_layers is not implemented for model_type={model.config.model_type!r}: "
                                  f"{arch.fused_blocker} (load with fuse_layers=False)")
    text = get_architecture(text_type)
    lm = model.get_submodule(arch.layers_path.rsplit(".", 1)[0])
    view = _TextView(model, lm)
    if architecture_of(view).layers_path != "model.layers":
        raise NotImplementedError(f"the {text.name} record's layers are not at model.layers; cannot fuse {text_type}")
    fuse_text(view, max_seq_len, batch_size, **kwargs)
    runtime = view.fastawq_runtime
    runtime.embed = _PromptEmbedding(runtime.embed)
    object.__setattr__(model, "fastawq_runtime", runtime)
    object.__setattr__(model, "fastawq_text_view", view)
    model.forward = types.MethodType(_fused_forward, model)
    model.generate = types.MethodType(_fused_generate, model)
    return model


def _split_image_inputs(kwargs: dict) -> dict:
    return {k: kwargs.pop(k) for k in _IMAGE_KEYS if k in kwargs and kwargs[k] is not None}


def _stage_prompt(model: nn.Module, input_ids: torch.Tensor, image: dict) -> None:
    emb = model.fastawq_runtime.embed
    emb.pending, emb.cursor = None, 0
    if image:
        dev = emb.weight.device
        image = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in image.items()}
        x = prompt_embeddings(model, input_ids.to(dev), **image)
        emb.pending = x.to(emb.weight.dtype)


def _fused_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """A fresh prefill of the prompt (with its image) returning every position's logits."""
    _stage_prompt(self, input_ids, _split_image_inputs(kwargs))
    try:
        return self.fastawq_text_view(input_ids, attention_mask=attention_mask)
    finally:
        self.fastawq_runtime.embed.pending = None


def _fused_generate(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers-style generate() with pixel inputs, served by fastawq.generate."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids")
    _stage_prompt(self, input_ids, _split_image_inputs(kwargs))
    try:
        return self.fastawq_text_view.generate(input_ids, **kwargs)
    finally:
        self.fastawq_runtime.embed.pending = None
