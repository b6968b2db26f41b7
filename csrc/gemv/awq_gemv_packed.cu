// W4A16 decode (M = 1..8) on the CUDA cores, on the load-time repacked layout of
// awq_gemv_packed.h: every 16-byte load of a lane holds exactly the nibbles it consumes (8 rows x
// its 4 columns), and one 16-byte load per group brings its 4 (scale, zero) pairs.
//
// y[m, n] = sum_k x[m, k] (q[k, n] - z[g, n]) s[g, n], fp32 accumulation, with the exact
// dequantization of awq_gemv.cu: a byte permute drops a nibble into the mantissa of 0.5, giving
// f = 0.5 + q/256, and per group and column sum_k x (q - z) = 256 (sum_k x f - (0.5 + z/256) sum_k x).
// At M <= 2 the half2 form (consume_h2, below) takes its place: 8 rows summed in x's dtype, then
// fp32 (H200, RESULTS.md session 11: 2.18 against 2.10x cuBLAS fp16 at M = 1, 1.72 against 1.56 at 2).
//
// Work: a block is 4 warps on one 128-column tile (32 lanes x 4 columns); each warp walks its own
// contiguous range of `batches_per_warp` 32-row batches. Bytes in flight come from registers, not
// shared memory: the source issues the next batch (4 independent 16-byte loads per lane) before the
// current one is consumed -- though in the compiled one-batch loop they land at the end of the body
// and the next batch waits for them (PINGPONG below, which keeps them in flight while the warp sums)
// -- and the low register count leaves room for many resident warps (cp.async would add a barrier
// and shared memory traffic for no reuse: each byte is read by one lane once). The host picks the range so the
// grid is one wave of the blocks that fit (awq_gemv_packed.cpp plan_auto). Tail: warps meet in
// shared memory, split-K blocks add into the zeroed fp32 workspace with one atomic per (row,
// column), and the last block of a tile converts and re-zeroes it (graph-safe, no extra launch).
// ptxas (sm_90a, no spills): 64 registers at M = 1 (77 with the half2 sums, kH2), 94 at 2..3,
// 128..134 at 4..5, ~167 at 6..7, ~195 at 8. (Session 5: a minimum of 6 blocks per SM brought
// M = 2 to 80 but spilled at M = 3.)
#include <algorithm>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/awq_gemv_packed_body.cuh"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace {

using namespace gemv_packed;  // kWarps, kLoads, load_batch, load_x8, consume, consume_h2, zero_consts

// act(g) in fp32 as act_mul computes it (triton_kernels/norm.py, reference.py): 1 silu, 2 gelu
// with the tanh approximation, 3 gelu.
template <int ACT>
__device__ __forceinline__ float act_f(float g) {
  if constexpr (ACT == 1) {
    return g / (1.f + expf(-g));
  } else if constexpr (ACT == 2) {
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.f + (2.f / (1.f + expf(-2.f * z)) - 1.f));
  } else {
    return 0.5f * g * (1.f + erff(g * 0.7071067811865476f));
  }
}

// ACT > 0 (awq_gemv_packed_act): x is gate_up [M, 2K]; after the PDL wait and the first weight
// loads, the block writes act(gate) * up for its K range (its 4 warps' ranges, contiguous) into
// dynamic shared memory, rounded to T as act_mul rounds it, and the main loop reads x from there:
// act_mul's launch and its round trip through memory are gone.
// ACT == -1 (awq_gemv_packed_norm): x is the norm's input; the block sums the squares of the whole
// row(s) of x + residual (rounded to T, the new residual stream), then stages its K range of
// RMSNorm(x + residual) * (norm_weight + offset) as add_rms_norm rounds it (once, from fp32).
struct NormIn {
  const void* residual;
  const void* weight;
  void* res_out;
  float eps, offset;
};
struct SumsSide {
  float4* zero;       // zero_len4 float4s, or null
  int64_t zero_len4;
  bool x_f32;         // ACT > 0: gate_up is fp32 [M, 2K]
};

