// W4A16 mixture-of-experts decode on the CUDA cores, on experts held in the packed layout
// (gemv/awq_gemv_packed.h; ops/repack.awq_experts_repack): moe_gemv.cu's two launches, one block row
// per (token, slot) assignment f = t * topk + j (blockIdx.z = f), with the dense packed GEMV's K walk
// (gemv/awq_gemv_packed_body.cuh: a lane's 16-byte loads hold exactly the 8 rows x 4 columns it sums,
// the next batch's loads in flight while it sums the current one).
//
//  w13: x[f / topk] [H] · w13[e] -> h[f] [I] = act(gate) * up. A block's tile is 64 gate columns and
//       the same 64 up columns (lanes 0..15 on gate chunks, 16..31 on the up chunks I / 4 chunks
//       on), its 4 warps on contiguous ranges of 32-row batches of K. One split: the block writes h
//       itself. Split K: each split stores its gate and up sums into h_part [splits13, T * topk, 2I]
//       with plain stores and exits; w2 adds them as it stages h (no atomics, fence or arrival).
//  w2:  h[f] [I] · w2[e] -> out[t] [H] = sum_j w[f] * (h[f] w2[e]), a 128-column tile a block. After
//       its PDL wait the block stages h[f] over its K range in shared memory (from h, or from the
//       splits' sums with the activation applied and rounded to x's dtype, as w13 would have), then
//       walks K reading x from there. The weighted tile goes into out_sums (moe_gemv_packed_w4_sums:
//       fp32 atomics into the buffer w13 zeroed), or straight to out (topk == 1, one split), or into
//       the zeroed fp32 ws2, where the last of the token's topk * splits2 blocks to arrive at the
//       tile (a counter per (token, tile)) converts it and zeroes it again (graph-safe).
// Before its wait a w2 block already holds its first batch of weights in registers: no kernel writes
// the experts. An id outside [0, E) reads expert 0's addresses but loads nothing (col_ok false) and
// adds zeros, so every counter still returns to zero.
#include <cstdint>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/awq_gemv_packed_body.cuh"
#include "gemv/gemv_common.cuh"
#include "moe/moe_common.cuh"

