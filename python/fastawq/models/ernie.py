"""ERNIE 4.5 (dense): Llama's layout with an interleaved rotary."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="ernie4_5", family="ERNIE", model_types=("ernie4_5",),
                    fused_blocker="interleaved rotary (the fused rope kernel rotates halves)")
