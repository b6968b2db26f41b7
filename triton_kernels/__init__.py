"""Triton kernels, installed as ``fastawq.triton_kernels``; each op here has the name and the
arguments of its wrapper in ``fastawq.ops`` (backend.py looks them up by name).

(A top-level ``triton_kernels`` package already exists in the Triton ecosystem, hence the nesting.)
"""
from .attention import decode_attention, rope_kv_cache
from .launch import awq_dequantize, awq_gemm, awq_gemm_fits, packed_dequantize, packed_gemm, packed_gemm_fits
from .moe import moe_w4, moe_w4_fits, moe_w4_packed, norm_route, route, topk_route, topk_route_fits
from .norm import act_mul, add_rms_norm

__all__ = [
    "act_mul", "add_rms_norm", "awq_dequantize", "awq_gemm", "awq_gemm_fits", "decode_attention", "moe_w4",
    "moe_w4_fits", "moe_w4_packed", "norm_route", "packed_dequantize", "packed_gemm", "packed_gemm_fits", "rope_kv_cache",
    "route",
    "topk_route", "topk_route_fits",
]
