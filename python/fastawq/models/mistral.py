"""Mistral: Llama's layer layout (sliding-window attention does not change the scale groups)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="mistral", family="Mistral", model_types=("mistral",))
