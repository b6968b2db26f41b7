"""OPT: LayerNorm (with bias) in front of q/k/v and fc1; ReLU between fc1 and fc2 commutes with a
positive scale, so fc1's rows take it."""
from fastawq.models.base import Architecture, ScaleGroup


def _groups(layer, config) -> list[ScaleGroup]:
    pre = getattr(config, "do_layer_norm_before", True)
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    groups = [ScaleGroup(qkv, "self_attn_layer_norm", "norm") if pre else ScaleGroup(qkv)]
    groups.append(ScaleGroup(["self_attn.out_proj"], "self_attn.v_proj", "linear"))
    groups.append(ScaleGroup(["fc1"], "final_layer_norm", "norm") if pre else ScaleGroup(["fc1"]))
    if getattr(config, "activation_function", "relu") == "relu":
        groups.append(ScaleGroup(["fc2"], "fc1", "linear"))
    return groups


ARCH = Architecture(
    name="opt", family="OPT", model_types=("opt",), groups=_groups,
    layers_path="model.decoder.layers", embed_path="model.decoder.embed_tokens",
    final_norm_path="model.decoder.final_layer_norm", rotary_path=None,
    attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm", o_proj="out_proj",
    mlp="", gate_up=("fc1",), down_proj="fc2", gated_mlp=False, norm="layer", act_attr="activation_function",
    fused_blocker="LayerNorm, learned positions and an ungated MLP (the fused engine is Llama-shaped)",
)
