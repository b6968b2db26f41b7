"""DeepSeek-V2 / V2-Lite / V2.5: DeepSeek-V3's layout (multi-head latent attention, shared
experts, `first_k_dense_replace` dense layers), so its scale groups are V3's (models/deepseek_v3.py);
V2-Lite has no q latent (q_lora_rank None: a plain q_proj beside kv_a_proj_with_mqa).

Routing differs: softmax scores, greedy or group-limited top-k (the best expert of each group
ranks it), times routed_scaling_factor and never renormalised; there is no score-correction bias.
The router (`mlp.gate`, an fp32 [E, H] weight) stays in full precision and takes the experts'
input scale like V3's, so routing is unchanged by the search."""
from fastawq.models.deepseek_v3 import mla_moe_groups
from fastawq.models.moe import MoESpec, moe_architecture

MOE = MoESpec(shared="shared_experts")

ARCH = moe_architecture(
    "deepseek_v2", "DeepSeek", MOE, groups=mla_moe_groups,
    fused_blocker="multi-head latent attention and group-limited softmax routing with a routed scaling "
                  "factor are not fused (WQExperts serves its experts unfused)",
)
