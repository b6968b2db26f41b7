"""StableLM 2 / 3B: Llama's layout on LayerNorms with bias; with use_parallel_residual the MLP
reads the attention's norm, so q/k/v and gate/up form one group. Optional per-head q/k
LayerNorms act after the projections."""
from fastawq.models.base import Architecture, standard_groups


def _groups(layer, config):
    return standard_groups(ARCH, layer, parallel=bool(getattr(config, "use_parallel_residual", False)))


ARCH = Architecture(name="stablelm", family="StableLM", model_types=("stablelm",), groups=_groups, norm="layer",
                    fused_blocker="LayerNorm and partial rotary")