// PINGPONG (FASTAWQ_GEMV_PINGPONG=1; an A/B switch): the main loop two batches an iteration with
// the register buffers trading roles, and the next batch's loads issued after the current batch's
// first use. In the one-batch loop the `cur = nxt` copy lets the register allocator give both
// the same registers, which forces the next batch's loads below the current batch's last use: the
// SASS issues them at the end of the body and the first instruction of the next batch waits for
// them, so no weight load is in flight while a warp sums (CUDA_NOTES.md, session 17).
// kSums (awq_gemv_packed_sums / _act_sums, M <= 2): each block adds its tile (and split 0 the bias)
// into sums [M, N] fp32, which an earlier kernel zeroed, and exits: no workspace, fence, arrival
// or conversion pass; the consumer (add_rms_norm) rounds the sums as it reads them. The sums
// instances alone also take `side` (SumsSide): a buffer to zero for a later projection's sums, and
// (ACT > 0) gate_up as fp32 sums, which the prologue rounds to T as the GEMV that made them would
// have (FASTAWQ_DENSE_GU_SUMS: gate_up's end handed to the down projection).
template <typename T, int M, bool kH2, int ACT = 0, bool PINGPONG = false, bool kSums = false>
__global__ void __launch_bounds__(kPackedThreads, PINGPONG && M == 1 ? 6 : 0) awq_gemv_packed_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int n, int k, int group_size,
    int batches_per_warp, const NormIn norm, const bool early_loads, const int prefetch_batches,
    float* __restrict__ sums, const SumsSide side) {
  using Tr = HalfTraits<T>;
  __shared__ __align__(16) float red[kWarps][M][kPackedTileCols];
  __shared__ int is_last;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n4 = n >> 2;
  const int c4 = blockIdx.x * 32 + lane;  // the lane's 4-column chunk
  const bool col_ok = c4 < n4;            // n % 8 == 0: a chunk is all in range or all out
  const int b_total = k / kPackedBatchRows;
  const int b0 = (blockIdx.y * kWarps + warp) * batches_per_warp;
  const int b1 = min(b0 + batches_per_warp, b_total);
  const uint64_t policy = evict_first_policy();

  float y[M][4], acc[M][4], xs[M];
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
    xs[mm] = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) y[mm][c] = acc[mm][c] = 0.f;
  }

  // Before waiting for the previous kernel (PDL), bring the warp's first batches of weights into
  // L2 (prefetch_batches: 2 unless FASTAWQ_GEMV_PREFETCH says otherwise), so a launch that starts
  // early streams them while that kernel finishes. Only into L2:
  // L2 is where every write lands, so even weights the previous kernel just wrote (a repack) read
  // right after the wait, which registers loaded before it would not promise. x and the workspace
  // are touched only after the wait.
  if (col_ok) {
    for (int b = b0; b < min(b0 + prefetch_batches, b1); ++b) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) prefetch_l2(wp + static_cast<int64_t>(b * kLoads + u) * n4 + c4);
    }
  }
  uint4 cur[kLoads], nxt[kLoads];
  // The next batch's loads step a pointer (recomputing (4b + u) n4 + c4 per load cost ~25
  // instructions a batch).
  const uint4* w_next = wp + static_cast<int64_t>(b0 * kLoads) * n4 + c4;
  const int64_t n4l = n4;
  // early_loads (GemvPackedArgs says when that is safe): the first batch into registers while the
  // previous kernel finishes, so the first consume after the wait does not wait for L2.
  if (early_loads && b0 < b1) load_batch(cur, w_next, n4l, col_ok, policy);
  pdl_wait();
  pdl_launch_dependents();
  if (!early_loads && b0 < b1) load_batch(cur, w_next, n4l, col_ok, policy);
  if constexpr (kSums) {
    // A later projection's sums, zeroed by the whole grid after the wait: whatever kernel last used
    // that memory (the caching allocator reuses it) has finished.
    if (side.zero != nullptr) {
      const int64_t nthreads = int64_t(gridDim.x) * gridDim.y * kPackedThreads;
      for (int64_t i = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * kPackedThreads + threadIdx.x;
           i < side.zero_len4; i += nthreads) {
        __stcg(side.zero + i, make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
  }
  // The input the main loop reads: x itself, or (ACT) the block's staged act(gate) * up, row stride
  // ldx, indexed by the global row (xin points kb0 rows before the staged block).
  const T* xin = x;
  int ldx = k;
  if constexpr (ACT < 0) {
    // Every load of the staging is issued before the first use (the block's norm weights, then the
    // whole row(s) of x and the residual, kU chunks a thread at a time): one L2 round trip, where a
    // loop of dependent chunk loads made one per chunk and ate what the fused launch saved.
    extern __shared__ __align__(16) uint8_t norm_smem[];
    __shared__ float norm_red[kWarps][M];
    T* xs_block = reinterpret_cast<T*>(norm_smem);
    const int kb0 = blockIdx.y * kWarps * batches_per_warp * kPackedBatchRows;
    const int rows = max(min(kb0 + kWarps * batches_per_warp * kPackedBatchRows, k) - kb0, 0);
    const T* res = static_cast<const T*>(norm.residual);
    T* res_out = static_cast<T*>(norm.res_out);
    const T* nw = static_cast<const T*>(norm.weight);
    // The block's rows take at most kWarps * batches * 32 / 8 chunks; a thread's first is threadIdx.x.
    const bool nw_mine = threadIdx.x < rows / 8;
    const uint4 nw_first = nw_mine ? __ldg(reinterpret_cast<const uint4*>(nw + kb0 + 8 * threadIdx.x))
                                   : make_uint4(0, 0, 0, 0);
    constexpr int kU = 4 / M;  // chunks a thread loads at once, per row
    const int chunks = k / 8;
    float ss[M];
#pragma unroll
    for (int mm = 0; mm < M; ++mm) ss[mm] = 0.f;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += kU * kPackedThreads) {
      uint4 xv[M][kU], rv[M][kU];
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int c = c0 + u * kPackedThreads;
          const bool ok = c < chunks;
          const int64_t at = static_cast<int64_t>(mm) * k + 8 * (ok ? c : 0);
          xv[mm][u] = ok ? __ldg(reinterpret_cast<const uint4*>(x + at)) : make_uint4(0, 0, 0, 0);
          rv[mm][u] = ok && res != nullptr ? __ldg(reinterpret_cast<const uint4*>(res + at)) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int c = c0 + u * kPackedThreads;
          if (c >= chunks) continue;
          float r[8];
          unpack8<T>(xv[mm][u], r);
          if (res != nullptr) {
            float rr[8];
            unpack8<T>(rv[mm][u], rr);
#pragma unroll
            for (int j = 0; j < 8; ++j) r[j] = round_to<T>(r[j] + rr[j]);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) ss[mm] = fmaf(r[j], r[j], ss[mm]);
          const int row = 8 * c - kb0;
          if (row >= 0 && row < rows) {
            const uint4 packed = pack8<T>(r);
            *reinterpret_cast<uint4*>(xs_block + mm * rows + row) = packed;
            if (res != nullptr && blockIdx.x == 0) {
              *reinterpret_cast<uint4*>(res_out + static_cast<int64_t>(mm) * k + 8 * c) = packed;
            }
          }
        }
      }
    }
#pragma unroll
    for (int mm = 0; mm < M; ++mm) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[mm] += __shfl_xor_sync(0xffffffffu, ss[mm], o);
      if (lane == 0) norm_red[warp][mm] = ss[mm];
    }
    __syncthreads();
    float rstd[M];
