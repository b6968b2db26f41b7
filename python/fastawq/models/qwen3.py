"""Qwen3: Llama's layout; q_norm / k_norm act after q/k_proj, so input scaling leaves them alone
(the fused engine applies them inside its rope kernel)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="qwen3", family="Qwen", model_types=("qwen3",), qk_norm=("q_norm", "k_norm"))
