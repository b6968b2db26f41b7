"""GPT-NeoX (Pythia): q/k/v interleave per head in one linear, so no v -> dense scale; GELU does
not commute with a scale, so dense_4h_to_h's scale lives in a ScaledActivation (mlp.act.scales).
With use_parallel_residual the two norms still read the same input, each feeding its own branch."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="gpt_neox", family="GPT-NeoX", model_types=("gpt_neox",),
    layers_path="gpt_neox.layers", embed_path="gpt_neox.embed_in", final_norm_path="gpt_neox.final_layer_norm",
    rotary_path="gpt_neox.rotary_emb", attn="attention", qkv=("query_key_value",), qkv_layout="interleaved",
    o_proj="dense", gate_up=("dense_h_to_4h",), down_proj="dense_4h_to_h", gated_mlp=False, act_path="mlp.act",
    norm="layer", fused_blocker="LayerNorm, per-head interleaved q/k/v, partial rotary and an ungated GELU MLP",
)
