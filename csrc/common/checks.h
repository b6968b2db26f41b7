// Argument checks shared by the host entry points. Messages name the problem's shapes.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace fastawq {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

// The packed AWQ weight: returns nothing, fills k, n and the resolved group size g.
inline void check_awq_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& qzeros, int64_t group_size, int64_t& k, int64_t& n, int64_t& g) {
  TORCH_CHECK(qweight.dim() == 2 && scales.dim() == 2 && qzeros.dim() == 2, op,
              ": expected 2-D qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8]; got qweight ",
              shape_str(qweight), ", scales ", shape_str(scales), ", qzeros ", shape_str(qzeros));
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt, op,
              ": qweight and qzeros must be int32, got ", qweight.scalar_type(), " and ", qzeros.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16, op,
              ": scales must be fp16 or bf16, got ", scales.scalar_type());
  TORCH_CHECK(qweight.is_cuda() && scales.device() == qweight.device() && qzeros.device() == qweight.device(), op,
              ": qweight, scales and qzeros must be on one CUDA device, got ", qweight.device(), ", ",
              scales.device(), ", ", qzeros.device());
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && qzeros.is_contiguous(), op,
              ": qweight ", shape_str(qweight), ", scales ", shape_str(scales), " and qzeros ", shape_str(qzeros),
              " must be contiguous");
  k = qweight.size(0);
  n = qweight.size(1) * 8;
  g = group_size;
  TORCH_CHECK(g > 0, op, ": group_size must be resolved to a positive value (K=", k, "), got ", group_size);
  TORCH_CHECK(k % g == 0, op, ": K=", k, " (qweight ", shape_str(qweight), ") is not divisible by group_size=", g);
  TORCH_CHECK(scales.size(0) == k / g && scales.size(1) == n && qzeros.size(0) == k / g && qzeros.size(1) == n / 8,
              op, ": inconsistent shapes for K=", k, ", N=", n, ", group_size=", g, ": expected scales [", k / g, ", ",
              n, "] and qzeros [", k / g, ", ", n / 8, "], got scales ", shape_str(scales), " and qzeros ",
              shape_str(qzeros));
}

}  // namespace fastawq
