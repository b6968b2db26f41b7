// W4A16 for batches of 16 rows and more on the tensor cores, on the load-time repacked layout of
// awq_gemv_packed.h, with the batch as the mma's M: y[M, N] = x[M, K] W[K, N] by mma.sync
// m16n8k16, 16 rows of x per m-tile (MT m-tiles per block) as A, the weights as B. awq_mma_packed.cu
// ("swap AB") puts the batch in the mma's N instead, which suits M <= 8 and runs out of registers
// above 16: its per-group sums double the accumulators, and each batch tile of 8 adds 32 of them.
//
// Fragments straight from the layout (the k order inside a 32-row step is a free label, as there):
//   B: lane (g, t) loads the 16 bytes at (kb = 4s + t, c4 = c4w + g): rows 32s + 8t .. +7 of columns
//      4c4 .. 4c4 + 3. Column j of the four is column g of n-tile j, so the warp's n-tile j holds
//      columns 4(c4w + g') + j, g' = 0..7. Word w holds rows 2w (even nibbles) and 2w + 1, so the
//      b0 register of k-step h (k slots 2t, 2t + 1) is byte j of word 2h and b1 (slots 2t + 8, 2t + 9)
//      byte j of word 2h + 1: column_pair makes (magic + q) pairs, one hsub2 the exact q - z, one
//      hmul2 the weight in x's dtype (what dequantize-then-matmul rounds to).
//   A: the same labels make the lane's A registers of k-step h x[row][32s + 8t + 4h .. +3] for rows
//      g and g + 8 of the m-tile: one 16-byte load of x[row][32s + 8t ..] per row feeds both k-steps.
//   C: lane (g, t) ends with rows g, g + 8 and, per n-tile j, the columns 4(c4w + 2t + e) + j, e = 0, 1:
//      for one row and e the four n-tiles are four adjacent columns (an 8-byte store, or one 16-byte
//      reduction into the split-K workspace).
// The dequantization (4 instructions a register: prmt, lop3, hsub2, hmul2) is paid once per weight
// and shared by the MT m-tiles, so it costs less per output as M grows.
//
// H200 (benchmarks/RESULTS.md, session 13), geomean x cuBLAS fp16 over the Llama-3-8B shapes with
// the best tile: 1.06 / 0.81 / 0.53 at M = 16 / 32 / 64; steps take ~1 us a warp whatever M is:
// the first use of a ring slot waits on the scoreboard all of the warp's global loads share, so
// about one step of loads is in flight across each wait. Not in the automatic choice (backend.py).
//
// Work: a block is 4 warps side by side on a 128 * CC-column tile (32 * CC columns each) and MT * 16
// rows, all on one contiguous range of 32-row steps (blockIdx.z splits K). The 4 warps read the same
// x rows, which stay in L1 after the first, a step ahead of their use; each lane's weights are read
// once, into a register ring P steps deep, as awq_mma_packed's register ring. Rows beyond M are clamped to row M - 1 on load and never stored. Blocks of one column tile
// and K range are adjacent in blockIdx.x (the M blocks), so M > 64 reads a tile's weights from DRAM
// once and from L2 after. Split K adds into the zeroed fp32 workspace [M, N] with 16-byte
// reductions; the last block of a (column tile, M block) to arrive converts and re-zeroes it.
#include <cstdint>

#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace {

using gemv::column_pair;

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t magic_q, typename HalfTraits<T>::T2 zm,
                                                 typename HalfTraits<T>::T2 s) {
  using T2 = typename HalfTraits<T>::T2;
  const T2 w = __hmul2(__hsub2(*reinterpret_cast<const T2*>(&magic_q), zm), s);
  return *reinterpret_cast<const uint32_t*>(&w);
}

