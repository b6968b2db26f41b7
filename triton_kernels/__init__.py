"""Triton W4A16 kernels, installed as ``fastawq.triton_kernels``.

(A top-level ``triton_kernels`` package already exists in the Triton ecosystem, hence the nesting.)
"""
from .launch import awq_dequantize, awq_gemm, awq_gemm_fits
from .moe import moe_w4, moe_w4_fits, topk_route, topk_route_fits

__all__ = ["awq_dequantize", "awq_gemm", "awq_gemm_fits", "moe_w4", "moe_w4_fits", "topk_route", "topk_route_fits"]
