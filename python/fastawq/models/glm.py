"""GLM (glm-4-9b's `glm`) and GLM-4 (0414, `glm4`): Llama's norms with q/k/v biases and one
gate_up_proj (gate, then up: up's rows are the last half). Both rotate half of each head with an
interleaved rotary; GLM-4 adds norms on the attention and MLP outputs."""
from fastawq.models.base import Architecture

_COMMON = dict(family="GLM", gate_up=("gate_up_proj",))
ARCHS = (
    Architecture(name="glm", model_types=("glm",), **_COMMON,
                 fused_blocker="interleaved partial rotary (the fused rope kernel rotates halves of full heads)"),
    Architecture(name="glm4", model_types=("glm4",), **_COMMON,
                 fused_blocker="interleaved partial rotary and the post-attention / post-MLP output norms"),
)
