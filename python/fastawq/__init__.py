"""fastawq: 4-bit AWQ quantization and fast W4A16 inference.

`import fastawq` stays light (no torch): the public names and the subpackages load on first use.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"

__all__ = ["AutoAWQForCausalLM", "AwqQuantizer", "QuantConfig", "quantize", "__version__"]

# public name -> the module that defines it
_PUBLIC = {
    "AutoAWQForCausalLM": "fastawq.auto",
    "AwqQuantizer": "fastawq.quantize.awq",
    "QuantConfig": "fastawq.quantize.config",
    "quantize": "fastawq.quantize",
}


class _Package(types.ModuleType):
    # `fastawq.quantize` is the function (the functional API). Loading the subpackage of the same
    # name makes the import system set that attribute to the subpackage; keep the function
    # (`fastawq.quantize.<module>` imports still resolve through sys.modules).
    def __setattr__(self, name: str, value: object) -> None:
        if name == "quantize" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module 'fastawq' has no attribute {name!r}")
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a subpackage: fastawq.ops, ...
    else:
        raise AttributeError(f"module 'fastawq' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


# transformers loads `quant_method: "awq"` checkpoints with fastawq's kernels once its quantizer
# registry is imported (free until then; see fastawq.integrations.transformers).
from fastawq.integrations.transformers import register_on_import as _register_on_import  # noqa: E402

_register_on_import()
