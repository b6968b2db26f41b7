// AWQ dequantize: packed int4 [K, N/8] -> fp16/bf16 [K, N]. One thread per int32 word.
#include "common/dtype.cuh"
#include "common/launch.h"

#include <algorithm>

namespace fastawq {
namespace {

// Nibble that holds column c of an 8-column group (inverse of the AWQ order 0,2,4,6,1,3,5,7).
__device__ __forceinline__ int awq_nibble_shift(int c) { return 4 * ((c >> 1) | ((c & 1) << 2)); }

// Computes (q - z) * s in fp32 and rounds once: bit-identical to reference.dequantize.
template <typename T>
__global__ void dequantize_kernel(const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
                                  const uint32_t* __restrict__ qzeros, T* __restrict__ out, int k, int n8,
                                  int group_size) {
  const int64_t words = static_cast<int64_t>(k) * n8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / n8);
    const int col8 = static_cast<int>(i % n8);
    const int grp = row / group_size;
    const uint32_t q = __ldg(qweight + i);
    const uint32_t z = __ldg(qzeros + static_cast<int64_t>(grp) * n8 + col8);
    const T* s = scales + static_cast<int64_t>(grp) * n8 * 8 + col8 * 8;
    alignas(16) T vals[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int sh = awq_nibble_shift(c);
      const float qv = static_cast<float>((q >> sh) & 0xF);
      const float zv = static_cast<float>((z >> sh) & 0xF);
      vals[c] = HalfTraits<T>::from_float((qv - zv) * HalfTraits<T>::to_float(s[c]));
    }
    *reinterpret_cast<uint4*>(out + i * 8) = *reinterpret_cast<const uint4*>(vals);
  }
}

}  // namespace

void launch_awq_dequantize(HalfType dtype, const uint32_t* qweight, const void* scales, const uint32_t* qzeros,
                           void* out, int k, int n8, int group_size, int max_blocks, cudaStream_t stream) {
  const int threads = 256;
  const int64_t words = static_cast<int64_t>(k) * n8;
  if (words == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((words + threads - 1) / threads, max_blocks));
  if (dtype == HalfType::kHalf) {
    dequantize_kernel<__half><<<blocks, threads, 0, stream>>>(qweight, static_cast<const __half*>(scales), qzeros,
                                                              static_cast<__half*>(out), k, n8, group_size);
  } else {
    dequantize_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
        qweight, static_cast<const __nv_bfloat16*>(scales), qzeros, static_cast<__nv_bfloat16*>(out), k, n8,
        group_size);
  }
}

}  // namespace fastawq
