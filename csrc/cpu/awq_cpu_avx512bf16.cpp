// AVX-512 BF16 W4 GEMM for bf16 activations (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512bf16 -mfma; called only after a run-time CPU check).
//
// Per pair of K rows and 16 columns: one shift and one vpternlogd give the bf16 pair
// (1 + q[2j]/16, 1 + q[2j+1]/16) in each 32-bit lane, and one vdpbf16ps multiplies it by the
// broadcast activation pair and accumulates in fp32. 1 + q/16 has 5 significant bits, so every
// product is exact in fp32: the result is what an fp32 accumulation of bf16 x times w gives.
#include "cpu/awq_cpu_kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu/awq_cpu_block.h"

namespace fastawq::cpu {
namespace {

// Nibbles J and 4 + J of every lane (rows 2J and 2J + 1) moved to bits 3..6 and 19..22: the top
// mantissa bits of two bf16 1.0s.
template <int J>
inline __m512i dequant_pair(__m512i w) {
  constexpr int s = 4 * J - 3;
  __m512i t;
  if constexpr (s < 0) {
    t = _mm512_slli_epi32(w, -s);
  } else {
    t = _mm512_srli_epi32(w, s);
  }
  return _mm512_ternarylogic_epi32(t, _mm512_set1_epi32(0x00780078), _mm512_set1_epi32(0x3f803f80), 0xEA);
}

// bf16 x: per pair of K rows, one vdpbf16ps with the dequantised pair vector. Two accumulator
// sets (even and odd pairs) for one or two rows: vdpbf16ps has a latency of several cycles, and
// 4 chains alone would leave the unit idle.
struct Avx512Bf16 : Avx512Vec {
  using X = uint16_t;
  template <int MR>
  static constexpr int kSets = MR <= 2 ? 2 : 1;
  template <int MR>
  static void octet(const uint32_t* wo, const uint16_t* const (&x)[MR], int64_t k0, V (&acc)[kSets<MR>][MR][4]) {
    __m512i wv[4];
    load_w(wo, wv);
    unroll<kStepK / 2>([&](auto j) { step<MR, decltype(j)::value>(wv, x, k0, acc); });
  }
  template <int MR, int J>
  static void step(const __m512i (&w)[4], const uint16_t* const (&x)[MR], int64_t k0,
                   __m512 (&acc)[kSets<MR>][MR][4]) {
    __m512i wb[4];
    for (int v = 0; v < 4; ++v) wb[v] = dequant_pair<J>(w[v]);
    constexpr int set = J % kSets<MR>;
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + k0 + 2 * J, 4);
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v)
        acc[set][r][v] = _mm512_dpbf16_ps(acc[set][r][v], (__m512bh)wb[v], (__m512bh)xb);
    }
  }
  static void store(const GemmArgs& a, int64_t row, int64_t n0, int64_t valid, const V (&y)[4]) {
    // vcvtneps2bf16 rounds to nearest even, as torch does.
    Avx512Vec::store(a, row, n0, valid, y, [](__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); });
  }
};

}  // namespace

BlockKernel kernel_avx512bf16() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
                  __builtin_cpu_supports("fma");
  return ok ? &gemm_blocks<Avx512Bf16> : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx512bf16() { return nullptr; }
}  // namespace fastawq::cpu

#endif
