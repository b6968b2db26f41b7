// The per-batch pieces of the CUDA-core GEMV on the packed layout (gemv/awq_gemv_packed.h): a lane's
// 16-byte weight loads, its activations, and the two ways to sum one 32-row batch (fp32 through the
// exact nibble decode, or half2). awq_gemv_packed.cu (the dense decode GEMV) and moe/moe_gemv_packed.cu
// (the experts' decode GEMV) walk K with them.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace gemv_packed {

constexpr int kWarps = kPackedThreads / 32;
constexpr int kLoads = kPackedBatchRows / 8;  // 16-byte loads per lane per batch

// The 4 loads of a lane's batch at p (8-row blocks 4b .. 4b+3 at its column chunk), n4 apart.
__device__ __forceinline__ void load_batch(uint4 (&w)[kLoads], const uint4* __restrict__ p, int64_t n4, bool col_ok,
                                           uint64_t policy) {
#pragma unroll
  for (int u = 0; u < kLoads; ++u) w[u] = col_ok ? gemv::load_stream(p + u * n4, policy) : make_uint4(0, 0, 0, 0);
}

// x[mm][row0 + 8u .. + 7] of each of the M rows (row stride ldx): the 8 activations of one 16-byte
// weight load; SX: x is in shared memory (awq_gemv_packed_act's staged input).
template <typename T, int M, bool SX = false>
__device__ __forceinline__ void load_x8(uint4 (&xr)[M], const T* __restrict__ x, int ldx, int row0, int u) {
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
    const T* p = x + static_cast<int64_t>(mm) * ldx + row0 + 8 * u;
    if constexpr (SX) {
      xr[mm] = ld_shared128(p);
    } else {
      xr[mm] = __ldg(reinterpret_cast<const uint4*>(p));
    }
  }
}

// acc += x * f over one batch (rows row0 .. row0+31), xs += x. after_first() runs once the first
// 16-byte load's weights have been used (both consumes).
template <typename T, int M, bool SX = false, typename Hook>
__device__ __forceinline__ void consume(const uint4 (&w)[kLoads], const T* __restrict__ x, int k, int row0,
                                        float (&acc)[M][4], float (&xs)[M], Hook&& after_first) {
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    uint4 xr[M];
    load_x8<T, M, SX>(xr, x, k, row0, u);
    const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float flo[4], fhi[4];
      gemv::decode_bytes(words[j] & 0x0F0F0F0Fu, flo);         // row 8u + 2j, byte c = column c
      gemv::decode_bytes((words[j] >> 4) & 0x0F0F0F0Fu, fhi);  // row 8u + 2j + 1
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        const uint32_t pair = j == 0 ? xr[mm].x : j == 1 ? xr[mm].y : j == 2 ? xr[mm].z : xr[mm].w;
        const float2 xv = HalfTraits<T>::to_float2(pair);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[mm][c] = fmaf(xv.x, flo[c], acc[mm][c]);
          acc[mm][c] = fmaf(xv.y, fhi[c], acc[mm][c]);
        }
        xs[mm] += xv.x + xv.y;
      }
    }
    if (u == 0) after_first();
  }
}

// The half2 path (kH2), ~30 % fewer instructions: per word, gemv::word_pairs gives its 8 weights
// as 4 pairs of (magic + q / 16) in x's dtype (rows 2j, 2j + 1 of columns (0, 2), then of (1, 3):
// the byte layout's natural pairs), one hsub2 each against the group's (magic + z / 16) leaves
// (q - z) / 16 exactly, and hfma2 multiplies by x in pairs: the 8 rows of one 16-byte load are
// summed in half2 / bfloat162, then added into fp32. The 1/16 keeps a pair's partial of 8 products
// below 8 max|x|, so fp16 cannot overflow for |x| < 8188 (activations reach the low thousands at
// most); the products round to x's dtype as the dequantized weights of an fp16 / bf16 GEMM do.
using gemv::H2Magic;

