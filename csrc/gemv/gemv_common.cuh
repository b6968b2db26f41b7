// What the two decode kernels of this folder share (awq_gemv.cu on the AWQ layout, awq_gemv_packed.cu
// on the repacked one): the streaming 16-byte weight load, the exact nibble decode, and the tail that
// sums a column tile over its warps and writes it, directly or through the split-K workspace.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/ptx.cuh"

namespace fastawq {
namespace gemv {

// launch(T{}) with T the CUDA type of `dtype`: the host side of a kernel file's static dtype switch.
template <typename F>
void by_dtype(HalfType dtype, F&& launch) {
  if (dtype == HalfType::kHalf) {
    launch(__half{});
  } else {
    launch(__nv_bfloat16{});
  }
}

// Weights are read once per call: skip L1 and let L2 evict them first, so activations and
// partial sums keep their place.
__device__ __forceinline__ uint4 load_stream(const void* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// The same, 8 bytes (the MoE decode ring's lanes hold 2 words of a row).
__device__ __forceinline__ uint2 load_stream2(const void* p, uint64_t policy) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;\n"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p), "l"(policy));
  return v;
}

// f[c] = 0.5 + b_c / 256 for the 4 bytes b_c (each < 16) of a masked word: the byte permute
// drops byte c into bits 16..19 of 0.5f (0x3F000000), one instruction and exact.
__device__ __forceinline__ void decode_bytes(uint32_t v, float (&f)[4]) {
  constexpr uint32_t kHalf = 0x3F000000u;
  f[0] = __uint_as_float(__byte_perm(v, kHalf, 0x7044));
  f[1] = __uint_as_float(__byte_perm(v, kHalf, 0x7144));
  f[2] = __uint_as_float(__byte_perm(v, kHalf, 0x7244));
  f[3] = __uint_as_float(__byte_perm(v, kHalf, 0x7344));
}

// Where lane (g, t) of a warp keeps, within the warp's 512 bytes of a shared-memory ring slot, the 16
// bytes it copies from the packed layout (row 4s + t, chunk c4 + g): the layout's row order, row t at
// 128 t and chunk g at (g + 2t) mod 8 in it, so each 128-byte line of the copy lands in one 128-byte
// row and the lanes' 16-byte loads back (8 a wavefront: g in {2q, 2q + 1}, t in 0..3) meet 8 distinct
// bank groups. Lane order (16 lane) scatters each line over 8 places 64 bytes apart: a shared
// wavefront a lane for the cp.async (session 35, awq_wgmma_packed_sm90.cu).
__device__ __forceinline__ uint32_t row_order_offset(int g, int t) { return t * 128 + ((g + 2 * t) & 7) * 16; }

// The mma A register of the tensor-core kernels (awq_mma_packed.cu, moe/moe_mma.cuh): (magic + the
// low nibble of byte B of lo, magic + that of hi) in x's dtype, exact. With hi = lo >> 4 it is the
// two nibbles of one byte; with two rows' words, one nibble of each.
template <typename T, int B>
__device__ __forceinline__ uint32_t column_pair(uint32_t lo, uint32_t hi) {
  constexpr uint32_t kSel = B | (B << 4) | ((4 + B) << 8) | ((4 + B) << 12);
  return and_or(__byte_perm(lo, hi, kSel), 0x000F000Fu, HalfTraits<T>::kMagic2);
}

// A column_pair register dequantized in x's dtype: (magic + q - (magic + z)) * s, the subtraction
// exact, the product rounded as dequantize-then-matmul rounds it (awq_gemm_packed.cu's B registers,
// awq_wgmma_packed_sm90.cu's A registers).
template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t magic_q, typename HalfTraits<T>::T2 zm,
                                                 typename HalfTraits<T>::T2 s) {
  using T2 = typename HalfTraits<T>::T2;
  const T2 w = __hmul2(__hsub2(*reinterpret_cast<const T2*>(&magic_q), zm), s);
  return *reinterpret_cast<const uint32_t*>(&w);
}

// The half2 GEMV forms (awq_gemv_packed.cu consume_h2, moe/moe_gemv.cu block_gemv_h2) turn a
// packed word's 8 nibbles into 4 pairs of (magic + q / 16) in x's dtype: w & 0x000F000F holds
// nibbles 0 and 4, and so on, shifted by 4, 8 and 12 (what the pairs are, rows or columns, is the
// layout's). fp16 takes nibbles 1 and 5 in place, bits 4..7, under magic 4 (mantissa unit 1/256),
// the even ones under magic 64 (unit 1/16); bf16's 7-bit mantissa holds only a low nibble, so it
// shifts all four, under magic 8 (unit 1/16). The bases are the magics' values.
template <typename T>
struct H2Magic;
template <>
struct H2Magic<__half> {
  static constexpr uint32_t kEven = 0x54005400u, kOdd = 0x44004400u;
  static constexpr float kEvenBase = 64.f, kOddBase = 4.f;
};
template <>
struct H2Magic<__nv_bfloat16> {
  static constexpr uint32_t kEven = 0x41004100u, kOdd = 0x41004100u;
  static constexpr float kEvenBase = 8.f, kOddBase = 8.f;
};

// Whether a decode GEMV may take its half2 form for x's dtype T: FASTAWQ_GEMV_H2=0 keeps the fp32
// sums everywhere, =fp16 uses half2 for fp16 only (A/B switches, read once; host code).
inline int h2_mode() {
  static const int mode = [] {  // 0 off, 1 fp16 only, 2 both
    const char* v = std::getenv("FASTAWQ_GEMV_H2");
    if (v == nullptr) return 2;
    const std::string s(v);
    return s == "0" ? 0 : (s == "fp16" ? 1 : 2);
  }();
  return mode;
}
template <typename T>
bool h2_enabled() {
  return h2_mode() == 2 || (h2_mode() == 1 && std::is_same_v<T, __half>);
}

// r[p] = the bits of pair p (nibbles p and p + 4 of w) as (magic + q / 16), p = 0 and 2 under the
// even magic, 1 and 3 under the odd one.
template <typename T>
__device__ __forceinline__ void word_pairs(uint32_t w, uint32_t (&r)[4]) {
  using Mg = H2Magic<T>;
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t w8 = w >> 8;
    r[0] = and_or(w, 0x000F000Fu, Mg::kEven), r[1] = and_or(w, 0x00F000F0u, Mg::kOdd);
    r[2] = and_or(w8, 0x000F000Fu, Mg::kEven), r[3] = and_or(w8, 0x00F000F0u, Mg::kOdd);
  } else {
    r[0] = and_or(w, 0x000F000Fu, Mg::kEven), r[1] = and_or(w >> 4, 0x000F000Fu, Mg::kOdd);
    r[2] = and_or(w >> 8, 0x000F000Fu, Mg::kEven), r[3] = and_or(w >> 12, 0x000F000Fu, Mg::kOdd);
  }
}

