"""Gemma 2: (1 + weight) norms; the MLP reads pre_feedforward_layernorm (post_* norms act on
outputs and take no scale)."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="gemma2", family="Gemma", model_types=("gemma2",), norm_offset=1.0, act_attr="hidden_activation",
    mlp_norm="pre_feedforward_layernorm",
    fused_blocker="logit soft-capping and the post-attention / post-feedforward norms are not fused",
)
