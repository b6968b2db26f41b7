"""Llama 1/2/3.x: RMSNorm in front of q/k/v and gate/up."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="llama",
    model_types=("llama",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer),
)
