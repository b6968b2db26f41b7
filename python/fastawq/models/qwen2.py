"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases (the biases move with the weights' rows)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="qwen2", family="Qwen", model_types=("qwen2",))