template <typename T, int MT, int CC, int P>
__global__ void __launch_bounds__(kPackedThreads) awq_gemm_packed_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int m, int n, int k, int group_size,
    int steps_per_block) {
  using Tr = HalfTraits<T>;
  using T2 = typename Tr::T2;
  constexpr int kRows = 16 * MT;
  constexpr int kQuads = kPackedThreads / 32 * 8 * CC;  // 4-column chunks of the block's tile
  __shared__ int is_last;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n4 = n >> 2;
  const int row0 = blockIdx.x * kRows;
  // The warp's first 4-column chunk; the lane's chunk cc is c4w + 8 cc + g.
  const int c4w = static_cast<int>(pinned(blockIdx.y * kQuads + warp * 8 * CC));
  bool col_ok[CC];
#pragma unroll
  for (int cc = 0; cc < CC; ++cc) col_ok[cc] = c4w + 8 * cc + g < n4;  // n % 8 == 0: whole chunks
  const int s_total = k / kPackedBatchRows;
  const int s0 = blockIdx.z * steps_per_block;
  const int s1 = min(s0 + steps_per_block, s_total);
  const int steps_per_group = group_size / kPackedBatchRows;
  const uint64_t policy = evict_first_policy();
  const int64_t w_step = 4 * static_cast<int64_t>(n4);
  const uint4* w_next = wp + static_cast<int64_t>(t) * n4 + c4w + g + s0 * w_step;

  // L2 prefetch of the ring's first steps before the PDL wait (awq_gemv_packed.cu says why only L2).
  for (int s = s0; s < min(s0 + P, s1); ++s) {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      if (col_ok[cc]) prefetch_l2(w_next + (s - s0) * w_step + 8 * cc);
    }
  }
  pdl_wait();
  pdl_launch_dependents();

  // The lane's x rows: row0 + 16 mt + 8 r + g, clamped, as element offsets from the step's column.
  int x_off[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) x_off[mt][r] = min(row0 + 16 * mt + 8 * r + g, m - 1) * k;
  const T* x_step = x + 8 * t + static_cast<int64_t>(s0) * kPackedBatchRows;
  // x of a step is loaded a step ahead, into registers.
  uint4 xc[MT][2];
  const auto load_x = [&](uint4(&xv)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) xv[mt][r] = __ldg(reinterpret_cast<const uint4*>(x_step + x_off[mt][r]));
  };

  const uint4* sz_lane = sz + static_cast<int64_t>(s0 / steps_per_group) * n4 + c4w + g;
  uint4 sv_next[CC];
  const auto load_scales = [&]() {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) sv_next[cc] = col_ok[cc] ? __ldg(sz_lane + 8 * cc) : make_uint4(0, 0, 0, 0);
  };
  T2 zm[CC][4], sc[CC][4];  // per column j of the lane's chunk cc: (magic + z) and s, both halves alike
  const auto set_group = [&]() {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      const T* p = reinterpret_cast<const T*>(&sv_next[cc]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const T z = __hadd(Tr::from_float(Tr::kMagic), p[2 * j + 1]);  // magic + z, exact
        zm[cc][j] = T2{z, z};
        sc[cc][j] = T2{p[2 * j], p[2 * j]};
      }
    }
  };

  float acc[MT][CC][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int cc = 0; cc < CC; ++cc)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][cc][j][r] = 0.f;

  const auto consume = [&](const uint4(&w)[CC], bool more) {
    uint4 xn[MT][2];
    x_step += kPackedBatchRows;
    if (more) load_x(xn);
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      uint32_t b[2][4][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t word = h == 0 ? (r == 0 ? w[cc].x : w[cc].y) : (r == 0 ? w[cc].z : w[cc].w);
          const uint32_t hi = word >> 4;
          b[h][0][r] = dequant_pair<T>(column_pair<T, 0>(word, hi), zm[cc][0], sc[cc][0]);
          b[h][1][r] = dequant_pair<T>(column_pair<T, 1>(word, hi), zm[cc][1], sc[cc][1]);
          b[h][2][r] = dequant_pair<T>(column_pair<T, 2>(word, hi), zm[cc][2], sc[cc][2]);
          b[h][3][r] = dequant_pair<T>(column_pair<T, 3>(word, hi), zm[cc][3], sc[cc][3]);
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {h == 0 ? xc[mt][0].x : xc[mt][0].z, h == 0 ? xc[mt][1].x : xc[mt][1].z,
                                 h == 0 ? xc[mt][0].y : xc[mt][0].w, h == 0 ? xc[mt][1].y : xc[mt][1].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma<T>::run(acc[mt][cc][j], a, b[h][j][0], b[h][j][1]);
        }
    }
    if (more) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xc[mt][0] = xn[mt][0], xc[mt][1] = xn[mt][1];
    }
  };

  // The ring: slot r holds steps s0 + r, s0 + r + P, ...: consumed, then refilled with the step P
  // later. (ptxas tracks all of a warp's global loads on one scoreboard, so the first use of a slot
  // waits for the younger slots too: the ring keeps only about a step of loads in flight across
  // each wait; benchmarks/CUDA_NOTES.md, session 13.)
  uint4 rw[P][CC];
  const auto fetch = [&](uint4(&w)[CC]) {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      w[cc] = col_ok[cc] ? gemv::load_stream(w_next + 8 * cc, policy) : make_uint4(0, 0, 0, 0);
    }
    w_next += w_step;
  };
#pragma unroll
  for (int r = 0; r < P; ++r) {
    if (s0 + r < s1) fetch(rw[r]);
  }
  if (s0 < s1) {
    load_scales();
    set_group();
    load_x(xc);
  }
  int group_left = steps_per_group - s0 % steps_per_group;  // steps until the current group ends