// The unit by which a tensor-core kernel holds a group's folded sums (y / s, moe/moe_mma.cu): a
// zero scale would give inf / NaN. 2^-60 in place of any |s| < 2^-60 (zero,
// or bf16's tiny ones) changes the output by at most 2^-59 |sum x (q - z)|, far below fp16 / bf16
// resolution, and bounds |y / s| by 2^60 |y|, far from fp32's overflow (2^128) for any |y| < 2^68
// (fp16 outputs are < 2^16).
__device__ __forceinline__ float fold_unit(float s) { return fabsf(s) < 0x1p-60f ? 0x1p-60f : s; }

// red[w][m][c] holds warp w's sums (in units of `unit`: 1/256 for decode_bytes) for row m < rows
// (<= M) and column col0 + c; the caller has filled it and synchronised the block. Sum the warps
// and write out = unit * sum + bias, or with split K (gridDim.y > 1) add into the zeroed fp32
// workspace [rows, n]: the last block of the column tile to arrive converts the sums and zeroes
// them again (graph-safe, no extra launch). kSums: add unit * sum (split 0 also the bias) into
// sums [rows, n] fp32, which an earlier kernel zeroed, and return (awq_gemv_packed_sums): no
// workspace, arrival or conversion.
template <typename T, int M, int kThreads, int kWarps, int kTileCols, bool kSums = false>
__device__ __forceinline__ void store_tile(const float (&red)[kWarps][M][kTileCols], int& is_last,
                                           const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ ws,
                                           int* __restrict__ counters, int n, int col0, int rows = M,
                                           float unit = 256.f, float* __restrict__ sums = nullptr) {
  using Tr = HalfTraits<T>;
  const auto write = [&](int mm, int col, float v) {
    const float b = bias != nullptr ? Tr::to_float(bias[col]) : 0.f;
    out[static_cast<int64_t>(mm) * n + col] = Tr::from_float(fmaf(unit, v, b));
  };
  const bool split = gridDim.y > 1;
  for (int e = threadIdx.x; e < M * kTileCols; e += kThreads) {
    const int mm = e / kTileCols, tc = e % kTileCols, col = col0 + tc;
    if (col >= n || mm >= rows) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][mm][tc];
    if constexpr (kSums) {
      const float b = bias != nullptr && blockIdx.y == 0 ? Tr::to_float(bias[col]) : 0.f;
      atomicAdd(sums + static_cast<int64_t>(mm) * n + col, fmaf(unit, v, b));
    } else if (split) {
      atomicAdd(ws + static_cast<int64_t>(mm) * n + col, v);
    } else {
      write(mm, col, v);
    }
  }
  if constexpr (kSums) return;
  if (!split) return;

  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counters + blockIdx.x, 1);
    is_last = prev == static_cast<int>(gridDim.y) - 1;
    if (is_last) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int e = threadIdx.x; e < M * kTileCols; e += kThreads) {
    const int mm = e / kTileCols, col = col0 + e % kTileCols;
    if (col >= n || mm >= rows) continue;
    float* p = ws + static_cast<int64_t>(mm) * n + col;
    const float v = __ldcg(p);
    __stcg(p, 0.f);
    write(mm, col, v);
  }
}

