// Flash-decoding: one query token per row over the first lens[b] positions of a KV cache, GQA.
//
// Grid (splits, HKV, B), 4 warps per block. A block owns one KV head of one row over one slice
// of the sequence; its warps take 16-key tiles in turn. Per tile a warp runs two tensor-core
// products with every query head of the KV head in the same fragments, so each K/V byte is
// loaded once for the whole group:
//   S [heads, 16 keys] = Q [heads, D] · K^T          (heads on the mma's M: 16, group <= 8 used)
//   O^T [D, heads]    += V^T [D, 16 keys] · P^T      (heads on N: 8)
// The accumulator layout of the first product is the operand layout of the second, so the
// probabilities never leave registers. K and V are read straight from global memory with 16-byte
// loads; the contraction dimension is permuted (the same way on both sides) so that each loaded
// 16 bytes is a fragment as it stands, with no shared-memory staging (each byte is used once).
// The grid's splits follow the cache capacity; the kernel sizes them by the length it reads: a
// multiple of 64 keys each (16 for each warp), only the first ceil(len / that) doing any work.
// With one such split it writes the output itself. Otherwise the working splits write fp32
// partials and the last of them to arrive combines them and re-arms its counter, so one launch
// does the whole step and a graph replays it as is. The rope form (rope_decode_attention) also does
// rope_kv_cache's work for the step's token: see RopeSmem.
// CLUSTER (FASTAWQ_ATTN_CLUSTER=1, sm_90; an A/B switch): the grid runs in clusters of C splits of
// one (row, KV head), and where every working split lies in the first cluster (active <= C: up to
// 512 keys with 64-key splits) the splits meet in distributed shared memory instead: each leaves its
// (m, l, acc) in its own shared memory, one cluster barrier, split 0 combines from its peers'
// shared memory and writes the output, a second barrier keeps the peers' memory alive until it has.
// The global path's chain -- fence, arrival count, the partials read back through L2 -- cost ~2.9
// us at 128 keys (RESULTS.md session 15: 3.70 us at 64 keys, one split; 6.57 at 128, two).
#include <cfloat>
#include <cstdint>

#include <cooperative_groups.h>

#include "attention/launch_attention.h"
#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"

namespace fastawq {
namespace {

// Thread-block clusters and distributed shared memory exist from sm_90; the CLUSTER instances built
// for older GPUs keep the global combine (the host launches them on sm_90 only).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kClusterArch = true;
__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }
#else
constexpr bool kClusterArch = false;
__device__ __forceinline__ void cluster_sync() {}
#endif

// Positions past a split's end are never read (their memory may hold anything, even NaN):
// the predicated load leaves zeros, which the -inf scores then weigh by exactly 0.
__device__ __forceinline__ uint4 ld16(const void* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ok) v = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}

// The rope form with qkv_f32: eight fp32 sums at p (32-byte aligned), rounded to T as read (what
// the QKV projection's split-K tail would have stored), through L2 (__ldcg: the projection's
// reductions went there).
template <typename T>
__device__ __forceinline__ uint4 ld16_from_f32(const float* p, bool ok) {
  if (!ok) return make_uint4(0u, 0u, 0u, 0u);
  const float4 lo = __ldcg(reinterpret_cast<const float4*>(p)), hi = __ldcg(reinterpret_cast<const float4*>(p) + 1);
  const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  return pack8<T>(f);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v) {
  uint2 w;
  w.x = HalfTraits<T>::from_float2(v.x, v.y);
  w.y = HalfTraits<T>::from_float2(v.z, v.w);
  *reinterpret_cast<uint2*>(dst) = w;
}

__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
  acc.x += w * x.x;
  acc.y += w * x.y;
  acc.z += w * x.z;
  acc.w += w * x.w;
}

// A split's first key and its key count for a length (a multiple of kDecodeSplitKeys, at least
// min_split_keys; 0 when len is 0).
__device__ __forceinline__ int keys_per_split(int len, int splits, int min_split_keys) {
  return max(((len + splits - 1) / splits + kDecodeSplitKeys - 1) / kDecodeSplitKeys * kDecodeSplitKeys,
             min_split_keys);
}

