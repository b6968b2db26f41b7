"""Phi-1 / 1.5 / 2: attention and MLP in parallel on one LayerNorm, so q/k/v and fc1 form one
group; GELU between fc1 and fc2, so fc2's scale lives in a ScaledActivation (mlp.activation_fn)."""
from fastawq.models.base import Architecture

ARCH = Architecture(
    name="phi", family="Phi", model_types=("phi",), final_norm_path="model.final_layernorm",
    parallel=True, mlp_norm=None, o_proj="dense", gate_up=("fc1",), down_proj="fc2", gated_mlp=False,
    act_path="mlp.activation_fn", norm="layer",
    fused_blocker="parallel attention / MLP on a LayerNorm, partial rotary and an ungated GELU MLP",
)