// zc[0..3]: (even-row magic + z / 16) and (odd-row magic + z / 16) of columns (0, 2), then (1, 3).
template <typename T, int M, bool SX = false, typename Hook>
__device__ __forceinline__ void consume_h2(const uint4 (&w)[kLoads], const T* __restrict__ x, int k, int row0,
                                           const typename HalfTraits<T>::T2 (&zc)[4], float (&acc)[M][4],
                                           Hook&& after_first) {
  using T2 = typename HalfTraits<T>::T2;
  const auto h2 = [](uint32_t v) { return *reinterpret_cast<const T2*>(&v); };
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    uint4 xr[M];
    load_x8<T, M, SX>(xr, x, k, row0, u);
    const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
    T2 p02[M], p13[M];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t r[4];  // rows 2j, 2j + 1 of columns (0, 2), then of (1, 3)
      gemv::word_pairs<T>(words[j], r);
      const T2 a = __hsub2(h2(r[0]), zc[0]), b = __hsub2(h2(r[1]), zc[1]);
      const T2 c = __hsub2(h2(r[2]), zc[2]), d = __hsub2(h2(r[3]), zc[3]);
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        const uint32_t pair = j == 0 ? xr[mm].x : j == 1 ? xr[mm].y : j == 2 ? xr[mm].z : xr[mm].w;
        const T2 xp = h2(pair);
        T2 xe, xo;  // (x[2j], x[2j]) and (x[2j + 1], x[2j + 1])
        if constexpr (std::is_same_v<T, __half>) {
          xe = __low2half2(xp), xo = __high2half2(xp);
        } else {
          xe = __low2bfloat162(xp), xo = __high2bfloat162(xp);
        }
        if (j == 0) {
          p02[mm] = __hmul2(a, xe), p13[mm] = __hmul2(c, xe);
        } else {
          p02[mm] = __hfma2(a, xe, p02[mm]), p13[mm] = __hfma2(c, xe, p13[mm]);
        }
        p02[mm] = __hfma2(b, xo, p02[mm]), p13[mm] = __hfma2(d, xo, p13[mm]);
      }
    }
#pragma unroll
    for (int mm = 0; mm < M; ++mm) {
      const float2 f02 = HalfTraits<T>::to_float2(*reinterpret_cast<const uint32_t*>(&p02[mm]));
      const float2 f13 = HalfTraits<T>::to_float2(*reinterpret_cast<const uint32_t*>(&p13[mm]));
      acc[mm][0] += f02.x, acc[mm][2] += f02.y, acc[mm][1] += f13.x, acc[mm][3] += f13.y;
    }
    if (u == 0) after_first();
  }
}

// The hsub2 operands of consume_h2 for a group's (scale, zero) pairs sv (4 columns).
template <typename T>
__device__ __forceinline__ void zero_consts(const uint4& sv, typename HalfTraits<T>::T2 (&zc)[4]) {
  using Tr = HalfTraits<T>;
  using Mg = H2Magic<T>;
  const T* p = reinterpret_cast<const T*>(&sv);
  float z[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) z[c] = Tr::to_float(p[2 * c + 1]) * 0.0625f;
  const auto pack = [](float lo, float hi) {
    const T v[2] = {Tr::from_float(lo), Tr::from_float(hi)};
    return *reinterpret_cast<const typename Tr::T2*>(v);
  };
  zc[0] = pack(Mg::kEvenBase + z[0], Mg::kEvenBase + z[2]);
  zc[1] = pack(Mg::kOddBase + z[0], Mg::kOddBase + z[2]);
  zc[2] = pack(Mg::kEvenBase + z[1], Mg::kEvenBase + z[3]);
  zc[3] = pack(Mg::kOddBase + z[1], Mg::kOddBase + z[3]);
}


}  // namespace gemv_packed
}  // namespace fastawq
