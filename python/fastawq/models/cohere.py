"""Command-R (`cohere`) and Command-R7B / A (`cohere2`): attention and MLP run in parallel on one
LayerNorm (weight, no bias), so q/k/v and gate/up form one scale group. Optional q/k norms act
after the projections."""
from fastawq.models.base import Architecture

_COMMON = dict(family="Cohere", norm="layer", parallel=True, mlp_norm=None,
               fused_blocker="parallel attention / MLP blocks on a LayerNorm, interleaved rotary, logit scale")
ARCHS = (
    Architecture(name="cohere", model_types=("cohere",), **_COMMON),
    Architecture(name="cohere2", model_types=("cohere2",), **_COMMON),
)