// The rope form (DecodeAttentionArgs::rope). Before the PDL wait -- nothing a kernel of the step
// writes -- each block stages in shared memory the cos and sin rows of the position positions[b]
// holds then (a hint: checked after the wait, restaged if it moved) and the q/k norm weights.
// After it every lane rotates its Q fragment (chunks 4p + t of head g) and the same chunks of the
// new K row in registers: chunk 4p + t pairs with 4p + t + D/16 = 4 (p + KP/2) + t, so each
// rotate-half pair is in one lane, and a head's RMSNorm sums over its four lanes t. The new K and
// V rows join the tile that holds the position straight from registers (the cache is not read back),
// and one warp writes them into the caches for the steps after. The roundings are rope_kv_cache's
// (reference.py): the normalised head to T, times the weight to T, the rotation in fp32 to T.
template <typename T, int D>
struct RopeSmem {
  float tab[2][D];  // cos, sin at the position
  T norm[2][D];     // q_norm, k_norm weights
};

template <typename T, int D>
__device__ __forceinline__ void rope_stage(const DecodeAttentionArgs& a, int pos, RopeSmem<T, D>& rs, int tid) {
  constexpr int TC = D / 4;  // 16-byte chunks of a table row
  constexpr int NC = D / 8;  // of a norm weight
  const int64_t row = min(max(pos, 0), a.rope_rows - 1);
  const int n = 2 * TC + (a.q_norm != nullptr ? 2 * NC : 0);
  for (int i = tid; i < n; i += kDecodeWarps * 32) {
    if (i < 2 * TC) {
      const float* src = (i < TC ? a.rope_cos : a.rope_sin) + row * D + 4 * (i % TC);
      cp_async16_at(smem_addr(&rs.tab[i / TC][4 * (i % TC)]), src, true);
    } else {
      const int j = i - 2 * TC;
      const T* src = static_cast<const T*>(j < NC ? a.q_norm : a.k_norm) + 8 * (j % NC);
      cp_async16_at(smem_addr(&rs.norm[j / NC][8 * (j % NC)]), src, true);
    }
  }
  cp_async_commit();
}

// Chunks 4p + t (p < KP) of one head, RMSNorm'd over the head (when norm) with the staged weight
// `which` (0: q_norm, 1: k_norm), then rotated by the staged tables.
template <typename T, int D>
__device__ __forceinline__ void rope_chunks(uint4 (&c)[D / 32], const RopeSmem<T, D>& rs, int which, bool norm,
                                            float eps, int t) {
  constexpr int KP = D / 32;
  float x[KP][8];
#pragma unroll
  for (int p = 0; p < KP; ++p) unpack8<T>(c[p], x[p]);
  if (norm) {
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < KP; ++p) {
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(x[p][i], x[p][i], ss);
    }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    const float r = rsqrtf(ss * (1.f / D) + eps);
#pragma unroll
    for (int p = 0; p < KP; ++p) {
      float w[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(&rs.norm[which][(4 * p + t) * 8]), w);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[p][i] = round_to<T>(round_to<T>(x[p][i] * r) * w[i]);
    }
  }
#pragma unroll
  for (int p = 0; p < KP / 2; ++p) {
    const int d1 = (4 * p + t) * 8, d2 = d1 + D / 2;
    float o1[8], o2[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x1 = x[p][i], x2 = x[p + KP / 2][i];
      o1[i] = x1 * rs.tab[0][d1 + i] - x2 * rs.tab[1][d1 + i];
      o2[i] = x2 * rs.tab[0][d2 + i] + x1 * rs.tab[1][d2 + i];
    }
    c[p] = pack8<T>(o1);
    c[p + KP / 2] = pack8<T>(o2);
  }
}

