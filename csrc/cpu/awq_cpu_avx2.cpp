// AVX2 W4 GEMMs (compiled with -mavx2 -mfma; called only after a run-time CPU check): for fp32
// activations, the AVX-512 kernel's method (awq_cpu_block.h) on 8-lane vectors, a 64-column block
// walked as two 32-column parts so that accumulators and weights fit the 16 ymm registers; and
// for int8 activations, integer dot products (below).
#include "cpu/awq_cpu_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/awq_cpu_block.h"

namespace fastawq::cpu {
namespace {

// fp32 x (32-column parts, 1-2 rows): nibble P of every lane moved to bits 19..22 (the top of an
// fp32 mantissa) and ORed into 1.0.
struct Avx2Fp32 : Fp32Octet<Avx2Vec, Avx2Fp32> {
  template <int P>
  static __m256 dequant(__m256i w) {
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
};

// ---- int8 activations: per octet and 8 columns, two masks, one shift, two vpmaddubsw (u8
// nibble x s8 activation, pairs summed in int16) and one add, against the fp32 path's 8 x
// (shift, and, or, fma). |pair| <= 2 * 15 * 127 = 3810, so 4 octets (8 pairs) stay below 2^15:
// int16 sums over a block of up to 32 rows are exact; one vpmaddwd makes them int32 per column,
// converted to fp32 and scaled by the block's activation scale.

// Octets of K ahead that the weights are prefetched (a 256-byte row each): 16, 32 and 64 measured
// alike on a 2-core AMD EPYC (AVX2), about 1.3x over none (benchmarks/CPU_RESULTS.md).
constexpr int64_t kPrefetchOctets = 32;

// S adjacent 64-column blocks nb .. nb + S - 1 of row m, OB octets per activation block, in one
// pass: per octet of K, the weights of each block are read in memory order (one 256-byte row per
// block), 8 * S int16 accumulators (the compiler keeps some on the stack when S = 2) and the
// per-group fp32 sums of each block in an L1 array. Walking two blocks together gives the memory
// system two weight streams 128 KiB apart instead of one: 0.86-0.93x the time of one block at a
// time on a 2-core AMD EPYC (AVX2), where a plain one-stream read of the weights is no faster than
// the one-block kernel (benchmarks/CPU_RESULTS.md). Each block's arithmetic, and so its output, is
// the same as walking it alone. (Two passes of 32 columns, which kept the fp32 sums in registers
// too, read each row in two halves: 1.6x slower.)
template <int OB, int S>
void blocks_i8(const GemmArgs& a, int64_t nb, int64_t m) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK, blocks = octets / OB;
  const uint32_t* w[S];
  const float* sc[S];
  const uint8_t* zz[S];
  for (int s = 0; s < S; ++s) {
    w[s] = a.w + (nb + s) * (a.k / kStepK) * kBlockN;
    sc[s] = a.scales + (nb + s) * groups * kBlockN;
    zz[s] = a.zeros16 + (nb + s) * groups * kBlockN;
  }
  const int8_t* xq = a.xq + m * a.k;
  const float* xs = a.xq_scale + m * (a.k / (OB * kStepK));
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float y[S][kBlockN] = {};
  alignas(32) float acc[S][kBlockN];

  for (int64_t g = 0; g < groups; ++g) {
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < 8; ++v) _mm256_store_ps(acc[s] + 8 * v, _mm256_setzero_ps());
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      __m256i acc16[S][8];
      for (int s = 0; s < S; ++s)
        for (int v = 0; v < 8; ++v) acc16[s][v] = _mm256_setzero_si256();
      for (int j = 0; j < OB; ++j) {
        const int64_t o = b * OB + j;
        int32_t lo, hi;
        std::memcpy(&lo, xq + o * kStepK, 4);
        std::memcpy(&hi, xq + o * kStepK + 4, 4);
        const __m256i xlo = _mm256_set1_epi32(lo), xhi = _mm256_set1_epi32(hi);
        for (int s = 0; s < S; ++s) {
          const uint32_t* wo = w[s] + o * kBlockN;
          // Past the block's end this touches the next block's first rows, or nothing: a
          // prefetch is a hint and never faults (the address is formed as an integer).
          const char* pp = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wo) +
                                                         kPrefetchOctets * kBlockN * sizeof(uint32_t));
          for (int line = 0; line < 4; ++line) _mm_prefetch(pp + 64 * line, _MM_HINT_T0);
          for (int v = 0; v < 8; ++v) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 8 * v));
            const __m256i wl = _mm256_and_si256(wv, nib);
            const __m256i wh = _mm256_and_si256(_mm256_srli_epi32(wv, 4), nib);
            acc16[s][v] = _mm256_add_epi16(
                acc16[s][v], _mm256_add_epi16(_mm256_maddubs_epi16(wl, xlo), _mm256_maddubs_epi16(wh, xhi)));
          }
        }
      }
      const __m256 sx = _mm256_set1_ps(xs[b]);
      for (int s = 0; s < S; ++s)
        for (int v = 0; v < 8; ++v)
          _mm256_store_ps(acc[s] + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc16[s][v], ones)),
                                                          sx, _mm256_load_ps(acc[s] + 8 * v)));
    }
    const __m256 xsum = _mm256_set1_ps(a.xsum[m * groups + g]);
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < 8; ++v) {
        const __m256 sv = _mm256_loadu_ps(sc[s] + g * kBlockN + 8 * v);
        int64_t z8;
        std::memcpy(&z8, zz[s] + g * kBlockN + 8 * v, 8);
        const __m256 z = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8))),
                                       _mm256_set1_ps(16.0f));
        const __m256 t = _mm256_fnmadd_ps(z, xsum, _mm256_load_ps(acc[s] + 8 * v));
        _mm256_store_ps(y[s] + 8 * v, _mm256_fmadd_ps(sv, t, _mm256_load_ps(y[s] + 8 * v)));
      }
  }

  for (int s = 0; s < S; ++s) {
    const int64_t n0 = (nb + s) * kBlockN, cols = std::clamp<int64_t>(a.n - n0, 0, kBlockN);
    store_row(a, m, n0, cols, y[s]);
  }
}

template <int OB>
void gemm_blocks_i8_ob(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  int64_t nb = b0;
  for (; nb + 2 <= b1; nb += 2)
    for (int64_t m = m0; m < m1; ++m) blocks_i8<OB, 2>(a, nb, m);
  for (; nb < b1; ++nb)
    for (int64_t m = m0; m < m1; ++m) blocks_i8<OB, 1>(a, nb, m);
}

void gemm_blocks_i8(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  if (a.xq_block == 32) {
    gemm_blocks_i8_ob<4>(a, b0, b1, m0, m1);
  } else if (a.xq_block == 16) {
    gemm_blocks_i8_ob<2>(a, b0, b1, m0, m1);
  } else {
    gemm_blocks_i8_ob<1>(a, b0, b1, m0, m1);
  }
}

}  // namespace

BlockKernel kernel_avx2_int8() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &gemm_blocks_i8 : nullptr;
}

BlockKernel kernel_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &gemm_blocks<Avx2Fp32> : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx2() { return nullptr; }
BlockKernel kernel_avx2_int8() { return nullptr; }
}  // namespace fastawq::cpu

#endif
