// W4A16 for decode (M = 1, 2) on the CUDA cores, reading the AWQ "GEMM" layout directly.
//
// y[m, n] = sum_k x[m, k] (q[k, n] - z[g, n]) s[g, n], fp32 accumulation.
//
// Dequantization in two instructions per weight, exact: a byte permute drops a nibble into the
// mantissa of 0.5 (0x3F000000), giving f = 0.5 + q/256 as an fp32, and one FMA accumulates x * f.
// Zero point and scale are applied once per group and column:
//   sum_k x (q - z) = 256 * (sum_k x f - (0.5 + z/256) * sum_k x),
// and the zero word decodes with the same permute. The cancellation costs a few of fp32's 24
// bits, far below the fp16/bf16 output rounding.
//
// Work decomposition: a block is 4 warps on one column tile (8 lanes side by side, each with WPT
// = 4 consecutive packed words = 32 columns); the 4 row lanes of a warp take rows r, r+4, ...
// A warp item is `chunk_rows` consecutive rows of K (32..128, picked by the host so that the
// grid fills the GPU); each lane keeps 8 16-byte loads in flight per 32-row batch. Partial sums
// of the 4 row lanes meet through shuffles, the 4 warps through shared memory, and the blocks
// that split K through fp32 atomics into a zeroed workspace that the last block to arrive reads,
// converts, and zeroes again (graph-safe, no extra launch).
//
// Two kernels: the register kernel ("gemv", wins at M = 1) and the cp.async-staged one
// ("gemv_staged", wins at M = 2); benchmarks/RESULTS.md has the numbers.
#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_body.cuh"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace {

using gemv::kWarps;
using gemv::kBatchRows;
using gemv::kLoads;
using gemv::Words;
using gemv::load_batch;
using gemv::consume_batch;

// Sum a block's partials of its column tile: the 4 row lanes of a column lane through shuffles,
// the warps through shared memory (red, summed and written by gemv::store_tile).
template <int M, int WPT>
struct TileShared {
  static constexpr int kCols = WPT * 8;             // output columns per lane
  static constexpr int kTileCols = 8 * kCols;       // 8 column lanes
  float red[kWarps][M][kTileCols];
  int is_last;
};

template <typename T, int M, int WPT>
__device__ __forceinline__ void finish_tile(float (&y)[M][WPT * 8], TileShared<M, WPT>& sh, const T* __restrict__ bias,
                                            T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
                                            int n, int col0) {
  constexpr int kCols = WPT * 8;
  auto& red = sh.red;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cl = lane & 7, rl = lane >> 3;
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float v = y[mm][c];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      y[mm][c] = v;
    }
  }
  if (rl == 0) {
#pragma unroll
    for (int mm = 0; mm < M; ++mm) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) red[warp][mm][cl * kCols + c] = y[mm][c];
    }
  }
  __syncthreads();

  gemv::store_tile<T, M, kGemvThreads, kWarps, TileShared<M, WPT>::kTileCols>(red, sh.is_last, bias, out, ws, counters,
                                                                              n, col0);
}

// A lane's place: its warp, row lane, column words (8 column lanes of WPT words per tile), and
// the end of its block's chunk range; its sums start at zero.
struct LanePlace {
  int lane, warp, rl, n8, tile_word0, word0;
  bool col_ok;
  int c_end;
};
template <int M, int WPT>
__device__ __forceinline__ LanePlace place_lane(int n, int k, int chunk_rows, int chunks_per_block,
                                                float (&y)[M][WPT * 8], float (&acc)[M][WPT * 8], float (&xs)[M]) {
  LanePlace p;
  p.lane = threadIdx.x & 31, p.warp = threadIdx.x >> 5, p.rl = p.lane >> 3;
  p.n8 = n >> 3;
  p.tile_word0 = blockIdx.x * (8 * WPT);
  p.word0 = p.tile_word0 + (p.lane & 7) * WPT;
  p.col_ok = p.word0 < p.n8;  // the host guarantees n8 % WPT == 0: all WPT words or none
  p.c_end = min((blockIdx.y + 1) * chunks_per_block, (k + chunk_rows - 1) / chunk_rows);
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
    xs[mm] = 0.f;
#pragma unroll
    for (int c = 0; c < WPT * 8; ++c) y[mm][c] = acc[mm][c] = 0.f;
  }
  return p;
}

