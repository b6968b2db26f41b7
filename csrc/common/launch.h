// Launchers the .cu files export to the host .cpp files. Plain pointers and a stream only, so the
// CUDA sources include no torch headers (they would dominate nvcc's compile time).
#pragma once

#include <algorithm>
#include <cstddef>
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

// The GEMV grid for `col_tiles` column tiles (of all rows of blocks together) over K = k: enough
// warp items (chunk_rows rows x one column tile) to fill the SMs at `warps_per_sm` resident
// warps, 4 warps per block, K split over blocks until the grid is about one wave (within 10 % of
// the best forced split on every Llama shape: benchmarks/CUDA_NOTES.md).
struct GemvSplit {
  int chunk_rows, chunks_per_block, splits;
};
inline GemvSplit gemv_split(int64_t col_tiles, int k, int sms, int warps_per_sm) {
  const int64_t want_warps = int64_t(sms) * warps_per_sm;
  int chunk_rows = 128;
  while (chunk_rows > 32 && col_tiles * ((k + chunk_rows - 1) / chunk_rows) < want_warps) chunk_rows /= 2;
  const int total = (k + chunk_rows - 1) / chunk_rows;
  const int64_t items = col_tiles * total;
  const int64_t blocks = want_warps / 4;
  int cpb = static_cast<int>((items + blocks - 1) / blocks);
  cpb = cpb < 4 ? 4 : (cpb + 3) / 4 * 4;
  if (cpb > total) cpb = total;
  if (cpb < 1) cpb = 1;
  return {chunk_rows, cpb, (total + cpb - 1) / cpb};
}

// W4A16 MoE, two launches per call (w13 with act(gate) * up into h, w2 with the weighted sum over
// a token's slots into out). Shapes as fastawq::moe_w4 (python/fastawq/ops/moe.py). What both
// kernel families (csrc/moe/) take; each adds its grid.
struct MoeArgs {
  HalfType dtype;
  const void* x;                  // [T, H], rows x_stride apart
  int64_t x_stride;
  const void* ids;                // [T * topk] int32 or int64
  bool ids_int64;
  const float* topk_weights;      // [T * topk]
  const uint32_t* w13_qweight;    // [E, H, 2I/8]
  const void* w13_scales;         // [E, H/G, 2I]
  const uint32_t* w13_qzeros;     // [E, H/G, 2I/8]
  const uint32_t* w2_qweight;     // [E, I, H/8]
  const void* w2_scales;          // [E, I/G, H]
  const uint32_t* w2_qzeros;      // [E, I/G, H/8]
  void* h;                        // [T * topk, I] scratch, x's dtype
  void* out;                      // [T, H]
  float* ws13;                    // [T * topk, 2I] zeroed fp32, when splits13 > 1
  float* ws2;                     // [T, H] zeroed fp32
  int* counters13;                // zeroed (per kernel family: see its grid)
  int* counters2;                 // zeroed, [T, tiles2]
  int n_assign, topk, num_experts, hidden, inter, group13, group2;
  int act;                        // 0 silu, 1 gelu, 2 gelu (tanh)
};

// On the CUDA cores (csrc/moe/moe_gemv.cu): the dense GEMV with one expert per block, one block
// row per (token, slot) assignment, so an expert is read once per assignment. counters13 is
// [T * topk, tiles13].
struct MoeGemvArgs : MoeArgs {
  int tiles13, splits13, chunk13, cpb13;  // w13 grid: 256-column tiles (128 gate + 128 up), K splits,
  int tiles2, splits2, chunk2, cpb2;      // rows per warp item, warp items per block; w2 likewise
  // FASTAWQ_GEMV_EARLY_LOADS=1 (read at each call): w2's ring loads its first weights into registers
  // before the PDL wait (the experts' weights are written by no kernel that can launch it early).
  bool early_loads;
  // FASTAWQ_MOE_H_PARTIALS (on unless "0") at one token with splits13 > 1: [splits13, T * topk, 2I] fp32, w13's
  // split sums (plain stores, every element written), which w2 adds as it reads h; else null.
  float* h_part;
  // moe_gemv_w4_sums: [T, H] fp32, zeroed by w13 and added into by w2 (the ring form); else null.
  float* out_sums;
  // moe_gemv_packed_w4 (csrc/moe/moe_gemv_packed.cu; experts in the packed layout): 32-row batches
  // of K a warp of w13 / w2 (tiles13: 64 gate + 64 up columns, tiles2: 128 columns). Its w13 hands
  // split sums to w2 through h_part whenever splits13 > 1.
  int bpw13, bpw2;
  // FASTAWQ_MOE_PACKED_H2=0 (read at each call): moe_gemv_packed_w4 keeps fp32 sums where the
  // half2 form would run (gemv::h2_enabled); tests and sanitize.py reach both forms in one process.
  bool packed_fp32;
};

