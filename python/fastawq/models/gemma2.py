"""Gemma 2: (1 + weight) norms; the MLP reads pre_feedforward_layernorm (post_* norms act on
outputs and take no scale)."""
from fastawq.models.base import Architecture, llama_like_groups

ARCH = Architecture(
    name="gemma2",
    model_types=("gemma2",),
    layers_path="model.layers",
    groups=lambda layer, config: llama_like_groups(layer, mlp_norm="pre_feedforward_layernorm", norm_kind="gemma_norm"),
)