#pragma unroll 1
  for (int s = s0; s < s1; s += P) {
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const int st = s + r;
      if (st < s1) {
        // The next group's (scale, zero) pairs, fetched a step before they are needed.
        if (group_left == 1 && st + 1 < s1) {
          sz_lane += n4;
          load_scales();
        }
        consume(rw[r], st + 1 < s1);
        if (st + P < s1) fetch(rw[r]);
        if (--group_left == 0) {
          group_left = steps_per_group;
          set_group();
        }
      }
    }
  }

  // out[row][4 c4o .. + 3] = v + bias, one 8-byte store.
  const auto store4 = [&](int64_t at, int c4o, const float (&v)[4]) {
    T o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = Tr::from_float(bias != nullptr ? v[j] + Tr::to_float(bias[4 * c4o + j]) : v[j]);
    *reinterpret_cast<uint2*>(out + at) = *reinterpret_cast<const uint2*>(o);
  };
  // C fragment (g, t): acc[mt][cc][j][2 hr + e] is row 16 mt + 8 hr + g, column 4 (c4w + 8 cc + 2t + e) + j.
  const bool split = gridDim.z > 1;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int cc = 0; cc < CC; ++cc)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = row0 + 16 * mt + 8 * hr + g, c4o = c4w + 8 * cc + 2 * t + e;
          if (row >= m || c4o >= n4) continue;
          const float v[4] = {acc[mt][cc][0][2 * hr + e], acc[mt][cc][1][2 * hr + e], acc[mt][cc][2][2 * hr + e],
                              acc[mt][cc][3][2 * hr + e]};
          const int64_t at = static_cast<int64_t>(row) * n + 4 * c4o;
          if (split) {
            red_add4(ws + at, make_float4(v[0], v[1], v[2], v[3]));
          } else {
            store4(at, c4o, v);
          }
        }
  if (!split) return;

  // The last block of this (column tile, M block) to arrive converts the sums and zeroes them again.
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counters + tile, 1);
    is_last = prev == static_cast<int>(gridDim.z) - 1;
    if (is_last) counters[tile] = 0;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int c4_0 = blockIdx.y * kQuads;
  for (int e = threadIdx.x; e < kRows * kQuads; e += kPackedThreads) {
    const int row = row0 + e / kQuads, c4o = c4_0 + e % kQuads;
    if (row >= m || c4o >= n4) continue;
    const int64_t at = static_cast<int64_t>(row) * n + 4 * c4o;
    float4* p = reinterpret_cast<float4*>(ws + at);
    const float4 v = __ldcg(p);
    __stcg(p, make_float4(0.f, 0.f, 0.f, 0.f));
    store4(at, c4o, {v.x, v.y, v.z, v.w});
  }
}

// The register ring's depth: 16-byte weight loads per lane, fewer as the accumulators grow.
template <int MT, int CC>
constexpr int gemm_ring_depth() {
  constexpr int loads = MT == 1 ? 8 : (MT == 2 ? 6 : 4);
  return loads / CC < 2 ? 2 : loads / CC;
}

template <typename T, int MT, int CC>
void launch_cfg(const GemmPackedArgs& a, cudaStream_t stream, int* resident) {
  constexpr auto kernel = awq_gemm_packed_kernel<T, MT, CC, gemm_ring_depth<MT, CC>()>;
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kPackedThreads, 0);
    return;
  }
  launch_pdl(kernel, dim3(a.m_blocks, a.col_tiles, a.splits), dim3(kPackedThreads), 0, stream,
             static_cast<const T*>(a.x), reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz),
             static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n, a.k,
             a.group_size, a.steps_per_warp);
}

template <typename T, int MT>
void launch_mt(const GemmPackedArgs& a, cudaStream_t stream, int* resident) {
  if constexpr (MT < 4) {  // the host entry sends only gemm_packed_tile_ok tiles
    if (a.chunks == 2) return launch_cfg<T, MT, 2>(a, stream, resident);
  }
  launch_cfg<T, MT, 1>(a, stream, resident);
}

template <typename T>
void launch_t(const GemmPackedArgs& a, cudaStream_t stream, int* resident) {
  switch (a.m_tiles) {
    case 1: return launch_mt<T, 1>(a, stream, resident);
    case 2: return launch_mt<T, 2>(a, stream, resident);
    default: return launch_mt<T, 4>(a, stream, resident);
  }
}

}  // namespace

void launch_awq_gemm_packed(const GemmPackedArgs& a, cudaStream_t stream) {
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, stream, nullptr); });
}

int gemm_packed_resident_blocks(const GemmPackedArgs& a) {
  int blocks = 0;
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, nullptr, &blocks); });
  return blocks > 0 ? blocks : 1;
}

}  // namespace fastawq
