"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases (the biases move with the weights' rows)."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="qwen2",
    model_types=("qwen2",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer),
)
