"""GPT-NeoX (Pythia): q/k/v interleave per head in one linear, so no v -> dense scale; GELU does
not commute with a scale, so dense_4h_to_h's scale lives in a ScaledActivation (mlp.act.scales)."""
from fastawq.models.base import Architecture, ScaleGroup


def _groups(layer, config) -> list[ScaleGroup]:
    return [
        ScaleGroup(["attention.query_key_value"], "input_layernorm", "norm"),
        ScaleGroup(["mlp.dense_h_to_4h"], "post_attention_layernorm", "norm"),
        ScaleGroup(["mlp.dense_4h_to_h"], "mlp.act", "act"),
    ]


ARCH = Architecture(
    name="gpt_neox", model_types=("gpt_neox",), layers_path="gpt_neox.layers", groups=_groups, act_path="mlp.act"
)