#pragma unroll
    for (int mm = 0; mm < M; ++mm) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += norm_red[w][mm];
      rstd[mm] = rsqrtf(total / static_cast<float>(k) + norm.eps);
    }
    for (int c = threadIdx.x; c < rows / 8; c += kPackedThreads) {
      float w[8];
      unpack8<T>(c == threadIdx.x ? nw_first : __ldg(reinterpret_cast<const uint4*>(nw + kb0 + 8 * c)), w);
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] += norm.offset;
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        float r[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(xs_block + mm * rows + 8 * c), r);
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = r[j] * rstd[mm] * w[j];
        *reinterpret_cast<uint4*>(xs_block + mm * rows + 8 * c) = pack8<T>(r);
      }
    }
    __syncthreads();
    xin = xs_block - kb0;
    ldx = rows;
  }
  if constexpr (ACT > 0) {
    extern __shared__ __align__(16) uint8_t act_smem[];
    T* xs_block = reinterpret_cast<T*>(act_smem);
    const int kb0 = blockIdx.y * kWarps * batches_per_warp * kPackedBatchRows;
    const int rows = max(min(kb0 + kWarps * batches_per_warp * kPackedBatchRows, k) - kb0, 0);
    const int chunks = rows / 8;
    for (int i = threadIdx.x; i < M * chunks; i += kPackedThreads) {
      const int mm = i / chunks, c = i - mm * chunks;
      const int64_t at = static_cast<int64_t>(mm) * 2 * k + kb0 + 8 * c;
      float gf[8], uf[8];
      bool f32 = false;
      if constexpr (kSums) f32 = side.x_f32;
      if (f32) {
        // gate_up's fp32 sums: rounded to T first, as the GEMV's own conversion would have.
        const float4* g4 = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(x) + at);
        const float4* u4 = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(x) + at + k);
        const float4 ga = __ldcg(g4), gb = __ldcg(g4 + 1), ua = __ldcg(u4), ub = __ldcg(u4 + 1);
        const float gv[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
        const float uv[8] = {ua.x, ua.y, ua.z, ua.w, ub.x, ub.y, ub.z, ub.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) gf[j] = round_to<T>(gv[j]), uf[j] = round_to<T>(uv[j]);
      } else {
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + at)), gf);
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + at + k)), uf);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) gf[j] = act_f<ACT>(gf[j]) * uf[j];
      *reinterpret_cast<uint4*>(xs_block + mm * rows + 8 * c) = pack8<T>(gf);
    }
    __syncthreads();
    xin = xs_block - kb0;
    ldx = rows;
  }
  // The group walk as counters (a division by the run-time group size per batch cost ~20
  // instructions): batches left in the current group, and that group's (scale, zero) row.
  const int batches_per_group = group_size / kPackedBatchRows;
  int group_left = batches_per_group - b0 % batches_per_group;
  const uint4* sz_lane = sz + static_cast<int64_t>(b0 / batches_per_group) * n4 + c4;
  // kH2 needs the group's zeros before its first batch: the next group's pairs are fetched with
  // the loads of the batch that starts it.
  [[maybe_unused]] uint4 sv_cur = make_uint4(0, 0, 0, 0), sv_nxt = make_uint4(0, 0, 0, 0);
  [[maybe_unused]] typename Tr::T2 zc[4];
  if constexpr (kH2) {
    if (col_ok && b0 < b1) sv_cur = __ldg(sz_lane);
    zero_consts<T>(sv_cur, zc);
  }
  [[maybe_unused]] bool zc_stale = false;  // PINGPONG: zc still holds the closed group's constants
  [[maybe_unused]] const uint32_t runtime_zero = static_cast<uint32_t>(n) >> 31;  // n >= 0: zero, unknown to ptxas
  // One batch: issue the loads of the next one into `fill`, and sum `use`. PINGPONG issues them
  // after the first use of `use`: every weight load of a warp gets the same scoreboard, so the first
  // use waits for all loads in flight; issued before it, the next batch's would be among them.
  const auto step = [&](const uint4 (&use)[kLoads], uint4 (&fill)[kLoads], int b) {
    const bool more = b + 1 < b1;
    const auto fetch = [&](int dep) {
      if (more) {
        w_next += kLoads * n4l + dep;
        load_batch(fill, w_next, n4l, col_ok, policy);
        if constexpr (kH2) {
          if (group_left == 1 && col_ok) sv_nxt = __ldg(sz_lane + n4 + dep);
        }
      }
    };
    if constexpr (!PINGPONG) fetch(0);
    const auto after_first = [&]() {
      // A zero the loads' addresses depend on, made from the first load's sums: without it ptxas
      // may hoist the loads above that load's first use (it did at M = 2, where an x load's use
      // then waited on the new weight loads' scoreboard).
      if constexpr (PINGPONG) fetch(static_cast<int>(__float_as_uint(acc[0][0]) & runtime_zero));
    };
    if constexpr (PINGPONG && kH2) {
      // The group's zero constants, from pairs fetched with the previous batch's weights: made here,
      // where the first use of `use` waits for that fetch anyway (at the close they would wait for
      // the next batch's loads, on the same scoreboard).
      if (zc_stale) {
        sv_cur = sv_nxt;
        zero_consts<T>(sv_cur, zc);
        zc_stale = false;
      }
    }
    if constexpr (kH2) {
      consume_h2<T, M, (ACT != 0)>(use, xin, ldx, b * kPackedBatchRows, zc, acc, after_first);
    } else {
      consume<T, M, (ACT != 0)>(use, xin, ldx, b * kPackedBatchRows, acc, xs, after_first);
    }
    // Close the group when the next batch starts a new one or the warp's range ends
    // (group_size % 32 == 0: a batch never straddles groups).
    if (--group_left == 0 || b + 1 == b1) {
      if constexpr (kH2) {
        const T* p = reinterpret_cast<const T*>(&sv_cur);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float sc = Tr::to_float(p[2 * c]);
#pragma unroll
          for (int mm = 0; mm < M; ++mm) y[mm][c] = fmaf(sc, acc[mm][c], y[mm][c]);
        }
        if constexpr (PINGPONG) {
          zc_stale = true;
        } else {
          sv_cur = sv_nxt;
          zero_consts<T>(sv_cur, zc);
        }
      } else if (col_ok) {
        const uint4 sv = __ldg(sz_lane);
        const T* p = reinterpret_cast<const T*>(&sv);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float s = Tr::to_float(p[2 * c]);
          const float fz = fmaf(Tr::to_float(p[2 * c + 1]), 1.f / 256.f, 0.5f);  // exact
#pragma unroll
          for (int mm = 0; mm < M; ++mm) y[mm][c] = fmaf(s, fmaf(-fz, xs[mm], acc[mm][c]), y[mm][c]);
        }
      }
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        xs[mm] = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mm][c] = 0.f;
      }
      group_left = batches_per_group;
      sz_lane += n4;
    }
  };
  if constexpr (PINGPONG) {
    // Two batches an iteration, the buffers trading roles: no copy joins them, so the register
    // allocator keeps them apart and the next batch's loads leave before the current one's math.
#pragma unroll 1
    for (int b = b0; b < b1; b += 2) {
      step(cur, nxt, b);
      if (b + 1 < b1) step(nxt, cur, b + 1);
    }
  } else {
#pragma unroll 1
    for (int b = b0; b < b1; ++b) {
      step(cur, nxt, b);
#pragma unroll
      for (int u = 0; u < kLoads; ++u) cur[u] = nxt[u];
    }
  }

  // The 4 warps of the tile meet in shared memory (warps with an empty range add zeros).
