"""Quantized and fused modules."""
from fastawq.modules.cpu_linear import CPUInt4Linear, CPUInt8Linear, convert_model
from fastawq.modules.qlinear import WQLinear, WQLinear_GEMM

__all__ = ["CPUInt4Linear", "CPUInt8Linear", "WQLinear", "WQLinear_GEMM", "convert_model"]
