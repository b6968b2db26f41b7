// Host entry points of the attention ops (schemas in csrc/registration.cpp).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace fastawq {

// q [B, HQ, D] · k_cache, v_cache [B', S, HKV, D] (B' >= B) · lens [B] int32 -> [B, HQ, D]
// One query token per row over its first lens[b] cached positions (read on the device).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& lens, double scale);

// The same into a preallocated out [B, HQ, D] (a static buffer of a captured CUDA graph).
void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& lens, double scale, at::Tensor& out);

// rope_kv_cache and decode_attention in one launch, for one decode token a row: qkv [B, 1,
// (HQ + 2 HKV) D] · positions [B] int32 · cos, sin [S', D] fp32 · q/k norm weights [D] or none.
// Rotates q (after the optional per-head RMSNorm), writes the rotated K and the V of each row into
// the caches at positions[b], and returns the attention of q over the first lens[b] positions.
at::Tensor rope_decode_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                 const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lens,
                                 const std::optional<at::Tensor>& q_norm_weight,
                                 const std::optional<at::Tensor>& k_norm_weight, double eps, int64_t num_heads,
                                 double scale);

}  // namespace fastawq
