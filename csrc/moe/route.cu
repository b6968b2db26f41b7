// An MoE block's routing for a few tokens (decode) in one launch: the router GEMV x · W^T and the
// top-k choice, and optionally the add + RMSNorm before them (ops.add_rms_norm_route's
// h = RMSNorm(x + residual) * (w + offset), which the experts then read). Two forms: the cluster
// kernel further down (sm_90, the automatic choice for 16 <= E <= 128, backend.ROUTE_CUDA_EXPERTS)
// and this part kernel (everywhere else it fits, e.g. before sm_90 or E > 128; slower than
// Triton's launches on the H200, so only backend="cuda" runs it there).
//
// Grid (parts, T), 4 warps a block. Block p scores experts 8p .. 8p + 7 of token blockIdx.y: its
// 128 threads take the row in chunks of 8 elements (thread i chunks i + 128 j, j < J; J and the
// load width are template arguments: 16-byte loads where every row is 16-byte aligned, else
// element by element), about 8 loads a thread in flight, and the warps' partial logits meet in
// shared memory. Every loop is sized at compile time: two first versions unrolled over the
// largest H and E with run-time guards and spent most cycles waiting on instruction fetch (ncu).
// With the norm every block first sums the squares of its token's row (so no block waits for
// another); the sum x + residual and h are each rounded to x's dtype, as add_rms_norm rounds them,
// and part 0 writes both. Each logit is rounded to the router's dtype, as F.linear returns it.
// The router and norm weights are never written by a kernel of the step: they are brought into
// L2 before the PDL wait, so the loads after it do not go to DRAM.
// With one part (E <= 8) the block chooses alone; with more, the parts publish their logits (an
// fp32 scratch) and the last to arrive for the token chooses (moe::arrive_last re-arms the
// counter: no memset in a captured step).
// The choice, in one warp over shared memory: softmax or sigmoid scores, plus the correction bias
// for choosing only, then k rounds of a warp arg-max by redux.sync (ties to the lowest index, as the
// Triton kernel), the chosen scores renormalised and times `scale`.
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdint>

#include <cooperative_groups.h>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "moe/moe_common.cuh"

namespace fastawq {
namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Chunk p[0 .. 7] packed in T, elements at or past `left` as 0: one 16-byte load when VEC.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 load_chunk(const T* p, int left) {
  if constexpr (VEC) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    T h[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = i < left ? p[i] : HalfTraits<T>::from_float(0.f);
    return *reinterpret_cast<const uint4*>(h);
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_chunk(T* p, int left, uint4 v) {
  if constexpr (VEC) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < left) p[i] = h[i];
  }
}

// x + residual for one 8-element chunk, rounded to T as add_rms_norm rounds it (the new residual,
// returned packed); its squares are added to ss.
template <typename T>
__device__ __forceinline__ uint4 add_chunk(uint4 x, uint4 r, float& ss) {
  float xf[8], rf[8];
  unpack8<T>(x, xf);
  unpack8<T>(r, rf);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    xf[i] = round_to<T>(xf[i] + rf[i]);
    ss = fmaf(xf[i], xf[i], ss);
  }
  return pack8<T>(xf);
}

// RMSNorm of one chunk of the new residual: v * rstd * (w + offset), rounded to T.
template <typename T>
__device__ __forceinline__ uint4 norm_chunk(uint4 v, uint4 w, float rstd, float offset) {
  float vf[8], wf[8];
  unpack8<T>(v, vf);
  unpack8<T>(w, wf);
#pragma unroll
  for (int i = 0; i < 8; ++i) vf[i] = vf[i] * rstd * (wf[i] + offset);
  return pack8<T>(vf);
}

// Lines of `bytes` bytes from p into L2, the warp's lanes taking every 32nd 128-byte line.
__device__ __forceinline__ void prefetch_row(const void* p, int64_t bytes, int lane) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 128 * int64_t(lane); off < bytes + 127; off += 128 * 32) prefetch_l2(c + min(off, bytes - 1));
}

struct RouteSmem {
  float part_sums[kWarps][kRouteBlockExperts + 1];  // the warps' partial logits, and the norm's sum
  float score[kRouteMaxExperts];                    // the chooser's scores
  float choice[kRouteMaxExperts];                   // and what it chooses by (-inf once taken)
  int is_last;
};

// A float's order as an unsigned key: larger values give larger keys, NaN sorts below every number,
// and 0 and 1 stay free (0: taken).
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 1u;
  const uint32_t b = __float_as_uint(v);
  return max((b & 0x80000000u) ? ~b : (b | 0x80000000u), 2u);
}