// Returns whether it wrote args.out_sums (asked for, and the one-token ring form ran) rather than
// args.out.
bool launch_moe_gemv(const MoeGemvArgs& args, cudaStream_t stream);
void launch_moe_gemv_packed(const MoeGemvArgs& args, cudaStream_t stream);
// The packed w2 kernel's dynamic shared memory: h over a block's K range (2-byte elements).
constexpr int kMoePackedMaxBatches = 64;  // 32-row batches a warp at most (host rule): 16 KiB of h
inline size_t moe_gemv_packed_smem(const MoeGemvArgs& a) {
  return static_cast<size_t>(std::min(4 * a.bpw2 * 32, a.inter)) * 2;
}
// The w2 kernel that reads h_part builds h for each warp's rows in shared memory: at most this
// many a warp (its ceil(cpb2 / 4) chunks of chunk2 rows), else the host keeps h_part off.
constexpr int kMoeHPartWarpRows = 64;
inline bool moe_h_part_fits(const MoeGemvArgs& a) { return (a.cpb2 + 3) / 4 * a.chunk2 <= kMoeHPartWarpRows; }

// On the tensor cores (csrc/moe/moe_mma.cuh): one block row per expert the ids reach (and one for
// ids outside [0, E)), each block gathering the assignments routed to its expert, so an expert is
// read once per call. At most kMoeMmaMaxAssign assignments (T * topk) and kMoeMmaMaxExperts
// experts. counters13 is [E, tiles13].
constexpr int kMoeMmaMaxAssign = 4096;
constexpr int kMoeMmaMaxExperts = 1024;
constexpr int kMoeMmaTile13 = 64;   // gate columns per w13 tile (and the same 64 up columns)
constexpr int kMoeMmaTile2 = 128;   // columns per w2 tile
struct MoeMmaArgs : MoeArgs {
  int rows;                        // block rows of both grids: min(E, T * topk) + 1
  int pass_rows;                   // tokens per pass: 8 or 16 (two mma n-tiles)
  int tiles13, splits13, steps13;  // w13 grid and 32-row steps of K per warp
  int tiles2, splits2, steps2;     // w2 likewise
  // The weights' copies at L2's normal priority instead of evict_first: the AWQ layout's default
  // (a block's tile is a 32-byte stripe of each row, 4 tiles share a 128-byte line, and evict-first
  // drops the line before its neighbours' blocks read it); FASTAWQ_MOE_MMA_EVICT forces it (moe_gemv.cpp).
  bool evict_normal;
  // FASTAWQ_MOE_MMA_PERSISTENT=1 (an A/B switch, read at each call): > 0 runs w13 and w2 as one
  // persistent launch of this many blocks, each taking work items (a block of either grid) in
  // order from a counter, all of w13's before any of w2's; a w2 item waits until its expert's
  // w13 tiles are final. sched: [2 + rows] zeroed ints (the item counter, the exit counter, and
  // per block row the w13 tiles finished), left zeroed by the launch's last block.
  int persistent_blocks;
  int* sched;
  // FASTAWQ_MOE_MMA_AHEAD=1 (persistent form only, read at each call): a block claims its next item
  // as soon as its current one no longer waits, and brings that item's first weights into L2.
  bool claim_ahead;
  // FASTAWQ_MOE_MMA_ONE_ROUND (on unless "0", read at each call; two-launch form) with at most
  // kMoeMmaOneRoundAssign assignments: a block reads its one id a thread once, for both the scan
  // for its expert and the gather of that expert's assignments (one L2 round trip and one round of
  // ballots, not two reads of kIdBatch unrolled rounds each). H100, session 28: Qwen3-30B-A3B
  // grouped op T = 16 116.7 -> 108.7 us, decode batch 8 / 16 +5.6 % / +4.3 %.
  bool one_round;
  // FASTAWQ_MOE_MMA_EARLY_W2 (on unless "0", read at each call; two-launch form): the w2 launch
  // finds its expert, gathers its assignments and issues its first weight copies before its PDL
  // wait, and waits only before its first read of h. The ids were final before w13 passed its own
  // wait, which came before w13 let w2 launch; the weights no kernel writes. H100, session 28:
  // grouped op -1.6 .. -2.4 % at T = 16 / 64 / 256, decode batch 8 / 16 +4.3 % / +1.1 %.
  bool early_w2;
  // moe_mma_packed_w4 (experts held in the packed layout: WQExperts.set_layout): the experts in
  // the packed layout of gemv/awq_gemv_packed.h, w13_qweight / w2_qweight holding wpacked [E, K/8, N]
  // and w13_scales / w2_scales szpacked [E, K/G, 2N] (no qzeros), read through a register ring
  // (moe_mma.cuh, run_work_packed). Two-launch form only.
  bool packed;
  // FASTAWQ_MOE_PACKED_CHUNKS=2 (an A/B switch, read at each call; else 4): 32-column chunks a warp
  // of the packed kernel (moe_mma.cuh says what each means).
  int packed_chunks;
  // w2's wide form (packed kernel at 4 chunks a warp; the host's rule, or FASTAWQ_MOE_PACKED_W2_WIDE,
  // moe_gemv.cpp): w2's block takes 4 tiles, one a warp over the block's whole K range (moe_mma.cuh,
  // run_work_packed); tiles2 / splits2 / steps2 then count wide tiles and one warp's steps.
  bool w2_wide;
  // FASTAWQ_MOE_PACKED_PREFETCH=N (an A/B switch, read at each call; default 0): w2 of the packed
  // kernel (its tile form at 4 chunks a warp, in instances of its own) has each warp keep N steps of
  // its K range past its 2-step register ring on their way into L2 (prefetch.global.L2, 16 lanes a
  // step, a line each), the first N before the PDL wait of the early form, then one step more as
  // each step starts. Qwen3-30B-A3B's w2 at batch 16 gives a warp 6 steps: with N = 4 its whole range
  // is in flight at once instead of 2 steps.
  int prefetch_steps;
};
constexpr int kMoeMmaOneRoundAssign = 128;  // moe_mma's threads a block
// Blocks an SM of the kernel for a pass of pass_rows tokens (its __launch_bounds__; the host sizes
// the K split by it). 24 (three n-tiles, the AWQ layout's two launches only: FASTAWQ_MOE_MMA_PASS=24)
// holds 96 accumulators a lane.
constexpr int moe_mma_blocks_per_sm(int pass_rows) { return pass_rows >= 16 ? 3 : 4; }

