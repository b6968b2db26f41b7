// Every host entry point of fastawq._C, declared once. Schemas live in registration.cpp.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace fastawq {

// qweight [K, N/8] int32 · scales [K/G, N] fp16|bf16 · qzeros [K/G, N/8] int32 -> w [K, N] (scales' dtype)
at::Tensor awq_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                          int64_t group_size);

// x [M, K] fp16|bf16 · qweight [K, N/8] · scales [K/G, N] (x's dtype) · qzeros [K/G, N/8] · bias [N] -> [M, N]
// Picks the tensor-core kernel or dequantize + cuBLAS by M (see benchmarks/CUDA_NOTES.md).
at::Tensor awq_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias);

// Same as awq_gemm with the path forced, for benchmarks and tests:
// path 0 = auto, 1 = tensor-core kernel, 2 = dequantize + cuBLAS, 3/4/5 = tensor-core variants,
// 6 = CUDA-core GEMV (M <= 8); split_k 0 = auto (for path 6: the number of K splits).
at::Tensor awq_gemm_config(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                           int64_t path, int64_t split_k);

// Load-time repack for the tensor-core kernel (exact permutation): qweight [K, N/8] -> [N/128, K/32, 32, 16].
at::Tensor awq_repack_tiled(const at::Tensor& qweight);

// awq_gemm on a repacked qweight (tensor-core kernel, any M); split_k 0 = auto.
at::Tensor awq_gemm_tiled(const at::Tensor& x, const at::Tensor& qweight_tiled, const at::Tensor& scales,
                          const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                          int64_t split_k);

// Internal: dequantize into a preallocated out [K, N] (used by the large-M path of awq_gemm).
void awq_dequantize_into(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                         int64_t group_size, at::Tensor& out);

}  // namespace fastawq
