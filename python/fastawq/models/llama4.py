"""Llama 4 text layers (Llama4ForCausalLM): MoE blocks (`feed_forward`) interleaved with dense MLPs
per `moe_layers`; a shared expert; a sigmoid router (an nn.Linear kept in full precision) whose
score multiplies each token before the experts, which transformers stores transposed
(gate_up_proj [E, H, 2I])."""
from fastawq.models.moe import MoESpec, moe_architecture

MOE = MoESpec(block="feed_forward", router="router", layout="in_out", call="dense", shared="shared_expert")

ARCH = moe_architecture(
    "llama4_text", "Llama", MOE, mlp="feed_forward",
    fused_blocker="chunked attention, rope-less layers, L2 q/k norms and experts fed router-scaled rows are not fused",
)
