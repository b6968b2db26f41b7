"""GPT-BigCode (StarCoder 1, SantaCoder): c_attn holds q, then one shared k and v (multi-query)
or q/k/v per head, so no v -> c_proj scale; learned positions; GELU between c_fc and c_proj."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="gpt_bigcode", family="StarCoder", model_types=("gpt_bigcode",),
    layers_path="transformer.h", embed_path="transformer.wte", final_norm_path="transformer.ln_f",
    rotary_path=None, attn="attn", attn_norm="ln_1", mlp_norm="ln_2", qkv=("c_attn",), qkv_layout="interleaved",
    o_proj="c_proj", gate_up=("c_fc",), down_proj="c_proj", gated_mlp=False, act_path="mlp.act", norm="layer",
    act_attr="activation_function", fused_blocker="learned positions, multi-query c_attn, LayerNorm, GELU MLP",
)
