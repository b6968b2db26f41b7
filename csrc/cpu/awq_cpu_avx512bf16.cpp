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

// Two accumulator sets (even and odd pairs) for one or two rows: vdpbf16ps has a latency of
// several cycles, and 4 chains alone would leave the unit idle.
template <int MR>
constexpr int kSets = MR <= 2 ? 2 : 1;

template <int MR, int J>
inline void step(const __m512i (&w)[4], const uint16_t* const (&x)[MR], int64_t k0,
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

template <int MR>
void block(const GemmArgs& a, int64_t nb, int64_t m0) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK;
  const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN;
  const float* sc = a.scales + nb * groups * kBlockN;
  const uint8_t* zz = a.zeros16 + nb * groups * kBlockN;
  const uint16_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const uint16_t*>(a.x) + (m0 + r) * a.x_stride;
  __m512 y[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) y[r][v] = _mm512_setzero_ps();
  const __m512 sixteen = _mm512_set1_ps(16.0f);
  constexpr int S = kSets<MR>;

  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[S][MR][4];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < 4; ++v) acc[s][r][v] = _mm512_setzero_ps();
    for (int64_t o = g * octets; o < (g + 1) * octets; ++o) {
      const uint32_t* wo = w + o * kBlockN;
      const __m512i wv[4] = {_mm512_loadu_si512(wo), _mm512_loadu_si512(wo + 16), _mm512_loadu_si512(wo + 32),
                             _mm512_loadu_si512(wo + 48)};
      const int64_t k0 = o * kStepK;
      step<MR, 0>(wv, x, k0, acc);
      step<MR, 1>(wv, x, k0, acc);
      step<MR, 2>(wv, x, k0, acc);
      step<MR, 3>(wv, x, k0, acc);
    }
    for (int v = 0; v < 4; ++v) {
      const __m512 s = _mm512_loadu_ps(sc + g * kBlockN + 16 * v);
      const __m512 z16 = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zz + g * kBlockN + 16 * v))));
      for (int r = 0; r < MR; ++r) {
        __m512 sum = acc[0][r][v];
        if constexpr (S == 2) sum = _mm512_add_ps(sum, acc[1][r][v]);
        const __m512 t = _mm512_fmsub_ps(sum, sixteen, _mm512_mul_ps(z16, _mm512_set1_ps(a.xsum[(m0 + r) * groups + g])));
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
        // vcvtneps2bf16 rounds to nearest even, as torch does.
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + (m0 + r) * a.out_stride + n0 + 16 * v, mask,
                                 (__m256i)_mm512_cvtneps_pbh(out));
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

BlockKernel kernel_avx512bf16() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
                  __builtin_cpu_supports("fma");
  return ok ? &gemm_blocks : nullptr;
}

}  // namespace fastawq::cpu

#else

namespace fastawq::cpu {
BlockKernel kernel_avx512bf16() { return nullptr; }
}  // namespace fastawq::cpu

#endif
