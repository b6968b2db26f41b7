"""Mistral and Ministral: Llama's layer layout (sliding-window attention does not change the
scale groups; the fused engine serves it while max_seq_len fits the window)."""
from fastawq.models.base import Architecture

ARCHS = (
    Architecture(name="mistral", family="Mistral", model_types=("mistral",)),
    Architecture(name="ministral", family="Mistral", model_types=("ministral",)),
)
