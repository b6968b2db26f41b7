// AVX2 W4 GEMM for fp32 activations (compiled with -mavx2 -mfma; called only after a run-time
// CPU check). The AVX-512 kernel's method on 8-lane vectors: a 64-column block is walked as two
// 32-column halves so that accumulators and weights fit the 16 ymm registers.
#include "cpu/awq_cpu_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace fastawq::cpu {
namespace {

template <int P>
inline __m256 dequant(__m256i w) {
  constexpr int s = 19 - 4 * P;
  __m256i t;
  if constexpr (s >= 0) {
    t = _mm256_slli_epi32(w, s);
  } else {
    t = _mm256_srli_epi32(w, -s);
  }
  t = _mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi32(0x00780000)), _mm256_set1_epi32(0x3f800000));
  return _mm256_castsi256_ps(t);
}

template <int MR, int P>
inline void step(const __m256i (&w)[4], const float* const (&x)[MR], int64_t k0, __m256 (&acc)[MR][4]) {
  __m256 wf[4];
  for (int v = 0; v < 4; ++v) wf[v] = dequant<P>(w[v]);
  for (int r = 0; r < MR; ++r) {
    const __m256 xb = _mm256_broadcast_ss(x[r] + k0 + kRowOfNibble[P]);
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wf[v], acc[r][v]);
  }
}

// Columns [32 * half, 32 * half + 32) of block nb, rows m0 .. m0 + MR.
template <int MR>
void half_block(const GemmArgs& a, int64_t nb, int half, int64_t m0) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK;
  const int c0 = 32 * half;
  const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN + c0;
  const float* sc = a.scales + nb * groups * kBlockN + c0;
  const uint8_t* zz = a.zeros16 + nb * groups * kBlockN + c0;
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const float*>(a.x) + (m0 + r) * a.x_stride;
  alignas(32) float y[MR][32] = {};
  const __m256 sixteen = _mm256_set1_ps(16.0f);

  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t o = g * octets; o < (g + 1) * octets; ++o) {
      const uint32_t* wo = w + o * kBlockN;
      const __m256i wv[4] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 8)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 16)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 24))};
      const int64_t k0 = o * kStepK;
      step<MR, 0>(wv, x, k0, acc);
      step<MR, 1>(wv, x, k0, acc);
      step<MR, 2>(wv, x, k0, acc);
      step<MR, 3>(wv, x, k0, acc);
      step<MR, 4>(wv, x, k0, acc);
      step<MR, 5>(wv, x, k0, acc);
      step<MR, 6>(wv, x, k0, acc);
      step<MR, 7>(wv, x, k0, acc);
    }
    for (int v = 0; v < 4; ++v) {
      const __m256 s = _mm256_loadu_ps(sc + g * kBlockN + 8 * v);
      int64_t z8;
      std::memcpy(&z8, zz + g * kBlockN + 8 * v, 8);
      const __m256 z16 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8)));
      for (int r = 0; r < MR; ++r) {
        const __m256 t = _mm256_fmsub_ps(acc[r][v], sixteen, _mm256_mul_ps(z16, _mm256_set1_ps(a.xsum[(m0 + r) * groups + g])));
        _mm256_store_ps(y[r] + 8 * v, _mm256_fmadd_ps(s, t, _mm256_load_ps(y[r] + 8 * v)));
      }
    }
  }

  const int64_t n0 = nb * kBlockN + c0, cols = std::clamp<int64_t>(a.n - n0, 0, 32);
  for (int r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float out = y[r][c] + (a.bias ? a.bias[n0 + c] : 0.0f);
      if (a.out_dtype == Dtype::kFloat32) {
        static_cast<float*>(a.out)[(m0 + r) * a.out_stride + n0 + c] = out;
      } else {
        static_cast<uint16_t*>(a.out)[(m0 + r) * a.out_stride + n0 + c] = bf16_bits(out);
      }
    }
  }
}

void gemm_blocks(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int half = 0; half < 2 && nb * kBlockN + 32 * half < a.n; ++half) {
      for (int64_t m = m0; m < m1;) {
        if (m1 - m >= 2) {
          half_block<2>(a, nb, half, m);
          m += 2;
        } else {
          half_block<1>(a, nb, half, m);
          m += 1;
        }
      }
    }
  }
}

