"""Gemma 3 (text): Gemma 2's norms plus q/k norms after the projections."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="gemma3",
    model_types=("gemma3_text",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer, mlp_norm="pre_feedforward_layernorm", norm_kind="gemma_norm"),
)