// PREFETCH (the default; FASTAWQ_ATTN_PREFETCH=0 turns it off): the split's K and V rows into L2
// before the PDL wait. ROPE: the rope form (DecodeAttentionArgs::rope). CLUSTER: launched in
// clusters of a.cluster splits, combining through distributed shared memory where it can (above).
template <typename T, int D, bool PREFETCH, bool ROPE, bool CLUSTER = false>
__global__ void __launch_bounds__(kDecodeWarps * 32) decode_attention_kernel(const DecodeAttentionArgs a) {
  constexpr int KP = D / 32;  // pairs of k-steps over D in QK: one 16-byte chunk per lane each
  constexpr int VC = D / 64;  // 16-byte chunks of a V row per lane
  constexpr int MT = D / 16;  // m-tiles of O^T
  constexpr int NW = kDecodeWarps;
  constexpr int G = kDecodeMaxGroup;
  constexpr int D4 = D / 4;

  __shared__ __align__(16) float sm_o[NW][G][D];
  __shared__ float sm_m[NW][G];
  __shared__ float sm_l[NW][G];
  __shared__ float2 sm_ml[kDecodeMaxSplits][G];
  __shared__ float sm_w[kDecodeMaxSplits][G];
  __shared__ int sm_last;
  __shared__ __align__(16) RopeSmem<T, ROPE ? D : 8> sm_rope;
  // CLUSTER: the block's merged (running max, sum) per head; its acc is left in sm_o[0].
  __shared__ float sm_pm[CLUSTER ? G : 1], sm_pl[CLUSTER ? G : 1];

  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma row group: query head (QK), d-row (PV), key row (K loads)
  const int t = lane & 3;   // mma thread in group: key pair (QK), head pair (PV)
  const int group = a.group;
  const int splits = a.splits;
  if constexpr (PREFETCH) {
    // While the rope kernel runs. Only a hint: the newest row, which rope is writing, is read after
    // the wait (L2 holds rope's write), and a stale length moves only what is prefetched.
    const int len0 = min(max(a.lens[b], 0), a.seq_cap);
    const int per0 = keys_per_split(len0, splits, a.min_split_keys);
    const char* kr = reinterpret_cast<const char*>(static_cast<const T*>(a.k_cache) + b * a.k_sb + kvh * a.k_sh);
    const char* vr = reinterpret_cast<const char*>(static_cast<const T*>(a.v_cache) + b * a.v_sb + kvh * a.v_sh);
    for (int row = split * per0 + tid; row < min(split * per0 + per0, len0); row += kDecodeWarps * 32) {
#pragma unroll
      for (int off = 0; off < D * 2; off += 128) {
        prefetch_l2(kr + row * a.k_ss * 2 + off);
        prefetch_l2(vr + row * a.v_ss * 2 + off);
      }
    }
  }
  int pos = 0;  // the rope form's new position
  if constexpr (ROPE) {
    pos = a.positions[b];
    rope_stage<T, D>(a, pos, sm_rope, tid);
  }
  pdl_wait();  // q and the cache row (the rope form: qkv) come from the kernel before this one
  pdl_launch_dependents();

  // The length is read here, not on the host: the grid depends only on the cache capacity.
  const int len = min(max(__ldg(a.lens + b), 0), a.seq_cap);
  const int per_split = keys_per_split(len, splits, a.min_split_keys);
  // The splits that hold keys; every block computes the same from the same length. One (or none,
  // len 0: zeros) and split 0 writes out directly; the others have nothing to do, not even arrive.
  const int active = per_split > 0 ? (len + per_split - 1) / per_split : 0;
  const bool direct = active <= 1;
  // CLUSTER: the working splits all in this (row, KV head)'s first cluster meet there (uniform
  // over the cluster: its blocks share b, kvh and so len). Its idle blocks still take both barriers.
  const bool dsmem = CLUSTER && kClusterArch && !direct && active <= a.cluster;
  if (split >= (direct ? 1 : active)) {
    if constexpr (ROPE) cp_async_wait<0>();  // no copy into shared memory outlives its block
    if (dsmem && split < a.cluster) {
      cluster_sync();
      cluster_sync();
    }
    return;
  }
  const int start = split * per_split;
  const int end = min(start + per_split, len);

  const T* q = static_cast<const T*>(a.q);
  const T* kbase = static_cast<const T*>(a.k_cache) + b * a.k_sb + kvh * a.k_sh;
  const T* vbase = static_cast<const T*>(a.v_cache) + b * a.v_sb + kvh * a.v_sh;
  T* out = static_cast<T*>(a.out);
  const int64_t head0 = static_cast<int64_t>(kvh) * group;

  {
    // Q fragment of head g: in k-step 2p the lane's logical k {2t, 2t+1, 2t+8, 2t+9} are the
    // physical dims 8c + {0, 1, 2, 3} of chunk c = 4p + t, in k-step 2p+1 dims 8c + {4..7}.
    uint4 qf[KP];
    // The rope form: the new K row in Q's chunks (every head group the same) and V's chunks g + 8i.
    uint4 knew[ROPE ? KP : 1], vnew[ROPE ? VC : 1];
    const int64_t qat = b * a.q_sb + (head0 + g) * a.q_sh;  // elements of q (or of the fp32 sums)
    if constexpr (ROPE) {
      if (a.qkv_f32) {  // block-uniform: the QKV projection's fp32 sums (FASTAWQ_QKV_SUMS)
        const float* qs = static_cast<const float*>(a.q);
        const float* row = qs + b * a.q_sb;
#pragma unroll
        for (int p = 0; p < KP; ++p) qf[p] = ld16_from_f32<T>(qs + qat + (4 * p + t) * 8, g < group);
#pragma unroll
        for (int p = 0; p < KP; ++p) knew[p] = ld16_from_f32<T>(row + (a.hq + kvh) * D + (4 * p + t) * 8, true);
#pragma unroll
        for (int i = 0; i < VC; ++i) vnew[i] = ld16_from_f32<T>(row + (a.hq + a.hkv + kvh) * D + (g + 8 * i) * 8, true);
      } else {
        const T* row = q + b * a.q_sb;
#pragma unroll
        for (int p = 0; p < KP; ++p) qf[p] = ld16(q + qat + (4 * p + t) * 8, g < group);
#pragma unroll
        for (int p = 0; p < KP; ++p) knew[p] = ld16(row + (a.hq + kvh) * D + (4 * p + t) * 8, true);
#pragma unroll
        for (int i = 0; i < VC; ++i) vnew[i] = ld16(row + (a.hq + a.hkv + kvh) * D + (g + 8 * i) * 8, true);
      }
    } else {
#pragma unroll
      for (int p = 0; p < KP; ++p) qf[p] = ld16(q + qat + (4 * p + t) * 8, g < group);
    }
    if constexpr (ROPE) {
      const int moved = __ldcg(a.positions + b);  // the position, now that the step's writes are in
      if (moved != pos) {  // block-uniform; each thread restages the chunks it staged
        cp_async_wait<0>();  // the first copies land before the second overwrite them
        pos = moved;
        rope_stage<T, D>(a, pos, sm_rope, tid);
      }
      cp_async_wait<0>();
      __syncthreads();
      const bool norm = a.q_norm != nullptr;
      rope_chunks<T, D>(qf, sm_rope, 0, norm, a.norm_eps, t);
      rope_chunks<T, D>(knew, sm_rope, 1, norm, a.norm_eps, t);
      // The block whose keys hold the position (split 0 if none does) writes the rows to the caches.
      if (warp == 0 && split == (pos >= 0 && pos < len ? pos / per_split : 0) && pos >= 0 && pos < a.seq_cap) {
        if (g == 0) {
          T* kout = static_cast<T*>(a.k_cache) + b * a.k_sb + pos * a.k_ss + kvh * a.k_sh;
#pragma unroll
          for (int p = 0; p < KP; ++p) *reinterpret_cast<uint4*>(kout + (4 * p + t) * 8) = knew[p];
        }
        if (t == 0) {
          T* vout = static_cast<T*>(a.v_cache) + b * a.v_sb + pos * a.v_ss + kvh * a.v_sh;
#pragma unroll
          for (int i = 0; i < VC; ++i) *reinterpret_cast<uint4*>(vout + (g + 8 * i) * 8) = vnew[i];
        }
      }
    }
    float o[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run = -INFINITY;  // running max of head g's scores (log2 units), uniform over t
    float l_run = 0.f;        // this lane's share of head g's running sum

    for (int r0 = start + warp * kDecodeTileN; r0 < end; r0 += NW * kDecodeTileN) {
      // The warp's next tile into L1 (its K and V lines, 128 bytes a lane) while this one is
      // loaded and used: a warp with several tiles (long splits) then reads them from L1, not L2.
      if (const int rn = r0 + NW * kDecodeTileN; rn < end) {
        constexpr int kLines = D * 2 / 128;  // 128-byte lines of a row
#pragma unroll
        for (int i = lane; i < kDecodeTileN * kLines; i += 32) {
          const int row = rn + i / kLines, off = (i % kLines) * 64;
          if (row < end) {
            prefetch_l1(kbase + row * a.k_ss + off);
            prefetch_l1(vbase + row * a.v_ss + off);
          }
        }
      }
      // K: key rows r0 + g and r0 + 8 + g (the two n-tiles), the same chunks as the Q fragment.
      uint4 kf[2][KP];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int row = r0 + 8 * n + g;
        const T* kr = kbase + row * a.k_ss;
#pragma unroll
        for (int p = 0; p < KP; ++p) kf[n][p] = ld16(kr + (4 * p + t) * 8, row < end);
      }
      // V: key rows r0 + {2t, 2t+1, 2t+8, 2t+9} (PV's k), chunks g + 8i: d-row g of m-tile j is
      // dim 64 (j / 4) + 8 g + 2 (j % 4), d-row g + 8 the next dim.
      uint4 vf[4][VC];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = r0 + 2 * t + (r & 1) + 8 * (r >> 1);
        const T* vr = vbase + row * a.v_ss;
#pragma unroll
        for (int i = 0; i < VC; ++i) vf[r][i] = ld16(vr + (g + 8 * i) * 8, row < end);
      }
      if constexpr (ROPE) {
        if (pos >= r0 && pos < min(r0 + kDecodeTileN, end)) {  // the new row, from registers
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            if (r0 + 8 * n + g == pos) {
#pragma unroll
              for (int p = 0; p < KP; ++p) kf[n][p] = knew[p];
            }
          }
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (r0 + 2 * t + (r & 1) + 8 * (r >> 1) == pos) {
#pragma unroll
              for (int i = 0; i < VC; ++i) vf[r][i] = vnew[i];
            }
          }
        }
      }

      // S: c0, c1 = head g x keys 8n + 2t, 8n + 2t + 1 (c2, c3: the unused heads 8..15).
      float s[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int p = 0; p < KP; ++p) {
          const uint32_t lo[4] = {qf[p].x, 0u, qf[p].y, 0u};
          Mma<T>::run(s[n], lo, kf[n][p].x, kf[n][p].y);
          const uint32_t hi[4] = {qf[p].z, 0u, qf[p].w, 0u};
          Mma<T>::run(s[n], hi, kf[n][p].z, kf[n][p].w);
        }
      }

      // Online softmax in fp32, per head g; the four lanes t of a head cover the 16 keys.
      float pr[2][2];
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int row = r0 + 8 * n + 2 * t + j;
          pr[n][j] = row < end ? s[n][j] * a.scale_log2 : -INFINITY;
          mx = fmaxf(mx, pr[n][j]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);  // finite: key r0 < end is in every tile
      const float alpha = exp2f(m_run - m_new);
      float psum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          pr[n][j] = exp2f(pr[n][j] - m_new);
          psum += pr[n][j];
        }
      }
      l_run = l_run * alpha + psum;
      m_run = m_new;

      // O^T's columns are heads 2t, 2t+1: their rescale factors live in lanes 8t and 8t + 4.
      const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * t);
      const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
      // P^T fragment (k = keys 2t, 2t+1 | 2t+8, 2t+9; n = head g): the S accumulators as they are.
      const uint32_t pb0 = HalfTraits<T>::from_float2(pr[0][0], pr[0][1]);
      const uint32_t pb1 = HalfTraits<T>::from_float2(pr[1][0], pr[1][1]);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        o[j][0] *= al0;
        o[j][1] *= al1;
        o[j][2] *= al0;
        o[j][3] *= al1;
        const int i = j / 4;
        const int w = j % 4;
        const uint32_t x0 = word(vf[0][i], w), x1 = word(vf[1][i], w);
        const uint32_t x2 = word(vf[2][i], w), x3 = word(vf[3][i], w);
        // Low halves: d-row g (dim d), high halves: d-row g + 8 (dim d + 1); keys pair up.
        const uint32_t av[4] = {__byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632),
                                __byte_perm(x2, x3, 0x5410), __byte_perm(x2, x3, 0x7632)};
        Mma<T>::run(o[j], av, pb0, pb1);
      }
    }

    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if (t == 0) {
      sm_m[warp][g] = m_run;  // -inf for a warp that had no tile: its sm_o is never read
      sm_l[warp][g] = l_run;
    }
    if (start + warp * kDecodeTileN < end) {
      const int h0 = 2 * t;
      const int h1 = 2 * t + 1;
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const int d = 64 * (j / 4) + 8 * g + 2 * (j % 4);
        if (h0 < group) *reinterpret_cast<float2*>(&sm_o[warp][h0][d]) = make_float2(o[j][0], o[j][2]);
        if (h1 < group) *reinterpret_cast<float2*>(&sm_o[warp][h1][d]) = make_float2(o[j][1], o[j][3]);
      }
    }
    __syncthreads();

    // Merge the warps: one (m, l, acc) per head for this block.
    const int64_t part = ((static_cast<int64_t>(b) * a.hkv + kvh) * splits + split) * group;
    for (int idx = tid; idx < group * D4; idx += NW * 32) {
      const int h = idx / D4;
      const int d = (idx % D4) * 4;
      float mmax = -INFINITY;
#pragma unroll
      for (int w = 0; w < NW; ++w) mmax = fmaxf(mmax, sm_m[w][h]);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float mw = sm_m[w][h];
        if (mw > -INFINITY) {
          const float wt = exp2f(mw - mmax);
          fma4(acc, wt, *reinterpret_cast<const float4*>(&sm_o[w][h][d]));
          l += wt * sm_l[w][h];
        }
      }
      if (direct) {
        const float inv = l > 0.f ? 1.f / l : 0.f;  // len 0: zeros
        acc.x *= inv;
        acc.y *= inv;
        acc.z *= inv;
        acc.w *= inv;
        store4<T>(out + b * a.o_sb + (head0 + h) * a.o_sh + d, acc);
      } else if (dsmem) {  // in place: this thread alone read sm_o[.][h][d .. d + 3]
        *reinterpret_cast<float4*>(&sm_o[0][h][d]) = acc;
        if (d == 0) sm_pm[h] = mmax, sm_pl[h] = l;
      } else {
        *reinterpret_cast<float4*>(a.part_acc + (part + h) * D + d) = acc;
        if (d == 0) *reinterpret_cast<float2*>(a.part_ml + (part + h) * 2) = make_float2(mmax, l);
      }
    }
  }
  if (direct) return;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CLUSTER) {
    if (dsmem) {
      // The barrier orders every block's partial (written above) before split 0's reads of it.
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      cluster.sync();
      if (split == 0) {
        if (tid < group) {
          float pm[kDecodeMaxCluster], pl[kDecodeMaxCluster];  // active <= a.cluster
          float mmax = -INFINITY;
          for (int s = 0; s < active; ++s) {
            pm[s] = *cluster.map_shared_rank(&sm_pm[tid], s);
            pl[s] = *cluster.map_shared_rank(&sm_pl[tid], s);
            mmax = fmaxf(mmax, pm[s]);
          }
          float l = 0.f;
          for (int s = 0; s < active; ++s) l += exp2f(pm[s] - mmax) * pl[s];
          const float inv = l > 0.f ? 1.f / l : 0.f;
          for (int s = 0; s < active; ++s) sm_w[s][tid] = exp2f(pm[s] - mmax) * inv;
        }
        __syncthreads();
        for (int idx = tid; idx < group * D4; idx += NW * 32) {
          const int h = idx / D4;
          const int d = (idx % D4) * 4;
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
          for (int s = 0; s < active; ++s) {
            fma4(acc, sm_w[s][h], *reinterpret_cast<const float4*>(cluster.map_shared_rank(&sm_o[0][h][d], s)));
          }
          store4<T>(out + b * a.o_sb + (head0 + h) * a.o_sh + d, acc);
        }
      }
      cluster.sync();  // the peers' shared memory stays until split 0 has read it
      return;
    }
  }
