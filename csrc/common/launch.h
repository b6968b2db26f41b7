// Launchers the .cu files export to the host .cpp files. Plain pointers and a stream only, so the
// CUDA sources include no torch headers (they would dominate nvcc's compile time).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace fastawq {

enum class HalfType : int { kHalf = 0, kBFloat16 = 1 };

// w [K, N] = (q - z) * s from qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8].
void launch_awq_dequantize(HalfType dtype, const uint32_t* qweight, const void* scales, const uint32_t* qzeros,
                           void* out, int k, int n8, int group_size, int max_blocks, cudaStream_t stream);

// Tile of the tensor-core kernel: warps_n * 32 output columns (4 or 8 warps side by side in N)
// x 32 rows of K per stage.
constexpr int kMmaBlockK = 32;

// Rows of M per block for a given M (the kernel instance the launcher will pick).
inline int mma_block_m(int m) { return m <= 16 ? 16 : (m <= 32 ? 32 : 64); }

struct MmaArgs {
  HalfType dtype;
  const void* x;            // [M, K]
  const uint32_t* qweight;  // [K, N/8]
  const void* scales;       // [K/G, N]
  const uint32_t* qzeros;   // [K/G, N/8]
  const void* bias;         // [N] or nullptr
  void* out;                // [M, N]
  float* workspace;         // [splits, M, N] fp32 when splits > 1
  int* counters;            // zeroed, one per (M block, N block) tile, when splits > 1
  int m, n, k, group_size;
  int splits, tiles_per_split;
  int warps_n;              // 4 or 8
  bool tiled;               // qweight in the awq_repack_tiled layout (then warps_n must be 4)
  int ksub;                 // 32-row tiles per pipeline stage: 1, or 4 (then warps_n 4, not tiled)
};

void launch_awq_gemm_mma(const MmaArgs& args, cudaStream_t stream);

// CUDA-core kernel for decode (csrc/gemv/awq_gemv.cu): 1 <= M <= kGemvMaxM.
constexpr int kGemvMaxM = 8;
constexpr int kGemvThreads = 128;
// Packed words per lane: fewer columns per lane as M grows keeps the accumulators in registers.
constexpr int gemv_words_per_lane(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }
// Columns of one block (8 lanes side by side).
constexpr int gemv_tile_cols(int m) { return 64 * gemv_words_per_lane(m); }

struct GemvArgs {
  HalfType dtype;
  const void* x;            // [M, K]
  const uint32_t* qweight;  // [K, N/8], rows 16-byte aligned
  const void* scales;       // [K/G, N]
  const uint32_t* qzeros;   // [K/G, N/8]
  const void* bias;         // [N] or nullptr
  void* out;                // [M, N]
  float* workspace;         // [M, N] fp32, zeroed (the kernel leaves it zeroed), when splits > 1
  int* counters;            // zeroed, one per column tile, when splits > 1
  int m, n, k, group_size;
  int col_tiles, splits;    // grid
  int chunk_rows;           // rows of K per warp item: 32, 64 or 128
  int chunks_per_block;
  bool pipelined;           // prefetch the next batch before computing the current one (M = 1)
  int stages;               // 3 or 4: the cp.async-staged kernel (M <= 2); 0: the register kernel
};

void launch_awq_gemv(const GemvArgs& args, cudaStream_t stream);

}  // namespace fastawq
