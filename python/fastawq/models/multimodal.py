"""Vision-language wrappers: the language model is quantized by its own text record, the vision
tower and projector stay in full precision (listed in modules_to_not_convert so transformers and
vLLM skip them too). Calibration runs the wrapper on text alone."""
from __future__ import annotations

from fastawq.models.base import Architecture

_TEXT = "model.language_model"


# Text models that exist only inside a wrapper, by the record whose layer they share.
_TEXT_ONLY = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}


def _text_groups(layer, config):
    """The language model's own record decides (LLaVA wraps Llama, Mistral, Qwen2, ...)."""
    from fastawq.models import get_architecture

    text = config.get_text_config()
    return get_architecture(_TEXT_ONLY.get(text.model_type, text.model_type)).scale_groups(layer, text)


def _vlm(name: str, family: str, model_type: str, keep_float: tuple[str, ...]) -> Architecture:
    return Architecture(
        name=name, family=family, model_types=(model_type,), groups=_text_groups,
        layers_path=f"{_TEXT}.layers", embed_path=f"{_TEXT}.embed_tokens", final_norm_path=f"{_TEXT}.norm",
        rotary_path=f"{_TEXT}.rotary_emb", keep_float=keep_float, auto_class="AutoModelForImageTextToText",
        fused_blocker="the fused engine does not merge image features into the embeddings",
    )


_VISION = ("vision_tower", "multi_modal_projector")
ARCHS = (
    _vlm("gemma3", "Gemma", "gemma3", _VISION),
    _vlm("mistral3", "Mistral", "mistral3", _VISION),
    _vlm("llava", "LLaVA", "llava", _VISION),
    _vlm("llava_next", "LLaVA", "llava_next", (*_VISION, "image_newline")),
    _vlm("qwen2_vl", "Qwen", "qwen2_vl", ("visual",)),
    _vlm("qwen2_5_vl", "Qwen", "qwen2_5_vl", ("visual",)),
)