// Token tok's top-k from sm.score[0 .. E) holding its logits, by one warp; lane j < k writes
// choice j.
__device__ __forceinline__ void choose(const RouteArgs& a, int tok, int lane, RouteSmem& sm) {
  const int E = a.experts;
  float m = -FLT_MAX;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, sm.score[e]);
  m = warp_max(m);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float x = sm.score[e];
    const float p = a.sigmoid ? 1.f / (1.f + __expf(-x)) : __expf(x - m);
    sm.score[e] = p;
    sum += p;
  }
  sum = a.sigmoid ? 1.f : warp_sum(sum);
  for (int e = lane; e < E; e += 32) {
    const float p = a.sigmoid ? sm.score[e] : __fdiv_rn(sm.score[e], sum);
    sm.score[e] = p;
    sm.choice[e] = p + (a.bias != nullptr ? a.bias[e] : 0.f);
  }
  __syncwarp();
  // k rounds of a warp arg-max on order keys (a larger value, a larger key; NaN below every number,
  // 0 once taken), two single-instruction warp reductions a round: the largest key, then the lowest
  // index holding it (ties to the lowest index, as the Triton kernel). A lane scans only its own
  // experts e = lane + 32 i, so marking one taken needs no barrier.
  uint32_t* key = reinterpret_cast<uint32_t*>(sm.choice);
  for (int e = lane; e < E; e += 32) key[e] = order_key(sm.choice[e]);
  float my_w = 0.f;
  int my_id = 0;
  for (int j = 0; j < a.k; ++j) {
    uint32_t bk = 0u;
    int bi = INT_MAX;
    for (int e = lane; e < E; e += 32) {  // ascending: strictly greater keeps the lowest of ties
      const uint32_t c = key[e];
      if (c > bk) bk = c, bi = e;
    }
    const uint32_t top = __reduce_max_sync(kFull, bk);
    const int win = __reduce_min_sync(kFull, bk == top ? bi : INT_MAX);
    if (lane == j) my_w = sm.score[win], my_id = win;
    if (lane == (win & 31)) key[win] = 0u;
  }
  const float total = warp_sum(lane < a.k ? my_w : 0.f);
  if (a.renorm) my_w = __fdiv_rn(my_w, fmaxf(total, 1e-20f));
  if (lane < a.k) {
    a.weights[int64_t(tok) * a.k + lane] = my_w * a.scale;
    a.ids[int64_t(tok) * a.k + lane] = my_id;
  }
}

// J: 8-element chunks a thread (H <= 1024 J); VEC: 16-byte loads.
template <typename T, bool NORM, bool VEC, int J>
__global__ void __launch_bounds__(kThreads) moe_route_kernel(RouteArgs a) {
  __shared__ RouteSmem sm;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tok = blockIdx.y, H = a.hidden, E = a.experts;
  const int chunks = (H + 7) / 8;
  const int e0 = blockIdx.x * kRouteBlockExperts, ne = min(kRouteBlockExperts, E - e0);
  const T* router = static_cast<const T*>(a.router) + int64_t(e0) * H;
  for (int ee = warp; ee < ne; ee += kWarps) prefetch_row(router + int64_t(ee) * H, 2 * int64_t(H), lane);
  if (NORM && warp == 0) prefetch_row(a.norm_weight, 2 * int64_t(H), lane);

  pdl_wait();  // x (and the residual) come from the kernels before
  pdl_launch_dependents();
  const T* xr = static_cast<const T*>(a.x) + int64_t(tok) * a.x_stride;
  const auto chunk_of = [&](int j) { return int(threadIdx.x) + kThreads * j; };
  // This thread's chunks of the routed input, packed in x's dtype (zeros past the row).
  uint4 hw[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int c = chunk_of(j);
    hw[j] = c < chunks ? load_chunk<T, VEC>(xr + 8 * c, H - 8 * c) : make_uint4(0u, 0u, 0u, 0u);
  }
  if constexpr (NORM) {
    const T* rr = static_cast<const T*>(a.residual) + int64_t(tok) * H;
    const T* nw = static_cast<const T*>(a.norm_weight);
    uint4 rw[J], nww[J];  // the residual's and the norm weight's chunks
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = chunk_of(j);
      rw[j] = nww[j] = make_uint4(0u, 0u, 0u, 0u);
      if (c < chunks) {
        rw[j] = load_chunk<T, VEC>(rr + 8 * c, H - 8 * c);
        nww[j] = load_chunk<T, VEC>(nw + 8 * c, H - 8 * c);
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) hw[j] = add_chunk<T>(hw[j], rw[j], ss);  // the new residual
    ss = warp_sum(ss);
    if (lane == 0) sm.part_sums[warp][kRouteBlockExperts] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += sm.part_sums[w][kRouteBlockExperts];
    const float rstd = rsqrtf(__fdiv_rn(total, static_cast<float>(H)) + a.eps);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = chunk_of(j);
      const uint4 h = norm_chunk<T>(hw[j], nww[j], rstd, a.offset);
      if (blockIdx.x == 0 && c < chunks) {  // part 0 writes h and the new residual
        store_chunk<T, VEC>(static_cast<T*>(a.h) + int64_t(tok) * H + 8 * c, H - 8 * c, h);
        store_chunk<T, VEC>(static_cast<T*>(a.res_out) + int64_t(tok) * H + 8 * c, H - 8 * c, hw[j]);
      }
      hw[j] = h;  // zeros past the row stay zeros
    }
  }

  // The block's experts, about 8 chunk loads a thread in flight (all 8 experts' loads at once and
  // the 8 warp sums after them measured slower: Mixtral 6.2 -> 9.7 us).
  constexpr int kUnroll = J >= 8 ? 1 : 8 / J;
