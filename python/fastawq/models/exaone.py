"""EXAONE 3 / 3.5 (`exaone`): transformers builds it as a Llama model, so it is Llama's record.
EXAONE 4 (`exaone4`) normalises sublayer outputs (post-norm) and q/k per head: no norm in front
of q/k/v or gate/up, only v -> o and up -> down take scales."""
from fastawq.models.base import Architecture

ARCHS = (
    Architecture(name="exaone", family="EXAONE", model_types=("exaone",)),
    Architecture(name="exaone4", family="EXAONE", model_types=("exaone4",), attn_norm=None, mlp_norm=None,
                 qk_norm=("q_norm", "k_norm"),
                 fused_blocker="post-norm layers and alternating sliding-window / global attention"),
)
