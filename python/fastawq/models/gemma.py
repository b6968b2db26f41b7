"""Gemma: Llama's layout, but its RMSNorm multiplies by (1 + weight)."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="gemma",
    model_types=("gemma",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer, norm_kind="gemma_norm"),
)