#pragma unroll
  for (int mm = 0; mm < M; ++mm) {
    *reinterpret_cast<float4*>(&red[warp][mm][lane * 4]) = make_float4(y[mm][0], y[mm][1], y[mm][2], y[mm][3]);
  }
  __syncthreads();

  // Units of the sums: 1/256 (decode_bytes), or 1/16 (consume_h2).
  gemv::store_tile<T, M, kPackedThreads, kWarps, kPackedTileCols, kSums>(red, is_last, bias, out, ws, counters, n,
                                                                         blockIdx.x * kPackedTileCols, M,
                                                                         kH2 ? 16.f : 256.f, sums);
}

// The half2 path (consume_h2) at M <= kH2MaxM, unless gemv::h2_enabled says no (FASTAWQ_GEMV_H2).
constexpr int kH2MaxM = 2;

// Shared memory of awq_gemv_packed_act's staged input: M rows of the block's K range.
inline int act_smem_bytes(const GemvPackedArgs& a) {
  return a.m * std::min(kWarps * a.steps_per_warp * kPackedBatchRows, a.k) * 2;
}

// The two-batch main loop (PINGPONG above) at M = 2; FASTAWQ_GEMV_PINGPONG=1 / 0 at both M / neither
// (read at each call, so a graph reads it at capture and the split plan's occupancy query sees the
// instance the launch runs). H200, session 18 (RESULTS.md): Llama-3-8B shape decode 759.2 -> 795.9
// tokens/s at batch 2, but 473.3 -> 458.7 at batch 1 (kernel table: M = 1 2.34x -> 2.18x of cuBLAS).
bool pingpong_enabled(int m) {
  const int s = env_switch("FASTAWQ_GEMV_PINGPONG");
  return s < 0 ? m == 2 : s == 1;
}