namespace fastawq {
namespace {

using namespace gemv_packed;  // kWarps, kLoads, load_batch, load_x8, consume, consume_h2, zero_consts
using moe::act_fn;

constexpr int kTile13 = kPackedTileCols / 2;  // gate columns of a w13 tile (and as many up columns)

// Sums of kH2's half2 form come out in units of 1/16, the fp32 form's in 1/256.
template <bool kH2>
constexpr float kUnit = kH2 ? 16.f : 256.f;

// Assignment f's expert, and whether it is one (ids outside [0, E) are not: expert 0's addresses).
struct Expert {
  bool valid;
  int64_t e;
};
__device__ __forceinline__ Expert expert_of(const MoeGemvArgs& a, int f, bool through_l2) {
  int64_t e;
  if (a.ids_int64) {
    const int64_t* p = static_cast<const int64_t*>(a.ids) + f;
    e = through_l2 ? __ldcg(p) : *p;
  } else {
    const int* p = static_cast<const int*>(a.ids) + f;
    e = through_l2 ? __ldcg(p) : *p;
  }
  const bool valid = e >= 0 && e < a.num_experts;
  return {valid, valid ? e : 0};
}

// walk's sv0: the lane's scale / zero chunk of the group that batch b0 starts in (zeros where the
// half2 form does not read it: fp32 sums load theirs at each group's close).
template <bool kH2>
__device__ __forceinline__ uint4 first_scales(const uint4* __restrict__ sz, int64_t n4, bool col_ok, int b0, int b1,
                                              int group_size) {
  if (!kH2 || !col_ok || b0 >= b1) return make_uint4(0, 0, 0, 0);
  return __ldg(sz + static_cast<int64_t>(b0 / (group_size / kPackedBatchRows)) * n4);
}

// One lane's walk of its warp's batches b0 .. b1 - 1 of K (the dense GEMV's loop at M = 1): y[c] =
// sum over those rows of x[r] * (q[r, c] - z) * s for the lane's 4 columns, in units of 1 / kUnit.
// wp, sz: the lane's chunk c4 of the matrix's wpacked / szpacked (n4 16-byte chunks a row). cur
// holds batch b0 already (the caller loaded it, maybe before its PDL wait), and sv0 (kH2) the lane's
// scale / zero chunk of b0's group (first_scales). x: the input row (SX: in shared memory, indexed
// by the global row).
template <typename T, bool kH2, bool SX>
__device__ __forceinline__ void walk(const T* x, const uint4* __restrict__ wp, const uint4* __restrict__ sz,
                                     int64_t n4, bool col_ok, int b0, int b1, int group_size, uint4 (&cur)[kLoads],
                                     uint4 sv0, uint64_t policy, float (&y)[4]) {
  using Tr = HalfTraits<T>;
  float acc[1][4], xs[1] = {0.f};
#pragma unroll
  for (int c = 0; c < 4; ++c) y[c] = acc[0][c] = 0.f;
  if (b0 >= b1) return;
  const uint4* w_next = wp + static_cast<int64_t>(b0) * kLoads * n4;
  const int batches_per_group = group_size / kPackedBatchRows;
  int group_left = batches_per_group - b0 % batches_per_group;
  const uint4* sz_lane = sz + static_cast<int64_t>(b0 / batches_per_group) * n4;
  [[maybe_unused]] uint4 sv_cur = make_uint4(0, 0, 0, 0), sv_nxt = make_uint4(0, 0, 0, 0);
  [[maybe_unused]] typename Tr::T2 zc[4];
  if constexpr (kH2) {
    sv_cur = sv0;
    zero_consts<T>(sv_cur, zc);
  }
  const auto none = [] {};
#pragma unroll 1
  for (int b = b0; b < b1; ++b) {
    const bool more = b + 1 < b1;
    uint4 nxt[kLoads];
    if (more) {
      w_next += kLoads * n4;
      load_batch(nxt, w_next, n4, col_ok, policy);
      if constexpr (kH2) {
        if (group_left == 1 && col_ok) sv_nxt = __ldg(sz_lane + n4);
      }
    }
    if constexpr (kH2) {
      consume_h2<T, 1, SX>(cur, x, 0, b * kPackedBatchRows, zc, acc, none);
    } else {
      consume<T, 1, SX>(cur, x, 0, b * kPackedBatchRows, acc, xs, none);
    }
    // Close the group when the next batch starts a new one or the range ends (group_size % 32 == 0).
    if (--group_left == 0 || !more) {
      if constexpr (kH2) {
        const T* p = reinterpret_cast<const T*>(&sv_cur);
#pragma unroll
        for (int c = 0; c < 4; ++c) y[c] = fmaf(Tr::to_float(p[2 * c]), acc[0][c], y[c]);
        sv_cur = sv_nxt;
        zero_consts<T>(sv_cur, zc);
      } else if (col_ok) {
        const uint4 sv = __ldg(sz_lane);
        const T* p = reinterpret_cast<const T*>(&sv);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float fz = fmaf(Tr::to_float(p[2 * c + 1]), 1.f / 256.f, 0.5f);  // exact
          y[c] = fmaf(Tr::to_float(p[2 * c]), fmaf(-fz, xs[0], acc[0][c]), y[c]);
        }
      }
      xs[0] = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[0][c] = 0.f;
      group_left = batches_per_group;
      sz_lane += n4;
    }
    if (more) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) cur[u] = nxt[u];
    }
  }
}

// The block's 4 warps meet: red[w][0][lane * 4 + c] = warp w's y[c]; returns synchronised.
__device__ __forceinline__ void to_red(float (&red)[kWarps][1][kPackedTileCols], const float (&y)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  *reinterpret_cast<float4*>(&red[warp][0][lane * 4]) = make_float4(y[0], y[1], y[2], y[3]);
  __syncthreads();
}

__device__ __forceinline__ float red_sum(const float (&red)[kWarps][1][kPackedTileCols], int tc) {
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += red[w][0][tc];
  return v;
}

