"""fastawq as transformers' backend for `quant_method: "awq"` checkpoints.

transformers 5 loads AWQ only through GPTQModel; without it `AutoModelForCausalLM.from_pretrained`
of any AWQ checkpoint raises ImportError. `register()` points transformers' "awq" entry at
fastawq's quantizer (fastawq.integrations.hf_quantizer), which swaps each quantized nn.Linear for
fastawq's WQLinear before the weights load (mixture-of-experts blocks, fused 3-D in transformers 5, are
unfused into per-expert linears first, as the checkpoint stores them).

When: `import fastawq` arms a one-shot hook that registers the moment transformers' quantizer
registry (`transformers.quantizers.auto`) is imported, so fastawq's import stays free of
transformers' cost and the usual `import fastawq; AutoModelForCausalLM.from_pretrained(awq_dir)`
works. Registration is skipped when GPTQModel is installed (transformers' own route then works,
and fastawq leaves it alone) unless `register(force=True)` is called, and never happens at import
with FASTAWQ_TRANSFORMERS_BACKEND=0.

SDPA_NO_CUDNN (bottom of this file) is transformers' sdpa attention without cuDNN's per-KV-length
planning; `use_sdpa_without_cudnn(model)` switches a loaded model to it.

Why the mapping is written directly: transformers' public `register_quantizer("awq")` refuses a
name that is already taken, and "awq" is built in; `unregister()` puts the original back.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_REGISTRY = "transformers.quantizers.auto"
_original: dict[str, type] = {}


def gptqmodel_installed() -> bool:
    return importlib.util.find_spec("gptqmodel") is not None


def is_registered() -> bool:
    mod = sys.modules.get(_REGISTRY)
    if mod is None:
        return False
    from fastawq.integrations.hf_quantizer import FastAwqHfQuantizer

    return mod.AUTO_QUANTIZER_MAPPING.get("awq") is FastAwqHfQuantizer


def register(*, force: bool = False) -> bool:
    """Make transformers load "awq" checkpoints with fastawq. Returns whether fastawq now serves them.

    Without `force`, an installed GPTQModel keeps the job (nothing changes)."""
    if gptqmodel_installed() and not force:
        log.info("gptqmodel is installed: transformers keeps loading AWQ with it (register(force=True) overrides)")
        return False
    from transformers.quantizers import auto

    from fastawq.integrations.hf_quantizer import FastAwqHfQuantizer

    current = auto.AUTO_QUANTIZER_MAPPING.get("awq")
    if current is not FastAwqHfQuantizer:
        _original.setdefault("awq", current)
        auto.AUTO_QUANTIZER_MAPPING["awq"] = FastAwqHfQuantizer
    return True


def unregister() -> None:
    """Give "awq" back to transformers' own quantizer."""
    mod = sys.modules.get(_REGISTRY)
    if mod is not None and "awq" in _original:
        mod.AUTO_QUANTIZER_MAPPING["awq"] = _original.pop("awq")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of transformers' quantizer registry so that
    register() runs right after that module executes, then removes itself."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - importlib's protocol
        if name != _REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001
            run(module)
            try:
                register()
            except Exception as e:  # the backend is an extra: a failure must not break transformers
                log.warning("fastawq could not register as transformers' AWQ backend: %s", e)

        spec.loader.exec_module = exec_module
        return spec


def register_on_import() -> None:
    """Called by `import fastawq`: register now if transformers' registry is loaded, else on its import."""
    if os.environ.get("FASTAWQ_TRANSFORMERS_BACKEND", "1").strip().lower() in ("0", "false", "off", "no"):
        return
    if gptqmodel_installed():
        return
    if _REGISTRY in sys.modules:
        try:
            register()
        except Exception as e:
            log.warning("fastawq could not register as transformers' AWQ backend: %s", e)
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


# ---------------------------------------------------------------------------- attention
# cuDNN's SDPA backend, which torch picked for fp16 decode attention on the H200
# (benchmarks/RESULTS.md), builds an execution plan for every new KV length (about 17 ms each on an H200, cached per process): an unfused
# decode meets a new length every step, so a first generate() of N tokens pays about N plans.
# Flash / memory-efficient SDPA have no per-shape plan. SDPA_NO_CUDNN is transformers' own sdpa
# attention with the cuDNN backend off for the duration of the call only (CUDA inputs only).
SDPA_NO_CUDNN = "fastawq_sdpa_no_cudnn"


def _sdpa_no_cudnn(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001 - transformers' protocol
    import torch  # not at the top: `import fastawq` imports this module and must not load torch

    sdpa = _sdpa_forward()
    if not query.is_cuda or not torch.backends.cuda.cudnn_sdp_enabled():
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    if torch.compiler.is_compiling():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return sdpa(module, query, key, value, attention_mask, **kwargs)
    # The flag is process-wide (another thread's SDPA during this call also skips cuDNN): set and
    # restored around this one call, cheaper than sdpa_kernel's context manager at one call per
    # layer per decoded token.
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


_sdpa_module = None


def _sdpa_forward():
    # The module is imported once; its attribute is read per call, so a patched one is honoured.
    global _sdpa_module
    if _sdpa_module is None:
        from transformers.integrations import sdpa_attention

        _sdpa_module = sdpa_attention
    return _sdpa_module.sdpa_attention_forward


def register_attention() -> str:
    """Register SDPA_NO_CUDNN with transformers (an added name; "sdpa" itself is untouched), so
    `from_pretrained(..., attn_implementation=SDPA_NO_CUDNN)` and set_attn_implementation take it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_NO_CUDNN, _sdpa_no_cudnn)
    AttentionMaskInterface.register(SDPA_NO_CUDNN, sdpa_mask)
    return SDPA_NO_CUDNN


def use_sdpa_without_cudnn(model) -> bool:  # noqa: ANN001 - a transformers PreTrainedModel
    """Switch a model that uses transformers' "sdpa" attention to SDPA_NO_CUDNN (same masks, same
    math, no cuDNN plans). Returns whether it switched (False: another implementation is set)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(register_attention())
    return model.config._attn_implementation == SDPA_NO_CUDNN
