"""Qwen3: Llama's layout; q_norm / k_norm act after q/k_proj, so input scaling leaves them alone."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="qwen3",
    model_types=("qwen3",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer),
)