#endif

  // Every working block arrives; the last sees all partials (fence before the count, reads
  // through L2 after it).
  __threadfence();
  __syncthreads();
  const int ci = b * a.hkv + kvh;
  if (tid == 0) sm_last = atomicAdd(a.counters + ci, 1) == active - 1;
  __syncthreads();
  if (!sm_last) return;
  __threadfence();

  const int64_t base = (static_cast<int64_t>(b) * a.hkv + kvh) * splits * group;
  for (int idx = tid; idx < active * group; idx += NW * 32) {
    sm_ml[idx / group][idx % group] = __ldcg(reinterpret_cast<const float2*>(a.part_ml) + base + idx);
  }
  __syncthreads();
  if (tid < group) {
    float mmax = -INFINITY;
    for (int s = 0; s < active; ++s) mmax = fmaxf(mmax, sm_ml[s][tid].x);
    float l = 0.f;
    for (int s = 0; s < active; ++s) l += exp2f(sm_ml[s][tid].x - mmax) * sm_ml[s][tid].y;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int s = 0; s < active; ++s) sm_w[s][tid] = exp2f(sm_ml[s][tid].x - mmax) * inv;
  }
  __syncthreads();
  for (int idx = tid; idx < group * D4; idx += NW * 32) {
    const int h = idx / D4;
    const int d = (idx % D4) * 4;
    const float* src = a.part_acc + (base + h) * D + d;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < active; ++s) {
      fma4(acc, sm_w[s][h], __ldcg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(s) * group * D)));
    }
    store4<T>(out + b * a.o_sb + (head0 + h) * a.o_sh + d, acc);
  }
  // Re-arm for the next launch (or graph replay): the kernel boundary orders it before that.
  if (tid == 0) atomicExch(a.counters + ci, 0);
}

