"""Arcee (AFM): Llama's attention and an ungated MLP, down(relu(up(x))^2); a squared ReLU does not
commute with a scale, so down_proj's scale lives in a ScaledActivation (mlp.act_fn)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="arcee", family="Arcee", model_types=("arcee",), gate_up=("up_proj",), gated_mlp=False,
                    act_path="mlp.act_fn", fused_blocker="an ungated squared-ReLU MLP")