// A warp's walk over its chunks (chunk, chunk + kWarps, ...) in 32-row batches.
struct Cursor {
  int chunk, base, end;
  __device__ __forceinline__ void start(int c, int chunk_rows, int k) {
    chunk = c, base = c * chunk_rows, end = min(base + chunk_rows, k);
  }
  __device__ __forceinline__ void advance(int chunk_rows, int k) {
    base += kBatchRows;
    if (base >= end) start(chunk + kWarps, chunk_rows, k);
  }
};

template <typename T, int M, int WPT>
__global__ void __launch_bounds__(kGemvThreads) awq_gemv_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int n, int k, int group_size, int chunk_rows, int chunks_per_block) {
  __shared__ TileShared<M, WPT> sh;
  float y[M][WPT * 8], acc[M][WPT * 8], xs[M];
  const auto [lane, warp, rl, n8, tile_word0, word0, col_ok, c_end] =
      place_lane<M, WPT>(n, k, chunk_rows, chunks_per_block, y, acc, xs);
  const uint64_t policy = evict_first_policy();
  const int first = blockIdx.y * chunks_per_block + warp;
  if (first < c_end) gemv::prefetch_batch<WPT>(qweight, n8, word0, col_ok, first * chunk_rows + rl, k);
  pdl_wait();
  pdl_launch_dependents();

  // The warp walks its chunks (chunk, chunk + 4, ...) in 32-row batches; k % 32 == 0 (host
  // check), so a batch is all in range and inside one group (group_size % 32 == 0).
  for (int chunk = blockIdx.y * chunks_per_block + warp; chunk < c_end; chunk += kWarps) {
    const int chunk_row0 = chunk * chunk_rows;
    const int chunk_row_end = min(chunk_row0 + chunk_rows, k);
#pragma unroll 1
    for (int base = chunk_row0; base < chunk_row_end; base += kBatchRows) {
      Words<WPT> w[kLoads];
      float xv[M][kLoads];
      load_batch<T, M, WPT>(x, qweight, k, n8, word0, col_ok, base + rl, policy, w, xv);
      consume_batch<T, M, WPT>(w, xv, acc, xs, y, base, chunk_row_end, group_size, col_ok, qzeros, scales, n8, n,
                               word0);
    }
  }

  finish_tile<T, M, WPT>(y, sh, bias, out, ws, counters, n, tile_word0 * 8);
}

// cp.async-staged kernel: each lane streams its batches through S shared-memory stages of its own
// (16 bytes per row), so the bytes in flight are bounded by shared memory, not by registers (the
// register kernel above keeps one batch per lane in flight; ncu numbers in benchmarks/RESULTS.md).
// The x rows of a batch (M x 32 values) are staged alongside by lanes 0..4M-1. Each lane reads
// back only its own weight chunks, so only the x stage needs a warp barrier.
template <int M, int S>
struct AsyncStage {
  uint4 w[kLoads][32];   // [row of the lane's batch][lane]
  uint4 x[M][4];         // 32 values of x (M rows) for the batch's rows, 8 per 16-byte chunk
};

template <typename T, int M, int S>
__device__ __forceinline__ void issue_stage(AsyncStage<M, S>& st, const T* __restrict__ x,
                                            const uint32_t* __restrict__ qweight, int k, int n8, int word0,
                                            bool col_ok, int base, int lane, int rl, uint64_t policy) {
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const uint32_t* src = qweight + static_cast<int64_t>(base + rl + 4 * u) * n8 + (col_ok ? word0 : 0);
    cp_async16_stream(&st.w[u][lane], src, col_ok, policy);
  }
  if (lane < 4 * M) {
    const int mm = lane >> 2, part = lane & 3;
    cp_async16(&st.x[mm][part], x + static_cast<int64_t>(mm) * k + base + part * 8, true);
  }
}