// The end of split K for the tensor-core GEMMs (awq_gemm_packed.cu, awq_wgmma_packed_sm90.cu), called
// by every thread of a block after its 16-byte reductions of a tile into the zeroed fp32 workspace
// ws [M, N]: the tile's rows row0 .. row0 + rows - 1 (below m) and 4-column chunks c4_0 .. c4_0 +
// quads - 1 (below n / 4). The last of the grid's z blocks of the tile to arrive (counted at
// counters[blockIdx.y * gridDim.x + blockIdx.x], reset to 0 by it) converts the sums with
// store4(at, c4, {4 sums}) and zeroes them again; the others return. kFenceAll: each thread fences
// its own reductions before the barrier; otherwise one fence a block, in the thread that counts
// after it (the barrier orders the block's reductions before that fence, and the fence is cumulative).
template <bool kFenceAll, int kBlockThreads, typename Store>
__device__ __forceinline__ void convert_when_last(float* ws, int* counters, int& is_last, int row0, int rows, int m,
                                                  int c4_0, int quads, int n, Store&& store4) {
  if constexpr (kFenceAll) __threadfence();
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) {
    if constexpr (!kFenceAll) __threadfence();
    const int prev = atomicAdd(counters + tile, 1);
    is_last = prev == static_cast<int>(gridDim.z) - 1;
    if (is_last) counters[tile] = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int n4 = n >> 2;
  for (int e = threadIdx.x; e < rows * quads; e += kBlockThreads) {
    const int row = row0 + e / quads, c4o = c4_0 + e % quads;
    if (row >= m || c4o >= n4) continue;
    const int64_t at = static_cast<int64_t>(row) * n + 4 * c4o;
    float4* p = reinterpret_cast<float4*>(ws + at);
    const float4 v = __ldcg(p);
    __stcg(p, make_float4(0.f, 0.f, 0.f, 0.f));
    store4(at, c4o, {v.x, v.y, v.z, v.w});
  }
}

}  // namespace gemv
}  // namespace fastawq
