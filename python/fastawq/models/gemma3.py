"""Gemma 3 (text): Gemma 2's norms plus q/k norms after the projections."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="gemma3", family="Gemma", model_types=("gemma3_text",), norm_offset=1.0, act_attr="hidden_activation",
    mlp_norm="pre_feedforward_layernorm", qk_norm=("q_norm", "k_norm"),
    fused_blocker="the post-attention / post-feedforward norms and alternating local/global rope are not fused",
)
