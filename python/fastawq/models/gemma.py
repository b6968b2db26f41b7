"""Gemma: Llama's layout, but its RMSNorm multiplies by (1 + weight) and the activation is named
by hidden_activation."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="gemma", family="Gemma", model_types=("gemma",), norm_offset=1.0,
                    act_attr="hidden_activation")
