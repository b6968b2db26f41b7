"""Helium (Kyutai): Llama's layout with an interleaved (GPT-J style) rotary."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="helium", family="Helium", model_types=("helium",),
                    fused_blocker="interleaved rotary (the fused rope kernel rotates halves)")
