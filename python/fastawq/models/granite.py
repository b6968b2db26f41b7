"""Granite 3.x: Llama's layout; embedding, residual, attention and logit multipliers scale
activations, not weights, so the scale groups are Llama's."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="granite", family="Granite", model_types=("granite",),
                    fused_blocker="the embedding / residual / logit multipliers are not fused")
