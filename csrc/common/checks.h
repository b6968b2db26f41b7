// Argument checks shared by the host entry points. Messages name the problem's shapes.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace fastawq {

// Error messages are built by plain string concatenation, not c10::str: an std::ostringstream
// instantiated inside _C crashed the interpreter on the H200 image (GCC 13 headers, libstdc++ 14
// at run time); a single std::string argument makes TORCH_CHECK skip the stream.
inline void append(std::string& out, std::string_view v) { out.append(v.data(), v.size()); }
inline void append(std::string& out, const char* v) { out.append(v); }
inline void append(std::string& out, const std::string& v) { out.append(v); }
inline void append(std::string& out, c10::ScalarType v) { out.append(c10::toString(v)); }
inline void append(std::string& out, const c10::Device& v) { out.append(v.str()); }
inline void append(std::string& out, c10::IntArrayRef v) {
  out.push_back('[');
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(v[i]));
  }
  out.push_back(']');
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline void append(std::string& out, T v) {
  out.append(std::to_string(v));
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

#define FASTAWQ_CHECK(cond, ...) TORCH_CHECK(cond, ::fastawq::cat(__VA_ARGS__))

inline std::string shape_str(const at::Tensor& t) { return cat(t.sizes()); }

// The packed AWQ weight: returns nothing, fills k, n and the resolved group size g.
inline void check_awq_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& qzeros, int64_t group_size, int64_t& k, int64_t& n, int64_t& g) {
  FASTAWQ_CHECK(qweight.dim() == 2 && scales.dim() == 2 && qzeros.dim() == 2, op,
              ": expected 2-D qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8]; got qweight ",
              shape_str(qweight), ", scales ", shape_str(scales), ", qzeros ", shape_str(qzeros));
  FASTAWQ_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt, op,
              ": qweight and qzeros must be int32, got ", qweight.scalar_type(), " and ", qzeros.scalar_type());
  FASTAWQ_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16, op,
              ": scales must be fp16 or bf16, got ", scales.scalar_type());
  FASTAWQ_CHECK(qweight.is_cuda() && scales.device() == qweight.device() && qzeros.device() == qweight.device(), op,
              ": qweight, scales and qzeros must be on one CUDA device, got ", qweight.device(), ", ",
              scales.device(), ", ", qzeros.device());
  FASTAWQ_CHECK(qweight.is_contiguous() && scales.is_contiguous() && qzeros.is_contiguous(), op,
              ": qweight ", shape_str(qweight), ", scales ", shape_str(scales), " and qzeros ", shape_str(qzeros),
              " must be contiguous");
  k = qweight.size(0);
  n = qweight.size(1) * 8;
  g = group_size;
  FASTAWQ_CHECK(g > 0, op, ": group_size must be resolved to a positive value (K=", k, "), got ", group_size);
  FASTAWQ_CHECK(k % g == 0, op, ": K=", k, " (qweight ", shape_str(qweight), ") is not divisible by group_size=", g);
  FASTAWQ_CHECK(scales.size(0) == k / g && scales.size(1) == n && qzeros.size(0) == k / g && qzeros.size(1) == n / 8,
              op, ": inconsistent shapes for K=", k, ", N=", n, ", group_size=", g, ": expected scales [", k / g, ", ",
              n, "] and qzeros [", k / g, ", ", n / 8, "], got scales ", shape_str(scales), " and qzeros ",
              shape_str(qzeros));
}

}  // namespace fastawq
