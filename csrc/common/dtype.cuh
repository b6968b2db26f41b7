// fp16 / bf16 helpers shared by the kernels, and the static dtype switch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastawq {

template <typename T>
struct HalfTraits;

template <>
struct HalfTraits<__half> {
  using T2 = __half2;
  // 0x6400 is 1024.0 in fp16: OR-ing a nibble into its mantissa gives 1024 + q exactly.
  static constexpr uint32_t kMagic2 = 0x64006400u;
  static constexpr float kMagic = 1024.0f;
  static constexpr uint32_t kOne2 = 0x3C003C00u;  // (1.0, 1.0)
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static float to_float(__half v) { return __half2float(v); }
  // The two halves of a 32-bit word (low at .x).
  __device__ static float2 to_float2(uint32_t v) { return __half22float2(*reinterpret_cast<const __half2*>(&v)); }
  // Its inverse: lo and hi rounded (to nearest) into one 32-bit word.
  __device__ static uint32_t from_float2(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

template <>
struct HalfTraits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  // 0x4300 is 128.0 in bf16 (8 significant bits): 128 + q is exact for q < 16.
  static constexpr uint32_t kMagic2 = 0x43004300u;
  static constexpr float kMagic = 128.0f;
  static constexpr uint32_t kOne2 = 0x3F803F80u;
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static float2 to_float2(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
  __device__ static uint32_t from_float2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// v rounded (to nearest) to T and back: where the reference rounds an fp32 intermediate.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return HalfTraits<T>::to_float(HalfTraits<T>::from_float(v));
}

// Eight T packed in 16 bytes (element 0 in the low half of .x), as fp32; pack8 is its inverse.
template <typename T>
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = HalfTraits<T>::to_float2(w[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(HalfTraits<T>::from_float2(f[0], f[1]), HalfTraits<T>::from_float2(f[2], f[3]),
                    HalfTraits<T>::from_float2(f[4], f[5]), HalfTraits<T>::from_float2(f[6], f[7]));
}

}  // namespace fastawq