#pragma unroll kUnroll
  for (int ee = 0; ee < ne; ++ee) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = chunk_of(j);
      if (c >= chunks) continue;
      float wf[8], hf[8];
      unpack8<T>(load_chunk<T, VEC>(router + int64_t(ee) * H + 8 * c, H - 8 * c), wf);
      unpack8<T>(hw[j], hf);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(wf[i], hf[i], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) sm.part_sums[warp][ee] = acc;
  }
  __syncthreads();
  float logit = 0.f;  // thread ee < ne: expert e0 + ee, rounded to the router's dtype
  if (threadIdx.x < ne) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) logit += sm.part_sums[w][threadIdx.x];
    logit = round_to<T>(logit);
  }

  if (a.parts == 1) {
    if (threadIdx.x < ne) sm.score[threadIdx.x] = logit;
    __syncthreads();
    if (warp == 0) choose(a, tok, lane, sm);
    return;
  }
  float* mine = a.logits + int64_t(tok) * E;
  if (threadIdx.x < ne) mine[e0 + threadIdx.x] = logit;
  if (!moe::arrive_last(a.counters + tok, a.parts, sm.is_last)) return;
  for (int e = threadIdx.x; e < E; e += kThreads) sm.score[e] = __ldcg(mine + e);
  __syncthreads();
  if (warp == 0) choose(a, tok, lane, sm);
}

// The cluster form (sm_90), for decode, where the routing sits on the critical path between two
// kernels: grid (C, T) in clusters of C <= 8 blocks, one cluster a token, block r scoring experts
// r * EB .. r * EB + EB - 1. Before the PDL wait -- while the kernel before still runs -- each block
// copies its EB router rows (and the norm weight) into shared memory: nothing a kernel of the step
// writes. After it the work per thread is kept short, since a few warps an SM run it and each
// thread's chain of instructions is the time: thread i holds chunks i + 256 j (J of them) of the
// token's row, the norm's sum of squares is one block reduction, and each thread's EB partial dot
// products are summed across its warp by halving exchanges (EB values in 31 shuffles) and across
// the warps in shared memory. Each logit goes into the leader block's shared memory (distributed
// shared memory); one cluster barrier, and the leader's warp 0 chooses. Against the part kernel
// above there is no round trip of the logits through global memory, no arrival counter and
// fences, and no router load after the wait.
template <int EB>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[EB], int lane, int& idx) {
  // After the step with offset o, a lane keeps the half of its values named by its bit o; when one
  // value is left the remaining offsets add plainly. idx: which of the EB values the lane ends with.
  idx = 0;
  int n = EB;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (n > 1) {
      const int half = n / 2;
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int i = 0; i < EB / 2; ++i) {
        if (i < half) {
          const float send = upper ? v[i] : v[i + half];
          const float keep = upper ? v[i + half] : v[i];
          v[i] = keep + __shfl_xor_sync(kFull, send, o);
        }
      }
      idx += upper ? half : 0;
      n = half;
    } else {
      v[0] += __shfl_xor_sync(kFull, v[0], o);
    }
  }
  return v[0];
}