template <typename T, int M, int ACT>
void launch_act(const GemvPackedArgs& a, cudaStream_t stream, int* resident) {
  constexpr bool kH2able = M <= kH2MaxM;
  // The two-batch loop only where the GEMV serves decode (M <= 2): fewer instances.
  constexpr bool kPPable = M <= kH2MaxM;
  const bool h2 = kH2able && gemv::h2_enabled<T>(), pp = kPPable && pingpong_enabled(M);
  auto kernel = h2 ? (pp ? awq_gemv_packed_kernel<T, M, kH2able, ACT, kPPable>
                         : awq_gemv_packed_kernel<T, M, kH2able, ACT>)
                   : (pp ? awq_gemv_packed_kernel<T, M, false, ACT, kPPable>
                         : awq_gemv_packed_kernel<T, M, false, ACT>);
  // The sums form (awq_gemv_packed_sums / _act_sums; the host sends it M <= kH2MaxM, no norm).
  if constexpr (kH2able && ACT >= 0) {
    if (a.sums != nullptr) {
      kernel = h2 ? (pp ? awq_gemv_packed_kernel<T, M, true, ACT, true, true>
                        : awq_gemv_packed_kernel<T, M, true, ACT, false, true>)
                  : (pp ? awq_gemv_packed_kernel<T, M, false, ACT, true, true>
                        : awq_gemv_packed_kernel<T, M, false, ACT, false, true>);
    }
  }
  const int smem = ACT != 0 && resident == nullptr ? act_smem_bytes(a) : 0;
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kPackedThreads, 0);
    return;
  }
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  launch_pdl(kernel, dim3(a.col_tiles, a.splits), dim3(kPackedThreads), smem, stream, static_cast<const T*>(a.x),
             reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz), static_cast<const T*>(a.bias),
             static_cast<T*>(a.out), a.workspace, a.counters, a.n, a.k, a.group_size, a.steps_per_warp,
             NormIn{a.residual, a.norm_weight, a.res_out, a.eps, a.offset}, a.early_loads, a.prefetch_batches,
             a.sums, SumsSide{reinterpret_cast<float4*>(a.zero), a.zero_len4, a.x_f32});
}

