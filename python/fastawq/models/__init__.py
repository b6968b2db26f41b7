"""Architecture registry: one small file per family declares its decoder layers and scale groups."""
from __future__ import annotations

import importlib

from fastawq.models.base import Architecture, ScaleGroup

_FILES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "opt", "gpt_neox")

REGISTRY: dict[str, Architecture] = {}
for _f in _FILES:
    _arch = importlib.import_module(f"fastawq.models.{_f}").ARCH
    for _t in _arch.model_types:
        REGISTRY[_t] = _arch

# Mixture-of-experts families: a record plus MOE, where the router and experts live (models/moe.py).
MOE_SPECS: dict[str, MoESpec] = {}
for _f in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "llama4"):
    _mod = importlib.import_module(f"fastawq.models.{_f}")
    for _t in _mod.ARCH.model_types:
        REGISTRY[_t] = _mod.ARCH
        MOE_SPECS[_t] = _mod.MOE
SUPPORTED_MODEL_TYPES = tuple(sorted(REGISTRY))


class UnsupportedModelError(ValueError):
    pass


def get_architecture(model_type: str) -> Architecture:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


def architecture_of(model) -> Architecture:
    return get_architecture(getattr(model.config, "model_type", type(model).__name__))


__all__ = ["Architecture", "ScaleGroup", "REGISTRY", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError",
           "get_architecture", "architecture_of"]
