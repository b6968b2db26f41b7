"""MPT: Wqkv stacks q, k, v (v is its last third, so it folds o's scale when heads are not
shared); LayerNorms without bias; ALiBi; GELU before down_proj, so its scale lives in a
ScaledActivation (ffn.act)."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="mpt", family="MPT", model_types=("mpt",),
    layers_path="transformer.blocks", embed_path="transformer.wte", final_norm_path="transformer.norm_f",
    rotary_path=None, attn="attn", attn_norm="norm_1", mlp_norm="norm_2", mlp="ffn", qkv=("Wqkv",),
    o_proj="out_proj", gate_up=("up_proj",), down_proj="down_proj", gated_mlp=False, act_path="ffn.act",
    norm="layer", fused_blocker="ALiBi positions, LayerNorm and an ungated GELU MLP",
)
