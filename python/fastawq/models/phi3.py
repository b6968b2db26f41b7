"""Phi-3: fused qkv_proj and gate_up_proj. v and up are the last rows of their fused linear, so a
scale folds into those rows."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="phi3", family="Phi", model_types=("phi3",), qkv=("qkv_proj",), gate_up=("gate_up_proj",))