template <typename T, bool NORM, int J, int EB>
__global__ void __launch_bounds__(kRouteClusterThreads) moe_route_cluster_kernel(RouteArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int kW = kRouteClusterThreads / 32;
  extern __shared__ __align__(16) uint8_t route_smem[];
  __shared__ RouteSmem sm;
  __shared__ float red[kW][EB > 1 ? EB : 2];
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tok = blockIdx.y, H = a.hidden, E = a.experts;
  const int chunks = H / 8;  // the host sends only H % 8 == 0 with 16-byte aligned rows
  const int rank = static_cast<int>(cluster.block_rank());
  const int e0 = rank * EB, ne = min(EB, E - e0);
  const uint32_t rows_s = smem_addr(route_smem);                   // [EB][H] in x's dtype
  const uint32_t nw_s = rows_s + static_cast<uint32_t>(EB) * H * 2;  // [H] (NORM)
  {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(a.router) + int64_t(e0) * H);
    for (int i = threadIdx.x; i < ne * chunks; i += kRouteClusterThreads) cp_async16_at(rows_s + 16 * i, src + i, true);
    if constexpr (NORM) {
      const uint4* nw = static_cast<const uint4*>(a.norm_weight);
      for (int i = threadIdx.x; i < chunks; i += kRouteClusterThreads) cp_async16_at(nw_s + 16 * i, nw + i, true);
    }
    cp_async_commit();
  }
  // Distributed shared memory may be written only once its block runs: arrive now, wait before
  // the first remote write (long over by then).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  pdl_wait();  // x (and the residual) come from the kernels before
  // The next kernel (the experts) may launch now and wait inside itself; with late_trigger only
  // as these blocks exit, so its one-wave grid does not share SMs with them (an A/B switch).
  if (!a.late_trigger) pdl_launch_dependents();
  const T* xr = static_cast<const T*>(a.x) + int64_t(tok) * a.x_stride;
  uint4 hw[J];  // the thread's chunks threadIdx.x + 256 j of the routed input (zeros past the row)
  if (NORM && a.x_f32) {
    // x is fp32 sums (FASTAWQ_MOE_O_SUMS: o_proj's), rounded to T as add_rms_norm rounds fp32 x.
    const float* xf = static_cast<const float*>(a.x) + int64_t(tok) * a.x_stride;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = threadIdx.x + kRouteClusterThreads * j;
      if (c < chunks) {
        const float4 lo = __ldcg(reinterpret_cast<const float4*>(xf + 8 * c));
        const float4 hi = __ldcg(reinterpret_cast<const float4*>(xf + 8 * c) + 1);
        const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        hw[j] = pack8<T>(f);
      } else {
        hw[j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = threadIdx.x + kRouteClusterThreads * j;
      hw[j] = c < chunks ? *reinterpret_cast<const uint4*>(xr + 8 * c) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if constexpr (NORM) {
    const T* rr = static_cast<const T*>(a.residual) + int64_t(tok) * H;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = threadIdx.x + kRouteClusterThreads * j;
      if (c < chunks) hw[j] = add_chunk<T>(hw[j], *reinterpret_cast<const uint4*>(rr + 8 * c), ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp][0] = ss;
    cp_async_wait<0>();
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) total += red[w][0];
    const float rstd = rsqrtf(__fdiv_rn(total, static_cast<float>(H)) + a.eps);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = threadIdx.x + kRouteClusterThreads * j;
      if (c >= chunks) continue;
      const uint4 h = norm_chunk<T>(hw[j], ld_shared128_at(nw_s + 16 * c), rstd, a.offset);
      if (rank == 0) {  // block 0 writes h and the new residual
        *reinterpret_cast<uint4*>(static_cast<T*>(a.h) + int64_t(tok) * H + 8 * c) = h;
        *reinterpret_cast<uint4*>(static_cast<T*>(a.res_out) + int64_t(tok) * H + 8 * c) = hw[j];
      }
      hw[j] = h;
    }
    __syncthreads();  // red is reused below
  } else {
    cp_async_wait<0>();
    __syncthreads();
  }

  float part[EB];  // this thread's share of each of the block's experts
#pragma unroll
  for (int ee = 0; ee < EB; ++ee) part[ee] = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int c = threadIdx.x + kRouteClusterThreads * j;
    if (c >= chunks) continue;
    float hf[8];
    unpack8<T>(hw[j], hf);
#pragma unroll
    for (int ee = 0; ee < EB; ++ee) {
      if (ee < ne) {
        float wf[8];
        unpack8<T>(ld_shared128_at(rows_s + static_cast<uint32_t>(ee) * H * 2 + 16 * c), wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) part[ee] = fmaf(wf[i], hf[i], part[ee]);
      }
    }
  }
  int idx = 0;
  const float wsum = warp_reduce_scatter<EB>(part, lane, idx);
  // Lanes that hold expert idx: the first of each group of 32 / EB lanes writes it.
  if ((lane & (32 / EB - 1)) == 0) red[warp][idx] = wsum;
  __syncthreads();
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  if (threadIdx.x < ne) {
    float logit = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) logit += red[w][threadIdx.x];
    float* leader_score = cluster.map_shared_rank(sm.score, 0);
    leader_score[e0 + threadIdx.x] = round_to<T>(logit);  // rounded to the router's dtype
  }
  cluster.sync();  // every logit is in the leader's shared memory
  if (rank == 0 && warp == 0) choose(a, tok, lane, sm);
