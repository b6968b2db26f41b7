"""Quantized and fused modules."""
from fastawq.modules.cpu_linear import CPUInt4Linear, CPUInt8Linear, convert_model
from fastawq.modules.moe import WQExperts
from fastawq.modules.qlinear import WQLinear, WQLinear_GEMM

__all__ = ["CPUInt4Linear", "CPUInt8Linear", "WQExperts", "WQLinear", "WQLinear_GEMM", "convert_model"]