// kZero: the block zeroes its share of a.out_sums (moe_gemv_packed_w4_sums), which w2 adds into.
template <typename T, int ACT, bool kH2, bool kZero>
__global__ void __launch_bounds__(kPackedThreads) moe_w13_packed_kernel(MoeGemvArgs a) {
  using Tr = HalfTraits<T>;
  __shared__ __align__(16) float red[kWarps][1][kPackedTileCols];
  pdl_wait();  // the ids come from the routing kernel before this one
  pdl_launch_dependents();
  if constexpr (kZero) {  // after the wait: the buffer may be memory an earlier kernel still read
    moe::zero_share<kPackedThreads>(a.out_sums, static_cast<int64_t>(a.n_assign / a.topk) * a.hidden);
  }
  const int f = blockIdx.z;
  const auto [valid, ex] = expert_of(a, f, false);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k = a.hidden, inter = a.inter, g = a.group13;
  const int i4 = inter / 4;                             // 4-column chunks of each half
  const int gc4 = blockIdx.x * (kTile13 / 4) + (lane & 15);  // the lane's gate chunk
  const bool col_ok = valid && gc4 < i4;
  const int c4 = (lane >> 4) * i4 + (col_ok ? gc4 : 0);  // lanes 16..31: the same chunk of the up half
  const int64_t n4 = inter / 2;  // 16-byte chunks a row of wpacked (2I words) and of szpacked (4I)
  const uint4* wp = reinterpret_cast<const uint4*>(a.w13_qweight) + ex * (k / 8) * n4 + c4;
  const uint4* sz = reinterpret_cast<const uint4*>(a.w13_scales) + ex * (k / g) * n4 + c4;
  const int b_total = k / kPackedBatchRows;
  const int b0 = (blockIdx.y * kWarps + warp) * a.bpw13, b1 = min(b0 + a.bpw13, b_total);
  const uint64_t policy = evict_first_policy();
  uint4 cur[kLoads];
  if (b0 < b1) load_batch(cur, wp + static_cast<int64_t>(b0) * kLoads * n4, n4, col_ok, policy);
  const uint4 sv0 = first_scales<kH2>(sz, n4, col_ok, b0, b1, g);
  float y[4];
  walk<T, kH2, false>(static_cast<const T*>(a.x) + static_cast<int64_t>(f / a.topk) * a.x_stride, wp, sz, n4,
                      col_ok, b0, b1, g, cur, sv0, policy, y);
  to_red(red, y);

  // Thread tc < 64: gate column tc of the tile (red[tc]) and its up column (red[64 + tc]).
  const int tc = threadIdx.x, col = blockIdx.x * kTile13 + tc;
  if (tc >= kTile13 || col >= inter) return;
  const float gate = kUnit<kH2> * red_sum(red, tc), up = kUnit<kH2> * red_sum(red, kTile13 + tc);
  if (gridDim.y == 1) {
    static_cast<T*>(a.h)[static_cast<int64_t>(f) * inter + col] = Tr::from_float(act_fn<ACT>(gate) * up);
    return;
  }
  float* part = a.h_part + (static_cast<int64_t>(blockIdx.y) * a.n_assign + f) * 2 * inter;
  __stcg(part + col, gate);
  __stcg(part + inter + col, up);
}

// kPartAct >= 0: h is w13's split sums in a.h_part (splits13 > 1), added here and passed through
// activation kPartAct. kSums: the weighted tile goes into a.out_sums (zeroed by w13).
template <typename T, bool kH2, int kPartAct, bool kSums>
__global__ void __launch_bounds__(kPackedThreads) moe_w2_packed_kernel(MoeGemvArgs a) {
  using Tr = HalfTraits<T>;
  extern __shared__ __align__(16) uint8_t h_smem[];  // h over the block's K range
  __shared__ __align__(16) float red[kWarps][1][kPackedTileCols];
  __shared__ int is_last;
  const int f = blockIdx.z;
  // The ids were final before any w13 block passed its own wait, which came before w13 let this
  // launch start (pdl_launch_dependents follows the wait); read through L2 (another SM wrote them).
  const auto [valid, ex] = expert_of(a, f, true);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k = a.inter, n = a.hidden, g = a.group2;
  const int64_t n4 = n / 4;
  const int c4 = blockIdx.x * 32 + lane;
  const bool col_ok = valid && c4 < n4;
  const uint4* wp = reinterpret_cast<const uint4*>(a.w2_qweight) + ex * (k / 8) * n4 + (col_ok ? c4 : 0);
  const uint4* sz = reinterpret_cast<const uint4*>(a.w2_scales) + ex * (k / g) * n4 + (col_ok ? c4 : 0);
  const int b_total = k / kPackedBatchRows;
  const int b0 = (blockIdx.y * kWarps + warp) * a.bpw2, b1 = min(b0 + a.bpw2, b_total);
  const int kb0 = blockIdx.y * kWarps * a.bpw2 * kPackedBatchRows;
  const int rows = max(min(kb0 + kWarps * a.bpw2 * kPackedBatchRows, k) - kb0, 0);
  const uint64_t policy = evict_first_policy();
  uint4 cur[kLoads];  // the first batch and its scales, before the wait: no kernel writes the weights
  if (b0 < b1) load_batch(cur, wp + static_cast<int64_t>(b0) * kLoads * n4, n4, col_ok, policy);
  const uint4 sv0 = first_scales<kH2>(sz, n4, col_ok, b0, b1, g);
  pdl_wait();  // h (or its split sums) comes from the w13 launch
  pdl_launch_dependents();

  // Stage h[f, kb0 .. kb0 + rows) in shared memory, 8 rows a thread at a time.
  T* hs = reinterpret_cast<T*>(h_smem);
  for (int r = 8 * threadIdx.x; r < rows; r += 8 * kPackedThreads) {
    if constexpr (kPartAct >= 0) {
      float gate[8] = {}, up[8] = {};
      const float* part = a.h_part + static_cast<int64_t>(f) * 2 * k + kb0 + r;
      const int64_t split_stride = static_cast<int64_t>(a.n_assign) * 2 * k;
      for (int s = 0; s < a.splits13; ++s) {
        const float4* pg = reinterpret_cast<const float4*>(part + s * split_stride);
        const float4* pu = reinterpret_cast<const float4*>(part + s * split_stride + k);
        const float4 g0 = __ldcg(pg), g1 = __ldcg(pg + 1), u0 = __ldcg(pu), u1 = __ldcg(pu + 1);
        const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) gate[j] += gv[j], up[j] += uv[j];
      }
      float hv[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hv[j] = act_fn<kPartAct>(gate[j]) * up[j];
      *reinterpret_cast<uint4*>(hs + r) = pack8<T>(hv);
    } else {
      *reinterpret_cast<uint4*>(hs + r) =
          __ldcg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.h) + static_cast<int64_t>(f) * k + kb0 + r));
    }
  }
  __syncthreads();

  float y[4];
  walk<T, kH2, true>(hs - kb0, wp, sz, n4, col_ok, b0, b1, g, cur, sv0, policy, y);
  to_red(red, y);

  const int tc = threadIdx.x, col = blockIdx.x * kPackedTileCols + tc, t = f / a.topk;
  const float rw = valid ? kUnit<kH2> * a.topk_weights[f] : 0.f;
  const float v = rw * red_sum(red, tc);
  if constexpr (kSums) {
    if (col < n) atomicAdd(a.out_sums + static_cast<int64_t>(t) * n + col, v);
    return;
  }
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(t) * n;
  if (a.topk == 1 && gridDim.y == 1) {
    if (col < n) out[col] = Tr::from_float(v);
    return;
  }
  float* ws = a.ws2 + static_cast<int64_t>(t) * n;
  if (col < n) atomicAdd(ws + col, v);
  if (!moe::arrive_last(a.counters2 + static_cast<int64_t>(t) * gridDim.x + blockIdx.x, a.topk * gridDim.y,
                        is_last)) {
    return;
  }
  if (col < n) {
    const float s = __ldcg(ws + col);
    __stcg(ws + col, 0.f);
    out[col] = Tr::from_float(s);
  }
}

