// AVX-512 W4 GEMM for fp32 activations (CMake compiles this file with -mavx512f -mavx512bw
// -mavx512vl -mfma; the module calls it only after a run-time CPU check).
//
// Per K row and 16 columns: one shift and one vpternlogd turn the nibbles into fp32 1 + q/16
// (no int->float conversion), one FMA accumulates. Products are the exact fp32 products of an
// FMA chain, so fp32 activations keep fp32 accuracy.
#include "cpu/awq_cpu_kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>

#include "cpu/awq_cpu_block.h"

namespace fastawq::cpu {
namespace {

inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// fp32 x: nibble P of every lane moved to bits 19..22 (the top of an fp32 mantissa) and ORed
// into 1.0 by one vpternlogd.
struct Avx512Fp32 : Fp32Octet<Avx512Vec, Avx512Fp32> {
  template <int P>
  static __m512 dequant(__m512i w) {
    constexpr int s = 19 - 4 * P;
    __m512i t;
    if constexpr (s >= 0) {
      t = _mm512_slli_epi32(w, s);
    } else {
      t = _mm512_srli_epi32(w, -s);
    }
    // (t & mask) | one: ternary-logic table 0xEA.
    return _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(t, _mm512_set1_epi32(0x00780000), _mm512_set1_epi32(0x3f800000), 0xEA));
  }
  static void store(const GemmArgs& a, int64_t row, int64_t n0, int64_t valid, const V (&y)[4]) {
    Avx512Vec::store(a, row, n0, valid, y, &to_bf16);
  }
};

}  // namespace

BlockKernel kernel_avx512() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return ok ? &gemm_blocks<Avx512Fp32> : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx512() { return nullptr; }
}  // namespace fastawq::cpu

#endif
