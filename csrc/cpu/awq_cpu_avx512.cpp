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

namespace fastawq::cpu {
namespace {

// Nibble P of every lane moved to bits 19..22 (the top of an fp32 mantissa) and ORed into 1.0.
template <int P>
inline __m512 dequant(__m512i w) {
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

template <int MR, int P>
inline void step(const __m512i (&w)[4], const float* const (&x)[MR], int64_t k0, __m512 (&acc)[MR][4]) {
  __m512 wf[4];
  for (int v = 0; v < 4; ++v) wf[v] = dequant<P>(w[v]);
  for (int r = 0; r < MR; ++r) {
    const __m512 xb = _mm512_set1_ps(x[r][k0 + kRowOfNibble[P]]);
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wf[v], acc[r][v]);
  }
}

inline __m256i to_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

template <int MR>
void block(const GemmArgs& a, int64_t nb, int64_t m0) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK;
  const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN;
  const float* sc = a.scales + nb * groups * kBlockN;
  const uint8_t* zz = a.zeros16 + nb * groups * kBlockN;
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const float*>(a.x) + (m0 + r) * a.x_stride;
  __m512 y[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) y[r][v] = _mm512_setzero_ps();
  const __m512 sixteen = _mm512_set1_ps(16.0f);

  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t o = g * octets; o < (g + 1) * octets; ++o) {
      const uint32_t* wo = w + o * kBlockN;
      const __m512i wv[4] = {_mm512_loadu_si512(wo), _mm512_loadu_si512(wo + 16), _mm512_loadu_si512(wo + 32),
                             _mm512_loadu_si512(wo + 48)};
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
      const __m512 s = _mm512_loadu_ps(sc + g * kBlockN + 16 * v);
      const __m512 z16 = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zz + g * kBlockN + 16 * v))));
      for (int r = 0; r < MR; ++r) {
        const __m512 t = _mm512_fmsub_ps(acc[r][v], sixteen, _mm512_mul_ps(z16, _mm512_set1_ps(a.xsum[(m0 + r) * groups + g])));
        y[r][v] = _mm512_fmadd_ps(s, t, y[r][v]);
      }
    }
  }

  const int64_t n0 = nb * kBlockN, valid = std::min<int64_t>(kBlockN, a.n - n0);
  for (int v = 0; v < 4; ++v) {
    const int64_t cols = std::clamp<int64_t>(valid - 16 * v, 0, 16);
    if (cols == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 out = _mm512_add_ps(y[r][v], bias);
      if (a.out_dtype == Dtype::kFloat32) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.out) + (m0 + r) * a.out_stride + n0 + 16 * v, mask, out);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + (m0 + r) * a.out_stride + n0 + 16 * v, mask,
                                 to_bf16(out));
      }
    }
  }
}

void gemm_blocks(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int64_t m = m0; m < m1;) {
      switch (std::min<int64_t>(m1 - m, 4)) {
        case 4: block<4>(a, nb, m); m += 4; break;
        case 3: block<3>(a, nb, m); m += 3; break;
        case 2: block<2>(a, nb, m); m += 2; break;
        default: block<1>(a, nb, m); m += 1; break;
      }
    }
  }
}

}  // namespace

BlockKernel kernel_avx512() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return ok ? &gemm_blocks : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx512() { return nullptr; }
}  // namespace fastawq::cpu

#endif
