"""GPT-J: attention and MLP in parallel on ln_1, so q/k/v and fc_in form one group; GELU between
fc_in and fc_out, so fc_out's scale lives in a ScaledActivation (mlp.act)."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="gptj", family="GPT-J", model_types=("gptj",),
    layers_path="transformer.h", embed_path="transformer.wte", final_norm_path="transformer.ln_f",
    rotary_path="transformer.rotary_emb", attn="attn", attn_norm="ln_1", mlp_norm=None, parallel=True,
    o_proj="out_proj", gate_up=("fc_in",), down_proj="fc_out", gated_mlp=False, act_path="mlp.act",
    norm="layer", act_attr="activation_function",
    fused_blocker="parallel attention / MLP on a LayerNorm, interleaved partial rotary, ungated GELU MLP",
)
