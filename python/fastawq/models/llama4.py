"""Llama 4 text layers (Llama4ForCausalLM): MoE blocks (`feed_forward`) interleaved with dense MLPs
per `moe_layers`; a shared expert; a sigmoid router (an nn.Linear kept in full precision) whose
score multiplies each token before the experts, which transformers stores transposed
(gate_up_proj [E, H, 2I])."""
from fastawq.models.moe import MoESpec, attention_groups, mlp_groups, moe_architecture

MOE = MoESpec(block="feed_forward", router="router", layout="in_out", call="dense", shared="shared_expert")

ARCH = moe_architecture(
    optional={"family": "Llama", "mlp": "feed_forward"},
    name="llama4_text",
    model_types=("llama4_text",),
    layers_path="model.layers",
    groups=lambda layer, config: attention_groups(layer) + mlp_groups(layer, MOE),
    fused_blocker="chunked attention, rope-less layers, L2 q/k norms and experts fed router-scaled "
                  "rows are not fused",
)
