"""Falcon: one fused query_key_value, interleaved per group of heads (or multi-query: q heads then
one k and one v), so no v -> dense scale. The norms in front depend on the variant: one norm for
parallel attention (7B), ln_attn / ln_mlp (40B, 180B, new_decoder_architecture) or sequential
norms. GELU: dense_4h_to_h's scale lives in a ScaledActivation (mlp.act)."""
from fastawq.models.base import Architecture, standard_groups


def _groups(layer, config):
    if hasattr(layer, "ln_attn"):
        return standard_groups(ARCH, layer, parallel=False, attn_norm="ln_attn", mlp_norm="ln_mlp")
    if hasattr(layer, "post_attention_layernorm"):
        return standard_groups(ARCH, layer, parallel=False)
    return standard_groups(ARCH, layer, parallel=True)


ARCH = Architecture(
    name="falcon", family="Falcon", model_types=("falcon",), groups=_groups,
    layers_path="transformer.h", embed_path="transformer.word_embeddings", final_norm_path="transformer.ln_f",
    rotary_path="transformer.rotary_emb", attn="self_attention", parallel=True, mlp_norm=None,
    qkv=("query_key_value",), qkv_layout="interleaved", o_proj="dense", gate_up=("dense_h_to_4h",), down_proj="dense_4h_to_h",
    gated_mlp=False, act_path="mlp.act", norm="layer", act_attr="activation",
    fused_blocker="LayerNorm, interleaved multi-query q/k/v and an ungated GELU MLP",
)
