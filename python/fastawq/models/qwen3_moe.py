"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norms); MoE blocks of top-k softmax-routed
experts (fused 3-D in transformers 5.x); `mlp_only_layers` keep a dense MLP."""
from fastawq.models.moe import MoESpec, attention_groups, mlp_groups, moe_architecture

MOE = MoESpec()

ARCH = moe_architecture(
    optional={"family": "Qwen"},
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    layers_path="model.layers",
    qk_norm=("q_norm", "k_norm"),
    groups=lambda layer, config: attention_groups(layer) + mlp_groups(layer, MOE),
)
