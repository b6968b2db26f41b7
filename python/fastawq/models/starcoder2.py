"""StarCoder2: LayerNorm with bias in front of q/k/v and c_fc; an ungated GELU MLP, so c_proj's
scale lives in a ScaledActivation (mlp.act)."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="starcoder2", family="StarCoder", model_types=("starcoder2",), norm="layer",
    gate_up=("c_fc",), down_proj="c_proj", gated_mlp=False, act_path="mlp.act",
    fused_blocker="LayerNorm and an ungated GELU MLP",
)
