"""MiniCPM3: multi-head latent attention (q and kv through low-rank latents with their own
RMSNorms) and a Llama MLP; residual branches and embeddings are scaled by constants."""
from fastawq.models.base import Architecture, mla_groups

ARCH = Architecture(
    name="minicpm3", family="MiniCPM", model_types=("minicpm3",),
    groups=lambda layer, config: mla_groups(ARCH, layer), qkv=("q_a_proj", "kv_a_proj_with_mqa"),
    fused_blocker="multi-head latent attention and scaled residual branches",
)