template <typename T, int M>
void launch_m(const GemvPackedArgs& a, cudaStream_t stream, int* resident) {
  if constexpr (M <= kPackedActMaxM) {
    if (a.norm_weight != nullptr) return launch_act<T, M, -1>(a, stream, resident);
    switch (a.act) {
      case 1: return launch_act<T, M, 1>(a, stream, resident);
      case 2: return launch_act<T, M, 2>(a, stream, resident);
      case 3: return launch_act<T, M, 3>(a, stream, resident);
      default: break;
    }
  }
  launch_act<T, M, 0>(a, stream, resident);
}

// The host entry sends only 1 <= m <= kPackedMaxM = 8.
template <typename T>
void launch_t(const GemvPackedArgs& a, cudaStream_t stream, int* resident) {
  static_assert(kPackedMaxM == 8, "one instance per M below");
  switch (a.m) {
    case 1: return launch_m<T, 1>(a, stream, resident);
    case 2: return launch_m<T, 2>(a, stream, resident);
    case 3: return launch_m<T, 3>(a, stream, resident);
    case 4: return launch_m<T, 4>(a, stream, resident);
    case 5: return launch_m<T, 5>(a, stream, resident);
    case 6: return launch_m<T, 6>(a, stream, resident);
    case 7: return launch_m<T, 7>(a, stream, resident);
    default: return launch_m<T, 8>(a, stream, resident);
  }
}

}  // namespace

void launch_awq_gemv_packed(const GemvPackedArgs& a, cudaStream_t stream) {
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, stream, nullptr); });
}

int gemv_packed_resident_blocks(const GemvPackedArgs& a) {
  int blocks = 0;
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, nullptr, &blocks); });
  return blocks > 0 ? blocks : 1;
}

}  // namespace fastawq