template <typename T, int ACT, bool kH2>
void launch_typed(const MoeGemvArgs& a, cudaStream_t stream) {
  const dim3 grid13(a.tiles13, a.splits13, a.n_assign), grid2(a.tiles2, a.splits2, a.n_assign);
  const size_t smem2 = moe_gemv_packed_smem(a);
  const bool sums = a.out_sums != nullptr, part = a.splits13 > 1;
  if (sums) {
    launch_pdl(moe_w13_packed_kernel<T, ACT, kH2, true>, grid13, dim3(kPackedThreads), 0, stream, a);
  } else {
    launch_pdl(moe_w13_packed_kernel<T, ACT, kH2, false>, grid13, dim3(kPackedThreads), 0, stream, a);
  }
  const auto w2 = [&]<int kPartAct>() {
    if (sums) {
      launch_pdl(moe_w2_packed_kernel<T, kH2, kPartAct, true>, grid2, dim3(kPackedThreads), smem2, stream, a);
    } else {
      launch_pdl(moe_w2_packed_kernel<T, kH2, kPartAct, false>, grid2, dim3(kPackedThreads), smem2, stream, a);
    }
  };
  if (part) {
    w2.template operator()<ACT>();
  } else {
    w2.template operator()<-1>();
  }
}

template <typename T>
void launch_act(const MoeGemvArgs& a, cudaStream_t stream) {
  const bool h2 = gemv::h2_enabled<T>() && !a.packed_fp32;
  const auto go = [&]<int ACT>() {
    if (h2) {
      launch_typed<T, ACT, true>(a, stream);
    } else {
      launch_typed<T, ACT, false>(a, stream);
    }
  };
  switch (a.act) {
    case 0: go.template operator()<0>(); break;
    case 1: go.template operator()<1>(); break;
    default: go.template operator()<2>(); break;
  }
}

}  // namespace

void launch_moe_gemv_packed(const MoeGemvArgs& a, cudaStream_t stream) {
  if (a.dtype == HalfType::kHalf) {
    launch_act<__half>(a, stream);
  } else {
    launch_act<__nv_bfloat16>(a, stream);
  }
}

}  // namespace fastawq
