"""Vision-language wrappers: the language model's record (its scale groups, norms, activation)
with the wrapper's module paths. Only the decoder layers are quantized; the vision tower,
projector and any audio tower stay in full precision (fastawq/multimodal.py lists them in
`modules_to_not_convert`)."""
from __future__ import annotations

from dataclasses import replace

from fastawq.models import gemma3, llama, llama4, qwen2
from fastawq.models.base import Architecture
from fastawq.models.moe import MoESpec

_BLOCKER = "vision-language wrapper"


def wrap_text_record(text: Architecture, name: str, model_types: tuple[str, ...], lm: str = "model.language_model",
                     lm_head: str = "lm_head", fused_blocker: str | None = None) -> Architecture:
    """`text` (a causal LM's record, paths under `model.`) moved under the wrapper's language model `lm`,
    with the wrapper's output head at `lm_head`."""
    groups = text.groups
    if groups is not None:
        # The text family's groups read the text config, not the wrapper's.
        def groups(layer, config, _g=text.groups):  # noqa: F811
            return _g(layer, config.get_text_config())

    def move(path: str | None) -> str | None:
        if path is None or not path.startswith("model."):
            return path
        return f"{lm}.{path[len('model.'):]}"

    blocker = ": ".join(b for b in (fused_blocker, text.fused_blocker) if b) or None
    return replace(
        text, name=name, model_types=model_types, groups=groups, layers_path=move(text.layers_path),
        embed_path=move(text.embed_path), final_norm_path=move(text.final_norm_path),
        rotary_path=move(text.rotary_path), lm_head_path=lm_head, fused_blocker=blocker,
        notes=f"language model: the {text.name} record under {lm}",
    )


# Llama-layout language models (Llama / Vicuna / Mistral / Qwen2 text) behind a vision tower
# and projector; fastawq.multimodal checks the text config's family matches this layout.
# fastawq.multimodal.fuse_model fuses the text layers and prefills the merged image+text embeddings.
LLAVA = wrap_text_record(llama.ARCH, "llava", ("llava", "llava_next", "mistral3"))
# Qwen2-VL / Qwen2.5-VL: Qwen2 text layers with multimodal rotary positions (mrope: three
# position streams, which the fused engine's 1-D rope tables cannot express).
QWEN2_VL = wrap_text_record(qwen2.ARCH, "qwen2_vl", ("qwen2_vl", "qwen2_5_vl"),
                            fused_blocker=f"{_BLOCKER}: multimodal rotary positions (mrope) are not fused")
# Gemma 3 4B / 12B / 27B: the gemma3_text record (its blocker carries over).
GEMMA3 = wrap_text_record(gemma3.ARCH, "gemma3_vl", ("gemma3",), fused_blocker=f"{_BLOCKER} of gemma3_text")
# Llama 4 Scout / Maverick: the llama4_text record (dense and MoE layers, a shared expert). Its
# wrapper has no inner `model`: vision_model, multi_modal_projector and language_model (a whole
# Llama4ForCausalLM, head included) are its children, and its checkpoints use these names as they are.
LLAMA4 = wrap_text_record(llama4.ARCH, "llama4_vl", ("llama4",), lm="language_model.model",
                          lm_head="language_model.lm_head", fused_blocker=f"{_BLOCKER} of llama4_text")

ARCHS = (LLAVA, QWEN2_VL, GEMMA3, LLAMA4)
# The wrappers whose language model has mixture-of-experts layers: where its router and experts live.
MOE_SPECS: dict[str, MoESpec] = {"llama4": llama4.MOE}
