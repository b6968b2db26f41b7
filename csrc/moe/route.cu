// An MoE block's routing for a few tokens (decode) in one launch: the router GEMV x · W^T and the
// top-k choice, and optionally the add + RMSNorm before them (ops.add_rms_norm_route's
// h = RMSNorm(x + residual) * (w + offset), which the experts then read). Not the automatic
// choice yet (backend.ROUTE_CUDA): on the H200 it is still slower than Triton's launches.
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
// for choosing only, then k rounds of a warp arg-max (ties to the lowest index, as the Triton
// kernel), the chosen scores renormalised and times `scale`.
#include <cfloat>
#include <climits>
#include <cstdint>

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

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return HalfTraits<T>::to_float(HalfTraits<T>::from_float(v));
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

template <typename T>
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = HalfTraits<T>::to_float2(w[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(HalfTraits<T>::from_float2(f[0], f[1]), HalfTraits<T>::from_float2(f[2], f[3]), HalfTraits<T>::from_float2(f[4], f[5]), HalfTraits<T>::from_float2(f[6], f[7]));
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
  // kNone: no candidate yet (a NaN score is still taken in its turn, so k distinct ids come out).
  constexpr int kNone = INT_MAX;
  float my_w = 0.f;
  int my_id = 0;
  for (int j = 0; j < a.k; ++j) {
    float bv = -FLT_MAX;
    int bi = kNone;
    for (int e = lane; e < E; e += 32) {  // ascending: strictly greater keeps the lowest of ties
      const float c = sm.choice[e];
      if (c != -INFINITY && (bi == kNone || c > bv)) bv = c, bi = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFull, bv, o);
      const int oi = __shfl_xor_sync(kFull, bi, o);
      if (oi != kNone && (bi == kNone || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
    }
    bi = __shfl_sync(kFull, bi, 0);  // one answer even where NaN scores leave the order partial
    if (lane == j) my_w = sm.score[bi], my_id = bi;
    __syncwarp();
    if (lane == 0) sm.choice[bi] = -INFINITY;
    __syncwarp();
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
    for (int j = 0; j < J; ++j) {
      float xf[8], rf[8];
      unpack8<T>(hw[j], xf);
      unpack8<T>(rw[j], rf);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xf[i] = round_to<T>(xf[i] + rf[i]);  // the new residual
        ss = fmaf(xf[i], xf[i], ss);
      }
      hw[j] = pack8<T>(xf);
    }
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
      float rf[8], wf[8];
      unpack8<T>(hw[j], rf);
      unpack8<T>(nww[j], wf);
#pragma unroll
      for (int i = 0; i < 8; ++i) rf[i] = rf[i] * rstd * (wf[i] + a.offset);
      const uint4 h = pack8<T>(rf);
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
