"""fastawq: 4-bit AWQ quantization and fast W4A16 inference."""
__version__ = "0.1.0"

# Bound after the subpackage import on purpose: `fastawq.quantize` is the function (the functional
# API), while `fastawq.quantize.<module>` imports still resolve through sys.modules.
from fastawq.quantize import AwqQuantizer, QuantConfig, quantize  # noqa: E402

__all__ = ["AutoAWQForCausalLM", "AwqQuantizer", "QuantConfig", "quantize", "__version__"]


def __getattr__(name: str):
    if name == "AutoAWQForCausalLM":
        from fastawq.auto import AutoAWQForCausalLM

        return AutoAWQForCausalLM
    raise AttributeError(f"module 'fastawq' has no attribute {name!r}")

# transformers loads `quant_method: "awq"` checkpoints with fastawq's kernels once its quantizer
# registry is imported (free until then; see fastawq.integrations.transformers).
from fastawq.integrations.transformers import register_on_import as _register_on_import  # noqa: E402

_register_on_import()
