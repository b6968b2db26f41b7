"""fastawq.ops: every op the model layer calls, one function each.

Each wrapper has a shape banner, validates its inputs (messages name the shapes), asks
backend.select_backend once (``backend=`` / ``FASTAWQ_BACKEND``: cuda | triton | cpu | torch),
and calls one schema'd op (compiled in fastawq._C, or a ``torch.library.custom_op``) whose fake
impl sits beside it. The torch backend of every op is its reference in reference.py.

  gemm.py   awq_gemm, awq_gemm_plan, awq_dequantize
  layer.py  add_rms_norm, act_mul, act_mul_sums, rope_kv_cache, decode_attention, rope_decode_attention, prefill_attention
  moe.py    moe_w4, moe_w4_plan, topk_route, route, add_rms_norm_route (mixture-of-experts blocks)
  repack.py the packed layout (exact repack, both ways), packed_gemm, packed_gemm_plan, packed_dequantize
"""
from fastawq.ops.gemm import awq_dequantize, awq_gemm, awq_gemm_plan, cuda_gemm_declines
from fastawq.ops.layer import (
    ACTIVATIONS,
    act_mul,
    act_mul_sums,
    add_rms_norm,
    cuda_decode_declines,
    decode_attention,
    decode_attention_backend,
    prefill_attention,
    rope_attention_fused,
    rope_decode_attention,
    rope_kv_cache,
)
from fastawq.ops.moe import add_rms_norm_route, moe_w4, moe_w4_plan, route, topk_route
from fastawq.ops.repack import awq_gemv_repack, awq_gemv_unpack, packed_dequantize, packed_gemm, packed_gemm_plan

__all__ = [
    "ACTIVATIONS",
    "act_mul",
    "act_mul_sums",
    "add_rms_norm",
    "add_rms_norm_route",
    "awq_dequantize",
    "awq_gemm",
    "awq_gemm_plan",
    "awq_gemv_repack",
    "awq_gemv_unpack",
    "moe_w4",
    "moe_w4_plan",
    "route",
    "topk_route",
    "cuda_decode_declines",
    "cuda_gemm_declines",
    "decode_attention",
    "decode_attention_backend",
    "packed_dequantize",
    "packed_gemm",
    "packed_gemm_plan",
    "prefill_attention",
    "rope_attention_fused",
    "rope_decode_attention",
    "rope_kv_cache",
]
