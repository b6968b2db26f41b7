"""OLMo: its LayerNorms have no weight, so nothing in front of q/k/v or gate/up can take a scale;
only v -> o and up -> down are scaled. OLMo 2 / 3 normalise sublayer outputs (post-norm) and q/k
over the whole projection: again no norm in front of the linears."""
from fastawq.models.base import Architecture

_COMMON = dict(family="OLMo", attn_norm=None, mlp_norm=None)
ARCHS = (
    Architecture(name="olmo", model_types=("olmo",), norm="layer", **_COMMON,
                 fused_blocker="weightless LayerNorm (the fused engine runs RMSNorm)"),
    Architecture(name="olmo2", model_types=("olmo2", "olmo3"), **_COMMON,
                 fused_blocker="post-norm layers and q/k norms over all heads"),
)
