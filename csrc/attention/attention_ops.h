// Host entry points of the attention ops (schemas in csrc/registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace fastawq {

// q [B, HQ, D] · k_cache, v_cache [B', S, HKV, D] (B' >= B) · lens [B] int32 -> [B, HQ, D]
// One query token per row over its first lens[b] cached positions (read on the device).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& lens, double scale);

// The same into a preallocated out [B, HQ, D] (a static buffer of a captured CUDA graph).
void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& lens, double scale, at::Tensor& out);

}  // namespace fastawq
