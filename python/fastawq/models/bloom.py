"""BLOOM: query_key_value interleaves q, k, v per head (no v -> dense scale); ALiBi positions;
GELU between the MLP's linears, so dense_4h_to_h's scale lives in a ScaledActivation."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="bloom", family="BLOOM", model_types=("bloom",),
    layers_path="transformer.h", embed_path="transformer.word_embeddings", final_norm_path="transformer.ln_f",
    rotary_path=None, attn="self_attention", qkv=("query_key_value",), qkv_layout="interleaved", o_proj="dense",
    gate_up=("dense_h_to_4h",), down_proj="dense_4h_to_h", gated_mlp=False, act_path="mlp.gelu_impl", norm="layer",
    fused_blocker="ALiBi positions, LayerNorm and an ungated GELU MLP",
)
