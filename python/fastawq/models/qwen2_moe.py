"""Qwen2-MoE / Qwen1.5-MoE: Qwen3-MoE's layout plus a shared expert whose output a sigmoid gate
(shared_expert_gate, a [1, H] linear kept in full precision) weighs."""
from fastawq.models.moe import MoESpec, moe_architecture

MOE = MoESpec(shared="shared_expert", shared_gate="shared_expert_gate")

ARCH = moe_architecture("qwen2_moe", "Qwen", MOE)
