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

// Tensor-core kernel (csrc/gemm/awq_gemm_mma_sm80.cu): 4 warps side by side in N on a 128-column
// tile, 4 x 32 rows of K per cp.async stage (one barrier per 128 rows: the per-stage cost
// dominated at 32-row stages, benchmarks/CUDA_NOTES.md).
constexpr int kMmaBlockK = 32;
constexpr int kMmaBlockN = 128;

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
};

void launch_awq_gemm_mma(const MmaArgs& args, cudaStream_t stream);

// CUDA-core kernels for decode (csrc/gemv/awq_gemv.cu): 1 <= M <= kGemvMaxM (the M at which
// they beat the tensor-core kernel: benchmarks/RESULTS.md).
constexpr int kGemvMaxM = 2;
constexpr int kGemvThreads = 128;
// Packed words per lane (16-byte loads); a block's tile is 8 lanes side by side.
constexpr int kGemvWordsPerLane = 4;
constexpr int kGemvTileCols = 64 * kGemvWordsPerLane;

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
  bool staged;              // loads through 3 cp.async stages in shared memory ("gemv_staged")
};

void launch_awq_gemv(const GemvArgs& args, cudaStream_t stream);

}  // namespace fastawq
