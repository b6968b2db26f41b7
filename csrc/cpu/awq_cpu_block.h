// The block loop shared by the exact CPU kernels (awq_cpu_avx2.cpp, awq_cpu_avx512.cpp,
// awq_cpu_avx512bf16.cpp): per group, accumulate x * (1 + q/16) over its octets of K with the
// ISA's `octet` step, then fold offset, zero point and scale in one FMA per group:
//   y += s * (16 * sum_k x w' - (16 + z) * sum_k x)          (layout: awq_cpu_kernels.h)
// and store the block's columns. Include it only from an ISA file, after its intrinsics: the
// templates sit in an unnamed namespace, so each file compiles its own copy with its own flags.
//
// The ISA type I provides: V (a vector of kLanes fp32), X (x's element type), kMaxRows (rows per
// call), kSets<MR> (independent accumulator sets), zero / set1 / load / add / mul / fmadd /
// fmsub on V, zeros16 (kLanes uint8 -> V), octet<MR> (one octet of K into acc) and store (row's
// 4 * kLanes columns from n0, `valid` of them real, plus bias, in the output dtype). The vector
// halves (Avx512Vec, Avx2Vec) are here, under the ISA macros of the file that includes this.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cpu/awq_cpu_kernels.h"

namespace fastawq::cpu {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The vector half of an ISA type for the AVX-512 kernels (16 fp32 lanes).
struct Avx512Vec {
  using V = __m512;
  using Vi = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fmsub(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
  static V zeros16(const uint8_t* z) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z))));
  }
  static void load_w(const uint32_t* wo, __m512i (&wv)[4]) {
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(wo + 16 * v);
  }
  // Masked stores of the valid columns (+ bias); bf16 output rounded by `round`.
  template <class Round>
  static void store(const GemmArgs& a, int64_t row, int64_t n0, int64_t valid, const V (&y)[4], Round round) {
    for (int v = 0; v < 4; ++v) {
      const int64_t cols = std::clamp<int64_t>(valid - 16 * v, 0, 16);
      if (cols == 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
      const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0 + 16 * v) : _mm512_setzero_ps();
      const __m512 out = _mm512_add_ps(y[v], bias);
      if (a.out_dtype == Dtype::kFloat32) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.out) + row * a.out_stride + n0 + 16 * v, mask, out);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + row * a.out_stride + n0 + 16 * v, mask, round(out));
      }
    }
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The vector half of an ISA type for the AVX2 kernel (8 fp32 lanes, 32-column parts).
struct Avx2Vec {
  using V = __m256;
  using Vi = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fmsub(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); }
  static V zeros16(const uint8_t* z) {
    int64_t z8;
    std::memcpy(&z8, z, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(z8)));
  }
  static void load_w(const uint32_t* wo, Vi (&wv)[4]) {
    for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 8 * v));
  }
  static void store(const GemmArgs& a, int64_t row, int64_t n0, int64_t valid, const V (&y)[4]) {
    alignas(32) float buf[32];
    for (int v = 0; v < 4; ++v) _mm256_store_ps(buf + 8 * v, y[v]);
    store_row(a, row, n0, valid, buf);
  }
};
#endif

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}).
template <int N, class F>
inline void unroll(F&& f) {
  [&]<int... P>(std::integer_sequence<int, P...>) { (f(std::integral_constant<int, P>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

// The fp32-activation octet step of the AVX2 and AVX-512 kernels: per K row, the nibble vectors
// turned into 1 + q/16 by D::dequant<P> (the ISA's own shift-and-mask), one FMA with x[row].
template <class Vec, class D>
struct Fp32Octet : Vec {
  using X = float;
  using V = typename Vec::V;
  template <int MR>
  static constexpr int kSets = 1;
  template <int MR>
  static void octet(const uint32_t* wo, const float* const (&x)[MR], int64_t k0, V (&acc)[1][MR][4]) {
    typename Vec::Vi wv[4];
    Vec::load_w(wo, wv);
    unroll<kStepK>([&](auto p) {
      constexpr int P = decltype(p)::value;
      V wf[4];
      for (int v = 0; v < 4; ++v) wf[v] = D::template dequant<P>(wv[v]);
      for (int r = 0; r < MR; ++r) {
        const V xb = Vec::set1(x[r][k0 + kRowOfNibble[P]]);
        for (int v = 0; v < 4; ++v) acc[0][r][v] = Vec::fmadd(xb, wf[v], acc[0][r][v]);
      }
    });
  }
};

// Columns [c0, c0 + 4 * I::kLanes) of block nb, rows m0 .. m0 + MR.
template <class I, int MR>
void block_part(const GemmArgs& a, int64_t nb, int c0, int64_t m0) {
  using V = typename I::V;
  constexpr int L = I::kLanes, S = I::template kSets<MR>;
  const int64_t groups = a.k / a.group, octets = a.group / kStepK;
  const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN + c0;
  const float* sc = a.scales + nb * groups * kBlockN + c0;
  const uint8_t* zz = a.zeros16 + nb * groups * kBlockN + c0;
  const typename I::X* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const typename I::X*>(a.x) + (m0 + r) * a.x_stride;
  V y[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) y[r][v] = I::zero();
  const V sixteen = I::set1(16.0f);

  for (int64_t g = 0; g < groups; ++g) {
    V acc[S][MR][4];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < 4; ++v) acc[s][r][v] = I::zero();
    for (int64_t o = g * octets; o < (g + 1) * octets; ++o) I::template octet<MR>(w + o * kBlockN, x, o * kStepK, acc);
    for (int v = 0; v < 4; ++v) {
      const V s = I::load(sc + g * kBlockN + L * v);
      const V z16 = I::zeros16(zz + g * kBlockN + L * v);
      for (int r = 0; r < MR; ++r) {
        V sum = acc[0][r][v];
        for (int i = 1; i < S; ++i) sum = I::add(sum, acc[i][r][v]);
        const V t = I::fmsub(sum, sixteen, I::mul(z16, I::set1(a.xsum[(m0 + r) * groups + g])));
        y[r][v] = I::fmadd(s, t, y[r][v]);
      }
    }
  }

  const int64_t n0 = nb * kBlockN + c0, valid = std::clamp<int64_t>(a.n - n0, 0, 4 * L);
  for (int r = 0; r < MR; ++r) I::store(a, m0 + r, n0, valid, y[r]);
}

// BlockKernel: column blocks [b0, b1), rows [m0, m1), in parts of 4 * kLanes columns and runs of
// up to kMaxRows rows (each weight vector then serves that many rows).
template <class I>
void gemm_blocks(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  constexpr int part = 4 * I::kLanes;
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int c0 = 0; c0 < kBlockN && nb * kBlockN + c0 < a.n; c0 += part) {
      for (int64_t m = m0; m < m1;) {
        switch (std::min<int64_t>(m1 - m, I::kMaxRows)) {
          case 4: block_part<I, std::min(4, I::kMaxRows)>(a, nb, c0, m); m += std::min(4, I::kMaxRows); break;
          case 3: block_part<I, std::min(3, I::kMaxRows)>(a, nb, c0, m); m += std::min(3, I::kMaxRows); break;
          case 2: block_part<I, 2>(a, nb, c0, m); m += 2; break;
          default: block_part<I, 1>(a, nb, c0, m); m += 1; break;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fastawq::cpu
