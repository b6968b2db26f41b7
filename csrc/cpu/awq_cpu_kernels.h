// The CPU W4 GEMM's packed layout and its per-ISA kernels. Plain C++ on raw pointers, no torch
// headers: the ISA files are compiled with -mavx512* / -mavx2 and must not instantiate torch's
// inline functions (an AVX-512 copy of one could be picked by the linker for the whole module).
#pragma once

#include <cstdint>

namespace fastawq::cpu {

// Output columns per block: four 16-lane (or eight 8-lane) vectors, one cache line of nibbles
// per 8 rows of K per vector.
constexpr int kBlockN = 64;
// K rows per packed word: each column's 8 nibbles of one K octet share a 32-bit lane.
constexpr int kStepK = 8;

// Packed layout, built once by awq_cpu_repack from the AWQ GEMM layout:
//   w        [NB][K/8][64] uint32   lane = column n % 64 of block n / 64; nibble p (bits 4p..4p+3)
//                                   holds row 8*o + kRowOfNibble[p] of octet o
//   scales   [NB][K/G][64] fp32     s[g, n], 0 past N
//   zeros16  [NB][K/G][64] uint8    16 + z[g, n]
// The row order puts rows (2j, 2j+1) in bits 4j and 16+4j, so one shift and one mask give a pair
// of bf16 values in each 32-bit lane (vdpbf16ps's operand) and one shift and one mask give a
// single fp32 value. Either way the nibble q lands in the top mantissa bits of 1.0: the kernels
// compute with w' = 1 + q/16, exact in bf16 and fp32, and fold the offset back per group:
//   sum_k x (q - z) s = s * (16 * sum_k x w' - (16 + z) * sum_k x).
constexpr int kRowOfNibble[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int kNibbleOfRow[8] = {0, 4, 1, 5, 2, 6, 3, 7};

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1 };

struct GemmArgs {
  int64_t m, k, n, group;        // N real columns; group divides K and is a multiple of 8
  const uint32_t* w;
  const float* scales;
  const uint8_t* zeros16;
  const float* bias;             // [N] or nullptr
  const void* x;                 // [M, K] rows x_stride elements apart, unit stride along K
  int64_t x_stride;
  Dtype x_dtype;
  const float* xsum;             // [M, K/G]: per-group sums of x as the kernel reads it
  void* out;                     // [M, N] rows out_stride elements apart
  int64_t out_stride;
  Dtype out_dtype;
  // int8-activation kernels only (else nullptr / 0): x quantized per block of xq_block rows of K
  // (8, 16 or 32, dividing group) to int8 with one fp32 scale each, x ~= xq * xq_scale. Row r of
  // each octet of K is stored at byte kRowOfNibble[r] of the octet: bytes 0..3 hold rows
  // 0, 4, 1, 5, which (w & 0x0f0f0f0f) holds in its four bytes, and bytes 4..7 rows 2, 6, 3, 7,
  // those of ((w >> 4) & 0x0f0f0f0f). xsum then holds the per-group sums of xq * xq_scale.
  const int8_t* xq;              // [M, K] contiguous
  const float* xq_scale;         // [M, K / xq_block]
  int64_t xq_block;
};

// Computes blocks [b0, b1) of the output columns for rows [m0, m1).
using BlockKernel = void (*)(const GemmArgs&, int64_t b0, int64_t b1, int64_t m0, int64_t m1);

// Each returns nullptr when it was not compiled in (non-x86 build) or the CPU lacks its ISA.
// avx512bf16 takes bf16 x (vdpbf16ps); avx512 and avx2 take fp32 x; scalar takes both; avx2_int8
// takes xq.
BlockKernel kernel_avx512bf16();
BlockKernel kernel_avx512();
BlockKernel kernel_avx2();
// int8 activations (GemmArgs::xq): vpmaddubsw dots of the nibbles with xq, exact int16/int32
// sums per block of K, fp32 across blocks. Not exact with respect to x: see awq_cpu_ops.h.
BlockKernel kernel_avx2_int8();
void gemm_blocks_scalar(const GemmArgs&, int64_t b0, int64_t b1, int64_t m0, int64_t m1);

// Round-to-nearest-even fp32 -> bf16 bits (NaN stays a quiet NaN), as c10::BFloat16 does.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// y[0 .. cols) (+ bias) into row m, columns n0 .. n0 + cols of the output, in its dtype. static:
// each ISA file keeps its own copy (a shared inline one could be linked from an AVX-512 file).
static inline void store_row(const GemmArgs& a, int64_t m, int64_t n0, int64_t cols, const float* y) {
  for (int64_t c = 0; c < cols; ++c) {
    const float out = y[c] + (a.bias ? a.bias[n0 + c] : 0.0f);
    if (a.out_dtype == Dtype::kFloat32) {
      static_cast<float*>(a.out)[m * a.out_stride + n0 + c] = out;
    } else {
      static_cast<uint16_t*>(a.out)[m * a.out_stride + n0 + c] = bf16_bits(out);
    }
  }
}

}  // namespace fastawq::cpu
