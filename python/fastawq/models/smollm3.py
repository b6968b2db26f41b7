"""SmolLM3: Llama's layout; some layers use no rotary at all (no_rope_layers)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="smollm3", family="SmolLM", model_types=("smollm3",),
                    fused_blocker="layers without rotary positions (no_rope_layers)")