void launch_moe_mma(const MoeMmaArgs& args, cudaStream_t stream);
// args.packed's kernels (csrc/moe/moe_mma_packed.cu) and the persistent form's
// (csrc/moe/moe_mma_persistent.cu); launch_moe_mma calls them.
void launch_moe_mma_packed(const MoeMmaArgs& args, cudaStream_t stream);
void launch_moe_mma_persistent(const MoeMmaArgs& args, cudaStream_t stream);

// An MoE block's routing (csrc/moe/route.cu): router GEMV and top-k, optionally after the add +
// RMSNorm, grid (parts, T) of 4 warps, each block scoring kRouteBlockExperts experts of one token.
constexpr int kRouteMaxExperts = 1024;
constexpr int kRouteMaxTopk = 32;       // one chosen expert per lane of the choosing warp
constexpr int kRouteBlockExperts = 8;
constexpr int kRouteMaxChunks = 8;      // 8-element chunks a thread: H <= 128 * 8 * 8 = 8192
constexpr int kRouteMaxHidden = 128 * 8 * kRouteMaxChunks;
struct RouteArgs {
  HalfType dtype;
  const void* x;            // [T, H], rows x_stride apart
  int64_t x_stride;
  const void* residual;     // [T, H] contiguous, or nullptr (no norm)
  const void* norm_weight;  // [H] (with residual)
  void* h;                  // [T, H]: RMSNorm(x + residual) * (norm_weight + offset) (with residual)
  void* res_out;            // [T, H]: x + residual (with residual)
  const void* router;       // [E, H], x's dtype
  const float* bias;        // [E] or nullptr: added to the scores for choosing only
  float* logits;            // [T, E] scratch, when parts > 1
  int* counters;            // [T] zeroed, when parts > 1
  float* weights;           // [T, k] out
  int64_t* ids;             // [T, k] out
  int t, hidden, experts, k, parts;
  float eps, offset, scale;
  bool renorm, sigmoid;
  bool vec;                 // every row 16-byte aligned and H % 8 == 0: 16-byte loads
  int cluster_experts;      // > 0: the cluster kernel (sm_90), this many experts a block; 0: parts
  bool late_trigger;        // cluster kernel: let the next kernel launch only as the blocks exit
  bool x_f32;               // cluster kernel with the norm: x is fp32 sums [T, H] (FASTAWQ_MOE_O_SUMS),
                            // dtype the residual's; rounded to it as read
};

// The cluster form of moe_route (route.cu): up to 8 blocks of 8 warps a token, 1 to 16 experts a
// block (a power of 2), H <= kRouteClusterMaxHidden, the block's router rows staged in shared
// memory (at most kRouteClusterSmem bytes with the norm weight).
constexpr int kRouteClusterThreads = 256;
constexpr int kRouteClusterMaxBlocks = 8;
constexpr int kRouteClusterMaxBlockExperts = 16;
constexpr int kRouteClusterMaxHidden = kRouteClusterThreads * 8 * 4;
constexpr int kRouteClusterSmem = 160 * 1024;

void launch_moe_route(const RouteArgs& args, cudaStream_t stream);

}  // namespace fastawq
