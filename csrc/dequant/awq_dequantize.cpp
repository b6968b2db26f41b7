// Host entry of fastawq::awq_dequantize.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/launch.h"
#include "ops.h"

namespace fastawq {

void awq_dequantize_into(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                         int64_t g, at::Tensor& out) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  launch_awq_dequantize(scales.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16,
                        reinterpret_cast<const uint32_t*>(qweight.data_ptr<int>()), scales.data_ptr(),
                        reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int>()), out.data_ptr(),
                        static_cast<int>(qweight.size(0)), static_cast<int>(qweight.size(1)), static_cast<int>(g),
                        sms * 16, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// qweight [K, N/8] int32 · scales [K/G, N] · qzeros [K/G, N/8] int32 -> w [K, N]
at::Tensor awq_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                          int64_t group_size) {
  int64_t k, n, g;
  check_awq_weight("awq_dequantize", qweight, scales, qzeros, group_size, k, n, g);
  FASTAWQ_CHECK(k * (n / 8) < (int64_t(1) << 31), "awq_dequantize: qweight ", shape_str(qweight), " is too large");
  const c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty({k, n}, scales.options());
  awq_dequantize_into(qweight, scales, qzeros, g, out);
  return out;
}

}  // namespace fastawq
