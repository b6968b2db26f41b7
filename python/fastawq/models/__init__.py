"""Architecture registry: one small file per family declares its record (models/base.py)."""
from __future__ import annotations

import difflib
import importlib

from fastawq.models.base import Architecture, ScaleGroup, get_submodule, set_submodule

_FILES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "opt", "gpt_neox",
    "glm", "olmo", "granite", "starcoder2", "cohere", "falcon", "stablelm", "phi", "gptj", "bloom", "mpt",
    "exaone", "gpt_bigcode", "minicpm3", "seed_oss", "hunyuan", "helium", "ernie", "smollm3", "arcee",
    "multimodal",
)

REGISTRY: dict[str, Architecture] = {}
for _f in _FILES:
    _mod = importlib.import_module(f"fastawq.models.{_f}")
    for _arch in getattr(_mod, "ARCHS", None) or (_mod.ARCH,):  # a file may hold several records
        for _t in _arch.model_types:
            if _t in REGISTRY:
                raise RuntimeError(f"model_type {_t!r} is registered by both {REGISTRY[_t].name} and {_arch.name}")
            REGISTRY[_t] = _arch

# Mixture-of-experts families: a record plus MOE, where the router and experts live (models/moe.py).
MOE_SPECS: dict[str, MoESpec] = {}
for _f in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "llama4"):
    _mod = importlib.import_module(f"fastawq.models.{_f}")
    for _t in _mod.ARCH.model_types:
        REGISTRY[_t] = _mod.ARCH
        MOE_SPECS[_t] = _mod.MOE
MOE_SPECS.update(importlib.import_module("fastawq.models.multimodal").MOE_SPECS)  # Llama 4's vision wrapper
SUPPORTED_MODEL_TYPES = tuple(sorted(REGISTRY))


class UnsupportedModelError(ValueError):
    pass


def get_architecture(model_type: str) -> Architecture:
    try:
        return REGISTRY[model_type]
    except KeyError:
        near = difflib.get_close_matches(str(model_type), SUPPORTED_MODEL_TYPES, n=1, cutoff=0.5)
        hint = f" The nearest supported type is {near[0]!r}." if near else ""
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported.{hint} Supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "To add one, see 'Adding an architecture' in README.md (one small file in python/fastawq/models/)."
        ) from None


def architecture_of(model) -> Architecture:
    return get_architecture(getattr(model.config, "model_type", type(model).__name__))


__all__ = ["Architecture", "ScaleGroup", "REGISTRY", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError",
           "get_architecture", "architecture_of", "get_submodule", "set_submodule"]
