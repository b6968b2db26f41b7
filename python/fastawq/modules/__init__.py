"""Quantized and fused modules."""
from fastawq.modules.qlinear import WQLinear, WQLinear_GEMM

__all__ = ["WQLinear", "WQLinear_GEMM"]