// ---- int8 activations: per octet and 8 columns, two masks, one shift, two vpmaddubsw (u8
// nibble x s8 activation, pairs summed in int16) and one add, against the fp32 path's 8 x
// (shift, and, or, fma). |pair| <= 2 * 15 * 127 = 3810, so 4 octets (8 pairs) stay below 2^15:
// int16 sums over a block of up to 32 rows are exact; one vpmaddwd makes them int32 per column,
// converted to fp32 and scaled by the block's activation scale.

// Columns [32 * half, 32 * half + 32) of block nb, row m, OB octets per activation block.
template <int OB>
void half_block_i8(const GemmArgs& a, int64_t nb, int half, int64_t m) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK, blocks = octets / OB;
  const int c0 = 32 * half;
  const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN + c0;
  const float* sc = a.scales + nb * groups * kBlockN + c0;
  const uint8_t* zz = a.zeros16 + nb * groups * kBlockN + c0;
  const int8_t* xq = a.xq + m * a.k;
  const float* xs = a.xq_scale + m * (a.k / (OB * kStepK));
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float y[32] = {};

  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      __m256i acc16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
      for (int j = 0; j < OB; ++j) {
        const int64_t o = b * OB + j;
        const uint32_t* wo = w + o * kBlockN;
        int32_t lo, hi;
        std::memcpy(&lo, xq + o * kStepK, 4);
        std::memcpy(&hi, xq + o * kStepK + 4, 4);
        const __m256i xlo = _mm256_set1_epi32(lo), xhi = _mm256_set1_epi32(hi);
        for (int v = 0; v < 4; ++v) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 8 * v));
          const __m256i wl = _mm256_and_si256(wv, nib);
          const __m256i wh = _mm256_and_si256(_mm256_srli_epi32(wv, 4), nib);
          acc16[v] = _mm256_add_epi16(
              acc16[v], _mm256_add_epi16(_mm256_maddubs_epi16(wl, xlo), _mm256_maddubs_epi16(wh, xhi)));
        }
      }
      const __m256 sx = _mm256_set1_ps(xs[b]);
      for (int v = 0; v < 4; ++v)
        acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc16[v], ones)), sx, acc[v]);
    }
    const __m256 xsum = _mm256_set1_ps(a.xsum[m * groups + g]);
    for (int v = 0; v < 4; ++v) {
      const __m256 s = _mm256_loadu_ps(sc + g * kBlockN + 8 * v);
      int64_t z8;
      std::memcpy(&z8, zz + g * kBlockN + 8 * v, 8);
      const __m256 z = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8))),
                                     _mm256_set1_ps(16.0f));
      const __m256 t = _mm256_fnmadd_ps(z, xsum, acc[v]);
      _mm256_store_ps(y + 8 * v, _mm256_fmadd_ps(s, t, _mm256_load_ps(y + 8 * v)));
    }
  }

  const int64_t n0 = nb * kBlockN + c0, cols = std::clamp<int64_t>(a.n - n0, 0, 32);
  for (int64_t c = 0; c < cols; ++c) {
    const float out = y[c] + (a.bias ? a.bias[n0 + c] : 0.0f);
    if (a.out_dtype == Dtype::kFloat32) {
      static_cast<float*>(a.out)[m * a.out_stride + n0 + c] = out;
    } else {
      static_cast<uint16_t*>(a.out)[m * a.out_stride + n0 + c] = bf16_bits(out);
    }
  }
}

void gemm_blocks_i8(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  auto half = a.xq_block == 32 ? &half_block_i8<4> : a.xq_block == 16 ? &half_block_i8<2> : &half_block_i8<1>;
  for (int64_t nb = b0; nb < b1; ++nb)
    for (int h = 0; h < 2 && nb * kBlockN + 32 * h < a.n; ++h)
      for (int64_t m = m0; m < m1; ++m) half(a, nb, h, m);
}

}  // namespace

BlockKernel kernel_avx2_int8() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &gemm_blocks_i8 : nullptr;
}

BlockKernel kernel_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &gemm_blocks : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx2() { return nullptr; }
BlockKernel kernel_avx2_int8() { return nullptr; }
}  // namespace fastawq::cpu

#endif
