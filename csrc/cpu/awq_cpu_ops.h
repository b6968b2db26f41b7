// Host entry points of the CPU W4 GEMM (csrc/cpu/awq_cpu.cpp, which also registers their
// schemas: the CPU ops are built with or without CUDA, so they keep out of ops.h).
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

namespace fastawq {

// Kernels this CPU runs, best first: some of avx512bf16, avx512, avx2, and always scalar.
std::vector<std::string> awq_cpu_isas();

// qweight [K, N/8] int32 · scales [K/G, N] fp16|bf16|fp32 · qzeros [K/G, N/8] int32
//   -> w [N/64, K/8, 64] int32 · scales [N/64, K/G, 64] fp32 · zeros16 [N/64, K/G, 64] uint8
// Exact: every nibble, scale and zero point is kept (layout in awq_cpu_kernels.h). G % 8 == 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> awq_cpu_repack(const at::Tensor& qweight, const at::Tensor& scales,
                                                              const at::Tensor& qzeros, int64_t group_size);

// x [M, K] fp32|bf16 · the repacked weight · bias [N] -> [M, N] (x's dtype), fp32 accumulation.
// isa: "auto" (the best this CPU runs for x's dtype) or one of awq_cpu_isas(), for tests.
at::Tensor awq_cpu_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros16,
                        int64_t group_size, int64_t n, const std::optional<at::Tensor>& bias, const std::string& isa);

// One decoder layer of a decode step (csrc/cpu/awq_cpu_decode.cpp): res [B, H] fp32 += x, then
// attention (new K/V row written at `pos` of the fp32 caches [B, S, kv_heads, head_dim]) and the
// gated MLP; res holds the residual stream after attention, the MLP's output [B, H] is returned
// (the next layer's x). weights: w, scales, zeros16 of qkv, o, gate_up, down (awq_cpu_repack);
// groups / ns / biases: theirs. cos / sin_signed: the rope row of `pos` (sin's first half negated).
at::Tensor awq_cpu_decode_layer(
    const at::Tensor& res, const std::optional<at::Tensor>& x, const at::Tensor& norm1, const at::Tensor& norm2,
    const std::vector<at::Tensor>& weights, c10::IntArrayRef groups, c10::IntArrayRef ns,
    const c10::List<std::optional<at::Tensor>>& biases,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos, const at::Tensor& cos, const at::Tensor& sin_signed,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, const std::string& activation, const std::string& isa);

}  // namespace fastawq