#endif
}

// One instance: above 48 KB of dynamic shared memory a kernel must opt in, once per device.
template <typename T, bool NORM, int J, int EB>
void launch_cluster_j(const RouteArgs& a, cudaStream_t stream) {
  constexpr auto kernel = moe_route_cluster_kernel<T, NORM, J, EB>;
  static std::atomic<uint64_t> opted{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((opted.load(std::memory_order_relaxed) & bit) == 0) {
    // As much as the device allows next to the static shared memory (the host entry sized the
    // request within it): GPUs of sm_90 and later differ (227 KB on the H100 / H200, 99 KB on sm_120).
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attrs{};
    cudaFuncGetAttributes(&attrs, kernel);
    const int room = optin - static_cast<int>(attrs.sharedSizeBytes);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, room < kRouteClusterSmem ? room : kRouteClusterSmem);
    opted.fetch_or(bit, std::memory_order_relaxed);
  }
  const int clusters = (a.experts + EB - 1) / EB;
  const int smem = (EB + (NORM ? 1 : 0)) * a.hidden * 2;
  launch_pdl_cluster(kernel, dim3(clusters, a.t), dim3(kRouteClusterThreads), smem, stream, clusters, a);
}

template <typename T, bool NORM, int J>
void launch_cluster_eb(const RouteArgs& a, cudaStream_t stream) {
  switch (a.cluster_experts) {
    case 1: return launch_cluster_j<T, NORM, J, 1>(a, stream);
    case 2: return launch_cluster_j<T, NORM, J, 2>(a, stream);
    case 4: return launch_cluster_j<T, NORM, J, 4>(a, stream);
    case 8: return launch_cluster_j<T, NORM, J, 8>(a, stream);
    default: return launch_cluster_j<T, NORM, J, 16>(a, stream);
  }
}

template <typename T, bool NORM>
void launch_cluster(const RouteArgs& a, cudaStream_t stream) {
  const int j = (a.hidden / 8 + kRouteClusterThreads - 1) / kRouteClusterThreads;
  if (j <= 1) return launch_cluster_eb<T, NORM, 1>(a, stream);
  if (j <= 2) return launch_cluster_eb<T, NORM, 2>(a, stream);
  launch_cluster_eb<T, NORM, 4>(a, stream);
}

template <typename T, bool NORM, bool VEC>
void launch_vec(const RouteArgs& a, cudaStream_t stream) {
  const dim3 grid(a.parts, a.t);
  const int j = (a.hidden + 8 * kThreads - 1) / (8 * kThreads);
  if (j <= 2) return launch_pdl(moe_route_kernel<T, NORM, VEC, 2>, grid, dim3(kThreads), 0, stream, a);
  if (j <= 4) return launch_pdl(moe_route_kernel<T, NORM, VEC, 4>, grid, dim3(kThreads), 0, stream, a);
  launch_pdl(moe_route_kernel<T, NORM, VEC, kRouteMaxChunks>, grid, dim3(kThreads), 0, stream, a);
}

template <typename T, bool NORM>
void launch_norm(const RouteArgs& a, cudaStream_t stream) {
  if (a.cluster_experts > 0) return launch_cluster<T, NORM>(a, stream);
  if (a.vec) return launch_vec<T, NORM, true>(a, stream);
  launch_vec<T, NORM, false>(a, stream);
}

template <typename T>
void launch_typed(const RouteArgs& a, cudaStream_t stream) {
  if (a.residual != nullptr) return launch_norm<T, true>(a, stream);
  launch_norm<T, false>(a, stream);
}

}  // namespace

void launch_moe_route(const RouteArgs& a, cudaStream_t stream) {
  if (a.dtype == HalfType::kHalf) return launch_typed<__half>(a, stream);
  launch_typed<__nv_bfloat16>(a, stream);
}

}  // namespace fastawq
