"""Mistral: Llama's layer layout (sliding-window attention does not change the scale groups)."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="mistral",
    model_types=("mistral",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer),
)