template <typename T, int M, int S>
__global__ void __launch_bounds__(kGemvThreads, M == 1 ? 4 : 1) awq_gemv_async_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int n, int k, int group_size, int chunk_rows, int chunks_per_block) {
  using Tr = HalfTraits<T>;
  constexpr int WPT = kGemvWordsPerLane;
  __shared__ TileShared<M, WPT> sh;
  float y[M][WPT * 8], acc[M][WPT * 8], xs[M];
  const auto [lane, warp, rl, n8, tile_word0, word0, col_ok, c_end] =
      place_lane<M, WPT>(n, k, chunk_rows, chunks_per_block, y, acc, xs);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  AsyncStage<M, S>* my = reinterpret_cast<AsyncStage<M, S>*>(smem_raw) + warp * S;  // [warp][S]
  const uint64_t policy = evict_first_policy();

  Cursor cur, ahead;
  cur.start(blockIdx.y * chunks_per_block + warp, chunk_rows, k);
  ahead = cur;
  if (cur.chunk < c_end) gemv::prefetch_batch<WPT>(qweight, n8, word0, col_ok, cur.base + rl, k);
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (ahead.chunk < c_end) {
      issue_stage<T, M, S>(my[s], x, qweight, k, n8, word0, col_ok, ahead.base, lane, rl, policy);
      ahead.advance(chunk_rows, k);
    }
    cp_async_commit();
  }
#pragma unroll 1
  for (int t = 0; cur.chunk < c_end; ++t) {
    if (ahead.chunk < c_end) {
      issue_stage<T, M, S>(my[(t + S - 1) % S], x, qweight, k, n8, word0, col_ok, ahead.base, lane, rl, policy);
      ahead.advance(chunk_rows, k);
    }
    cp_async_commit();
    cp_async_wait<S - 1>();
    __syncwarp();  // the x chunks of this stage came from lanes 0..4M-1
    const AsyncStage<M, S>& st = my[t % S];
    Words<WPT> w[kLoads];
    float xv[M][kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const uint4 v = st.w[u][lane];
      w[u].v[0] = v.x, w[u].v[1] = v.y, w[u].v[2] = v.z, w[u].v[3] = v.w;
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        const T* xr = reinterpret_cast<const T*>(&st.x[mm][0]);
        xv[mm][u] = Tr::to_float(xr[rl + 4 * u]);
      }
    }
    __syncwarp();  // every lane has read this stage before it is refilled
    consume_batch<T, M, WPT>(w, xv, acc, xs, y, cur.base, cur.end, group_size, col_ok, qzeros, scales, n8, n, word0);
    cur.advance(chunk_rows, k);
  }
  cp_async_wait<0>();

  finish_tile<T, M, WPT>(y, sh, bias, out, ws, counters, n, tile_word0 * 8);
}

template <typename T, int M>
void launch_m(const GemvArgs& a, cudaStream_t stream) {
  const dim3 grid(a.col_tiles, a.splits);
  launch_pdl(awq_gemv_kernel<T, M, kGemvWordsPerLane>, grid, dim3(kGemvThreads), 0, stream,
      static_cast<const T*>(a.x), a.qweight, static_cast<const T*>(a.scales), a.qzeros,
      static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.n, a.k, a.group_size,
      a.chunk_rows, a.chunks_per_block);
}

// Three stages: four measured no better at M = 2 and worse at M = 1 (benchmarks/CUDA_NOTES.md).
template <typename T, int M, int S = 3>
void launch_staged(const GemvArgs& a, cudaStream_t stream) {
  const size_t smem = sizeof(AsyncStage<M, S>) * S * kWarps;
  auto kernel = awq_gemv_async_kernel<T, M, S>;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  (void)attr;
  const dim3 grid(a.col_tiles, a.splits);
  launch_pdl(kernel, grid, dim3(kGemvThreads), smem, stream,
      static_cast<const T*>(a.x), a.qweight, static_cast<const T*>(a.scales), a.qzeros,
      static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.n, a.k, a.group_size,
      a.chunk_rows, a.chunks_per_block);
}

// The host entry sends only 1 <= m <= kGemvMaxM = 2.
template <typename T>
void launch_t(const GemvArgs& a, cudaStream_t stream) {
  static_assert(kGemvMaxM == 2, "one instance per M below");
  if (a.staged) return a.m == 1 ? launch_staged<T, 1>(a, stream) : launch_staged<T, 2>(a, stream);
  return a.m == 1 ? launch_m<T, 1>(a, stream) : launch_m<T, 2>(a, stream);
}

}  // namespace

void launch_awq_gemv(const GemvArgs& a, cudaStream_t stream) {
  if (a.dtype == HalfType::kHalf) {
    launch_t<__half>(a, stream);
  } else {
    launch_t<__nv_bfloat16>(a, stream);
  }
}

}  // namespace fastawq
