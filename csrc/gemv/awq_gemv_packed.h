// Launchers of the kernels on the repacked layout (csrc/gemv/awq_gemv_packed.cu on the CUDA cores,
// csrc/gemv/awq_mma_packed.cu on the tensor cores), shared with their host entries
// (awq_gemv_packed.cpp). Plain pointers only: the .cu files include no torch headers.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/launch.h"

namespace fastawq {

// Layout (python/fastawq/ops/repack.py is the one writer and reader):
//   wpacked  [K/8, N] int32: the 16 bytes at (kb, 4*c4 .. 4*c4+3) hold rows 8kb..8kb+7 of columns
//            4c4..4c4+3; word j holds rows 8kb+2j (even nibbles) and 8kb+2j+1 (odd nibbles), the
//            nibble pair of column c at bits 8c..8c+7.
//   szpacked [K/G, 2N] (x's dtype): (scale, zero) of column n at (g, 2n), (g, 2n+1), so the 16
//            bytes at (g, 8*c4) are the group's pairs for one lane's 4 columns.
constexpr int kPackedMaxM = 8;
constexpr int kPackedThreads = 128;   // 4 warps on one column tile, each on its own range of K
constexpr int kPackedTileCols = 128;  // 32 lanes x 4 columns
constexpr int kPackedBatchRows = 32;  // 4 16-byte loads per lane per batch

// The arguments of both kernels (the tensor-core one adds its tile width).
struct PackedArgs {
  HalfType dtype;
  const void* x;           // [M, K], 16-byte aligned, K % 32 == 0
  const uint32_t* w;       // wpacked [K/8, N]
  const void* sz;          // szpacked [K/G, 2N]
  const void* bias;        // [N] or nullptr
  void* out;               // [M, N]
  float* workspace;        // [M, N] fp32, zeroed (left zeroed), when splits > 1
  int* counters;           // zeroed, one per column tile, when splits > 1
  int m, n, k, group_size;
  int col_tiles, splits;   // grid
  int steps_per_warp;      // 32-row steps ("batches") of K per warp
  // awq_gemv_packed_act (M <= kPackedActMaxM): x is gate_up [M, 2K] and the GEMV's input is
  // act(gate) * up, made in each block's shared memory for its K range. 0: none, 1: silu,
  // 2: gelu (tanh), 3: gelu (erf).
  int act;
  // awq_gemv_packed_norm (M <= kPackedActMaxM, act == 0): the GEMV's input is RMSNorm(x + residual)
  // * (norm_weight + offset), made in each block's shared memory for its K range from the whole row
  // (each block sums the row's squares itself); the blocks of column tile 0 write x + residual into
  // res_out. norm_weight null: no norm.
  const void* residual;     // [M, K] or null
  const void* norm_weight;  // [K]
  void* res_out;            // [M, K], written when residual is given
  float eps, offset;
  // FASTAWQ_GEMV_EARLY_LOADS=1 (an A/B switch, read at each call): the first batch of weights is
  // loaded into registers before the PDL wait rather than after it (only prefetched into L2
  // before). Safe while no kernel that can trigger this launch early writes the weights: none does
  // (the packed layout is made by torch ops at load time).
  bool early_loads;
  // FASTAWQ_GEMV_PREFETCH (common/pdl.cuh, read at each call): batches a warp brings into L2
  // before the PDL wait (the decode GEMV).
  int prefetch_batches;
  // awq_gemv_packed_sums / _act_sums (the GEMV, M <= kPackedActMaxM): [M, N] fp32 zeroed by an
  // earlier kernel, which the blocks add their tiles into instead of writing out; else null.
  float* sums;
  // The sums forms only. zero: zero_len4 float4s (16-byte aligned) the blocks fill with zeros after
  // their PDL wait, a later projection's sums (awq_gemv_packed_sums' `zero`; else null). x_f32:
  // (_act_sums) gate_up is fp32 sums [M, 2K], rounded to the activation dtype as it is read.
  float* zero;
  int64_t zero_len4;
  bool x_f32;
};
using GemvPackedArgs = PackedArgs;
constexpr int kPackedActMaxM = 2;

void launch_awq_gemv_packed(const GemvPackedArgs& args, cudaStream_t stream);
// Blocks of the kernel instance args.m (and dtype, FASTAWQ_GEMV_H2) selects that fit on one SM.
int gemv_packed_resident_blocks(const GemvPackedArgs& args);

// The tensor-core ("swap AB") kernel: 1 <= M <= kMmaPackedMaxM, the batch in 8-row mma tiles
// (1, 2 or 4 of them), a block's tile `chunks` x 32 columns (1, 2, or 4 with fewer than 4 mma tiles).
constexpr int kMmaPackedMaxM = 32;
inline int mma_packed_tiles(int m) { return m <= 8 ? 1 : (m <= 16 ? 2 : 4); }
inline bool mma_packed_chunks_ok(int m, int chunks) {
  return chunks == 1 || chunks == 2 || (chunks == 4 && mma_packed_tiles(m) < 4);
}

struct MmaPackedArgs : PackedArgs {
  int chunks;          // 32-column chunks per block tile
  bool register_ring;  // weights staged in registers (true) or through a shared-memory cp.async ring
};

void launch_awq_mma_packed(const MmaPackedArgs& args, cudaStream_t stream);
// Blocks of the kernel args.m and args.chunks select that fit on one SM (dtype, m, chunks read).
int mma_packed_resident_blocks(const MmaPackedArgs& args);

// The tensor-core GEMM with the batch as the mma's M (csrc/gemv/awq_gemm_packed.cu), for M >= 16:
// blocks of m_tiles x 16 rows (1, 2 or 4) by chunks x 128 columns (1 or 2; 1 with 4 m-tiles), all 4
// warps of a block on one range of steps_per_warp 32-row steps (here: steps per block); grid
// (m_blocks, col_tiles, splits).
inline bool gemm_packed_tile_ok(int m_tiles, int chunks) {
  return (m_tiles == 1 || m_tiles == 2 || m_tiles == 4) && (chunks == 1 || (chunks == 2 && m_tiles < 4));
}
inline int gemm_packed_m_tiles(int64_t m) { return m <= 16 ? 1 : (m <= 32 ? 2 : 4); }

struct GemmPackedArgs : PackedArgs {
  int m_tiles;   // 16-row mma tiles per block
  int chunks;    // 128-column chunks per block tile
  int m_blocks;  // blocks along M: ceil(M / (16 m_tiles))
  // x staged once a block in the mma's A order (FASTAWQ_GEMM_STAGE_X=1, awq_gemm_packed.cu): set by
  // the host entry where steps_per_warp <= gemm_packed_stage_steps.
  bool stage_x;
};

void launch_awq_gemm_packed(const GemmPackedArgs& args, cudaStream_t stream);
// Blocks of the instance (dtype, m_tiles, chunks, stage_x) that fit on one SM.
int gemm_packed_resident_blocks(const GemmPackedArgs& args);
// The most 32-row steps a block may take in the staged-x form (args.m_tiles read), or 0 where
// FASTAWQ_GEMM_STAGE_X is not 1 (read at each call).
int gemm_packed_stage_steps(const GemmPackedArgs& args);

// The warpgroup-MMA kernel (csrc/gemv/awq_wgmma_packed_sm90.cu, sm_90a only), for M >= 17 (16-row tiles
// on request: tokens = 16, or M <= 16 with tokens = 0, which the dispatch does not send): the
// batch as the wgmma's N in tiles of `tokens` rows (16, 32, 64 or 128), a block `warpgroups` warpgroups
// (1 or 2) on 128 columns each, all on one range of steps_per_warp 32-row steps (here: steps per
// block); grid (token_tiles, col_tiles, splits).
inline int wgmma_packed_tokens(int64_t m) { return m <= 16 ? 16 : (m <= 32 ? 32 : (m <= 64 ? 64 : 128)); }
inline bool wgmma_packed_tokens_ok(int64_t tokens) {
  return tokens == 16 || tokens == 32 || tokens == 64 || tokens == 128;
}
inline int wgmma_packed_tile_cols(int warpgroups) { return 128 * warpgroups; }

struct WgmmaPackedArgs : PackedArgs {
  int tokens;       // batch rows a block
  int token_tiles;  // blocks along M: ceil(M / tokens)
  int warpgroups;   // 1 or 2 (wgmma_call in awq_gemv_packed.cpp)
  // The warp-specialized form (by default on the 128-token tile; FASTAWQ_WGMMA_FORM, read at
  // each call, forces either): two consumer warpgroups on 256 columns and a producer warp doing the
  // copies, meeting through mbarriers.
  bool ws;
  // awq_wgmma_packed_sums (the plain form unless FASTAWQ_WGMMA_FORM=ws): every block adds its partial
  // sums (the first K split with the bias) into `workspace`, the caller's zeroed fp32 [M, N], and
  // ends: no counters, no conversion pass; `out` unused.
  bool sums;
  // The plain form's K splits (2 to 8 of them) run as one cluster a tile and add their partial sums
  // through distributed shared memory (16- to 64-token tiles, plans of <= 12 splits; off with
  // FASTAWQ_WGMMA_CLUSTER=0): no workspace, fence or arrival count. False: the workspace.
  bool cluster;
};

void launch_awq_wgmma_packed(const WgmmaPackedArgs& args, cudaStream_t stream);
// Blocks of the instance (dtype, tokens) that fit on one SM.
int wgmma_packed_resident_blocks(const WgmmaPackedArgs& args);

}  // namespace fastawq
