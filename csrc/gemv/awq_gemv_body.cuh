// The AWQ-layout GEMV's inner loop, shared by the dense decode kernels (awq_gemv.cu) and the MoE
// decode kernel (csrc/moe/moe_gemv.cu): 16-byte weight loads of 32-row batches, the exact
// nibble decode and the per-group zero/scale step (awq_gemv.cu's header explains the arithmetic).
#pragma once

#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/ptx.cuh"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace gemv {

constexpr int kWarps = kGemvThreads / 32;
constexpr int kBatchRows = 32;                // rows per batch: 8 per row lane
constexpr int kLoads = kBatchRows / 4;        // loads in flight per lane per batch

template <int WPT>
struct Words;
template <>
struct Words<4> {
  uint32_t v[4];
  __device__ __forceinline__ void load(const uint32_t* p, uint64_t policy) {
    const uint4 w = gemv::load_stream(p, policy);
    v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
  }
};
template <>
struct Words<2> {
  uint32_t v[2];
  __device__ __forceinline__ void load(const uint32_t* p, uint64_t policy) {
    const uint2 w = gemv::load_stream2(p, policy);
    v[0] = w.x, v[1] = w.y;
  }
};
// f[c] = 0.5 + q_c / 256 for the 8 nibbles of an AWQ word, in real column order c = 0..7.
// Nibble i holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i]: the even nibbles (bytes of
// w & 0x0F0F0F0F) are columns 0, 4, 1, 5 and the odd ones columns 2, 6, 3, 7.
__device__ __forceinline__ void decode_word(uint32_t w, float (&f)[8]) {
  const uint32_t lo = w & 0x0F0F0F0Fu;
  const uint32_t hi = (w >> 4) & 0x0F0F0F0Fu;
  constexpr uint32_t kHalf = 0x3F000000u;  // 0.5f; selector 0x7b44 puts byte b in bits 16..19
  f[0] = __uint_as_float(__byte_perm(lo, kHalf, 0x7044));
  f[4] = __uint_as_float(__byte_perm(lo, kHalf, 0x7144));
  f[1] = __uint_as_float(__byte_perm(lo, kHalf, 0x7244));
  f[5] = __uint_as_float(__byte_perm(lo, kHalf, 0x7344));
  f[2] = __uint_as_float(__byte_perm(hi, kHalf, 0x7044));
  f[6] = __uint_as_float(__byte_perm(hi, kHalf, 0x7144));
  f[3] = __uint_as_float(__byte_perm(hi, kHalf, 0x7244));
  f[7] = __uint_as_float(__byte_perm(hi, kHalf, 0x7344));
}

// One 32-row batch of a lane: rows base + rl + 4u, u < kLoads.
template <typename T, int M, int WPT>
__device__ __forceinline__ void load_batch(const T* __restrict__ x, const uint32_t* __restrict__ qweight, int k,
                                           int n8, int word0, bool col_ok, int row0, uint64_t policy,
                                           Words<WPT> (&w)[kLoads], float (&xv)[M][kLoads]) {
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int r = row0 + 4 * u;
    if (col_ok) {
      w[u].load(qweight + static_cast<int64_t>(r) * n8 + word0, policy);
    } else {
#pragma unroll
      for (int j = 0; j < WPT; ++j) w[u].v[j] = 0u;
    }
#pragma unroll
    for (int mm = 0; mm < M; ++mm) xv[mm][u] = HalfTraits<T>::to_float(x[static_cast<int64_t>(mm) * k + r]);
  }
}

// Before the PDL wait (common/ptx.cuh): bring the weight rows of a lane's first batch into L2
// (rows row0 + 4u, u < kLoads). Only into L2, where every write lands: weights the previous
// kernel wrote (a repack) still read right after the wait.
template <int WPT>
__device__ __forceinline__ void prefetch_batch(const uint32_t* __restrict__ qweight, int n8, int word0, bool col_ok,
                                               int row0, int row_end) {
  if (!col_ok) return;
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    if (row0 + 4 * u < row_end) prefetch_l2(qweight + static_cast<int64_t>(row0 + 4 * u) * n8 + word0);
  }
}

// Accumulate one loaded batch, then close the group if the batch ends it (or ends the chunk):
// y += s * (acc - (0.5 + z/256) * xs), the zero word decoded like the weights.
template <typename T, int M, int WPT>
__device__ __forceinline__ void consume_batch(const Words<WPT> (&w)[kLoads], const float (&xv)[M][kLoads],
                                              float (&acc)[M][WPT * 8], float (&xs)[M], float (&y)[M][WPT * 8],
                                              int base, int end, int group_size, bool col_ok,
                                              const uint32_t* __restrict__ qzeros, const T* __restrict__ scales,
                                              int n8, int n, int word0) {
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
#pragma unroll
    for (int j = 0; j < WPT; ++j) {
      float f[8];
      decode_word(w[u].v[j], f);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
#pragma unroll
        for (int mm = 0; mm < M; ++mm) acc[mm][j * 8 + c] = fmaf(xv[mm][u], f[c], acc[mm][j * 8 + c]);
      }
    }
#pragma unroll
    for (int mm = 0; mm < M; ++mm) xs[mm] += xv[mm][u];
  }
  const int next = base + kBatchRows;
  if (next % group_size != 0 && next < end) return;
  if (col_ok) {
    const int grp = base / group_size;
    Words<WPT> zw;
#pragma unroll
    for (int j = 0; j < WPT; ++j) zw.v[j] = __ldg(qzeros + static_cast<int64_t>(grp) * n8 + word0 + j);
    const uint4* sp = reinterpret_cast<const uint4*>(scales + static_cast<int64_t>(grp) * n + word0 * 8);
#pragma unroll
    for (int j = 0; j < WPT; ++j) {
      float fz[8];
      decode_word(zw.v[j], fz);
      const uint4 sv = __ldg(sp + j);
      const T* sh = reinterpret_cast<const T*>(&sv);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float s = HalfTraits<T>::to_float(sh[c]);
#pragma unroll
        for (int mm = 0; mm < M; ++mm) {
          const float v = fmaf(-fz[c], xs[mm], acc[mm][j * 8 + c]);
          y[mm][j * 8 + c] = fmaf(s, v, y[mm][j * 8 + c]);
        }
      }
    }
  }
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
    xs[mm] = 0.f;
#pragma unroll
    for (int c = 0; c < WPT * 8; ++c) acc[mm][c] = 0.f;
  }
}

}  // namespace gemv
}  // namespace fastawq
