"""Hunyuan dense (v1): Llama's layout plus per-head q/k RMSNorms, applied after the rotary."""
from fastawq.models.base import Architecture

ARCH = Architecture(name="hunyuan_v1_dense", family="Hunyuan", model_types=("hunyuan_v1_dense",),
                    fused_blocker="q/k norms after the rotary (the fused rope kernel normalises before it)")