template <typename T, int D, bool ROPE>
void launch_form(const DecodeAttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(a.splits, a.hkv, a.batch);
  if (a.cluster > 0) {  // the host sets it on sm_90 only, with splits a multiple of it (<= 8)
    const auto kernel = a.prefetch_kv ? decode_attention_kernel<T, D, true, ROPE, true>
                                      : decode_attention_kernel<T, D, false, ROPE, true>;
    return launch_pdl_cluster(kernel, grid, dim3(kDecodeWarps * 32), 0, stream, a.cluster, a);
  }
  if (a.prefetch_kv) {
    return launch_pdl(decode_attention_kernel<T, D, true, ROPE>, grid, dim3(kDecodeWarps * 32), 0, stream, a);
  }
  launch_pdl(decode_attention_kernel<T, D, false, ROPE>, grid, dim3(kDecodeWarps * 32), 0, stream, a);
}

template <typename T, int D>
void launch_typed(const DecodeAttentionArgs& a, cudaStream_t stream) {
  if (a.rope) return launch_form<T, D, true>(a, stream);
  launch_form<T, D, false>(a, stream);
}

template <typename T>
void launch_dim(const DecodeAttentionArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: launch_typed<T, 64>(a, stream); break;
    case 128: launch_typed<T, 128>(a, stream); break;
    case 256: launch_typed<T, 256>(a, stream); break;
    default: break;  // the host entry admits only these
  }
}

}  // namespace

void launch_decode_attention(const DecodeAttentionArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return;
  if (args.dtype == HalfType::kHalf) {
    launch_dim<__half>(args, stream);
  } else {
    launch_dim<__nv_bfloat16>(args, stream);
  }
}

}  // namespace fastawq
