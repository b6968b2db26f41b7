"""DeepSeek-V3 / R1: multi-head latent attention and MoE blocks (sigmoid routing with
group-limited top-k, a shared expert) after `first_k_dense_replace` dense layers.

MLA's low-rank projections: q_a_proj and kv_a_proj_with_mqa read the input norm; q_b_proj reads
q_a_layernorm and kv_b_proj reads kv_a_layernorm, so each takes its scale from its own norm (the
norms themselves stay in full precision). o_proj is only clipped: its input mixes heads of v."""
from fastawq.models.base import ScaleGroup, mla_attention_groups
from fastawq.models.moe import MoESpec, mlp_groups, moe_architecture

MOE = MoESpec(shared="shared_experts")


def mla_moe_groups(layer, config) -> list[ScaleGroup]:
    return mla_attention_groups(layer) + mlp_groups(layer, MOE)


ARCH = moe_architecture(
    "deepseek_v3", "DeepSeek", MOE, groups=mla_moe_groups,
    fused_blocker="multi-head latent attention and group-limited sigmoid routing are not fused "
                  "(WQExperts serves its experts unfused)",
)
