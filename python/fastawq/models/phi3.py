"""Phi-3: fused qkv_proj and gate_up_proj. v and up are the last rows of their fused linear, so a
scale folds into those rows."""
from fastawq.models.base import Architecture, ScaleGroup


def _groups(layer, config) -> list[ScaleGroup]:
    attn, mlp = layer.self_attn, layer.mlp
    groups = [ScaleGroup(["self_attn.qkv_proj"], "input_layernorm", "norm")]
    if config.num_key_value_heads == config.num_attention_heads:
        groups.append(ScaleGroup(["self_attn.o_proj"], "self_attn.qkv_proj", "linear"))
    groups.append(ScaleGroup(["mlp.gate_up_proj"], "post_attention_layernorm", "norm"))
    if mlp.gate_up_proj.weight.shape[0] == 2 * mlp.down_proj.weight.shape[1]:
        groups.append(ScaleGroup(["mlp.down_proj"], "mlp.gate_up_proj", "linear"))
    return groups


ARCH = Architecture(name="phi3", model_types=("phi3",), layers_path="model.layers", groups=_groups)
