"""Llama 1/2/3.x: RMSNorm in front of q/k/v and gate/up (every default of the record)."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="llama", family="Llama", model_types=("llama",))
