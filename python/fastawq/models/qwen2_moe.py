"""Qwen2-MoE / Qwen1.5-MoE: Qwen3-MoE's layout plus a shared expert whose output a sigmoid gate
(shared_expert_gate, a [1, H] linear kept in full precision) weighs."""
from fastawq.models.moe import MoESpec, attention_groups, mlp_groups, moe_architecture

MOE = MoESpec(shared="shared_expert", shared_gate="shared_expert_gate")

ARCH = moe_architecture(
    optional={"family": "Qwen"},
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    layers_path="model.layers",
    groups=lambda layer, config: attention_groups(layer) + mlp_groups(layer, MOE),
)
