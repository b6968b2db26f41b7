"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norms); MoE blocks of top-k softmax-routed
experts (fused 3-D in transformers 5.x); `mlp_only_layers` keep a dense MLP."""
from fastawq.models.moe import MoESpec, moe_architecture

MOE = MoESpec()

ARCH = moe_architecture("qwen3_moe", "Qwen", MOE, qk_norm=("q_norm", "k_norm"))
