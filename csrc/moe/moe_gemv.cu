// W4A16 mixture-of-experts decode on the CUDA cores: the AWQ-layout GEMV (gemv/awq_gemv_body.cuh)
// with one expert per block, two launches per MoE layer and no memset or conversion kernel.
//
// Rows are (token, slot) assignments f = t * topk + j, each with expert ids[f]. blockIdx.z = f.
//  w13: x[f / topk] [H] · w13[e] [H, 2I] -> h[f] [I] = act(gate) * up, rounded to x's dtype. A
//       block's 256-column tile is 128 gate columns and the same 128 up columns (lanes 0..3 and
//       4..7), so the block that finishes a tile holds both halves of act(gate) * up.
//  w2:  h[f] [I] · w2[e] [I, H] -> out[t] [H] = sum_j w[f] * (h[f] w2[e]). The k slots of a token
//       meet in a zeroed fp32 workspace; the last of the token's k * splits blocks to arrive at a
//       column tile converts it, writes out and zeroes the workspace again (graph-safe).
// Split K works the same way for w13 (the last of a tile's splits applies the activation). An id
// outside [0, E) contributes zeros but still arrives, so the counters always return to zero.
// FASTAWQ_MOE_H_PARTIALS (on unless "0"; one token, split w13): w13's splits store their sums
// with plain stores into h_part [splits13, T * topk, 2I] and exit, and w2 sums them and applies the
// activation as it reads h: no atomics, fence, arrival or last-block pass at the end of w13, whose
// last block gates w2's PDL wait (the chain is ~3 dependent L2 round trips a launch).
// moe_gemv_w4_sums (the ring form): w13 zeroes an fp32 out_sums [T, H] after its wait, w2 adds its
// weighted tiles into it and exits: no arrival, reread or conversion at the end of w2, the last
// kernel of the MoE block; the consumer (add_rms_norm) rounds the sums to x's dtype as it reads them.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_body.cuh"
#include "moe/moe_common.cuh"

namespace fastawq {
namespace {

using gemv::consume_batch;
using gemv::kBatchRows;
using gemv::kLoads;
using gemv::kWarps;
using gemv::load_batch;
using gemv::Words;
using moe::act_fn;

constexpr int WPT = kGemvWordsPerLane;
constexpr int kLaneCols = WPT * 8;            // output columns per lane
constexpr int kTileCols = 8 * kLaneCols;      // 256 per block (w13: 128 gate + 128 up)

struct TileRed {
  float red[kWarps][kTileCols];
  int is_last;
};

// How a block's 128 threads cover its 256-column tile: kColLanes lanes of a warp side by side, each
// on kWords consecutive packed words (8 columns each) of a row, the warp's other lanes on other
// rows. Forms 0 and 1 (fp32 and half2 sums) take 16-byte loads: 8 column lanes of 4 words and 4
// row lanes; the ring (form 2) 8-byte ones: 16 column lanes of 2 words and 2 row lanes, so a lane
// holds half the accumulators and zero constants and its registers go to loads in flight.
template <int kForm>
struct LaneMap {
  static constexpr int kWords = kForm == 2 ? 2 : WPT;
  static constexpr int kColLanes = 32 / kWords;
  static constexpr int kRowLanes = 32 / kColLanes;
  static constexpr int kCols = 8 * kWords;  // output columns per lane
  static_assert(kColLanes * kCols == kTileCols, "a block row covers the tile");
};

// Sum the block's partials of its tile over the row lanes (shuffles) and the 4 warps (shared
// memory); returns with sh.red filled and the block synchronised.
template <int kColLanes, int kCols>
__device__ __forceinline__ void reduce_tile(float (&y)[1][kCols], TileRed& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cl = lane % kColLanes, rl = lane / kColLanes;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float v = y[0][c];
#pragma unroll
    for (int off = kColLanes; off < 32; off *= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    y[0][c] = v;
  }
  if (rl == 0) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) sh.red[warp][cl * kCols + c] = y[0][c];
  }
  __syncthreads();
}

__device__ __forceinline__ float tile_sum(const TileRed& sh, int tc) {
  float v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v += sh.red[w][tc];
  return v;
}

// The block's assignment f = blockIdx.z and its expert; an id outside [0, E) is not valid and its
// block reads expert 0's pointers but loads nothing (col_ok false), so it adds zeros and arrives.
struct Assignment {
  int f;
  bool valid;
  int64_t expert;  // 0 when not valid
};
template <typename Id>
__device__ __forceinline__ Assignment assignment(const MoeGemvArgs& a, bool through_l2 = false) {
  const int f = blockIdx.z;
  const Id* p = static_cast<const Id*>(a.ids) + f;
  const int64_t e = static_cast<int64_t>(through_l2 ? __ldcg(p) : *p);
  const bool valid = e >= 0 && e < a.num_experts;
  return {f, valid, valid ? e : 0};
}

// The K loop of one block: its chunks of rows, 32-row batches, as awq_gemv_kernel walks them.
template <typename T>
__device__ __forceinline__ void block_gemv(const T* __restrict__ xrow, const uint32_t* __restrict__ qweight,
                                           const T* __restrict__ scales, const uint32_t* __restrict__ qzeros,
                                           int n8, int n, int k, int g, int word0, bool col_ok, int chunk_rows,
                                           int chunks_per_block, float (&y)[1][kLaneCols]) {
  const int warp = threadIdx.x >> 5, rl = (threadIdx.x & 31) >> 3;
  float acc[1][kLaneCols], xs[1] = {0.f};
#pragma unroll
  for (int c = 0; c < kLaneCols; ++c) y[0][c] = acc[0][c] = 0.f;
  const uint64_t policy = evict_first_policy();
  const int c_end = min((blockIdx.y + 1) * chunks_per_block, (k + chunk_rows - 1) / chunk_rows);
  for (int chunk = blockIdx.y * chunks_per_block + warp; chunk < c_end; chunk += kWarps) {
    const int row0 = chunk * chunk_rows, row_end = min(row0 + chunk_rows, k);
#pragma unroll 1
    for (int base = row0; base < row_end; base += kBatchRows) {
      Words<WPT> w[kLoads];
      float xv[1][kLoads];
      // A batch that closes its group fetches the group's zeros and scales into L2 with its
      // weights, so the close after its math does not wait a DRAM round trip for them.
      const int next = base + kBatchRows;
      if (col_ok && (next % g == 0 || next >= row_end)) {
        const int grp = base / g;
        prefetch_l2(qzeros + static_cast<int64_t>(grp) * n8 + word0);
        prefetch_l2(scales + static_cast<int64_t>(grp) * n + word0 * 8);
      }
      load_batch<T, 1, WPT>(xrow, qweight, k, n8, word0, col_ok, base + rl, policy, w, xv);
      consume_batch<T, 1, WPT>(w, xv, acc, xs, y, base, row_end, g, col_ok, qzeros, scales, n8, n, word0);
    }
  }
}

// The half2 form of block_gemv (kH2, as awq_gemv_packed.cu's consume_h2, on the AWQ layout): a
// word's 8 weights become 4 pairs of (magic + q / 16) in x's dtype (gemv::word_pairs; nibble i is
// column AWQ_ORDER[i], so pair p is columns 2p, 2p + 1), the zero word the same way, one hsub2
// leaves (q - z) / 16 exactly, and the 8 rows of a batch are summed in pairs with hfma2 (below
// 8 max|x|: no fp16 overflow for |x| < 8188), then y += s * sum in fp32. Sums come out in units
// of 1/16. The group's zeros and scales are loaded as it starts (L2-prefetched a batch before).
template <typename T>
__device__ __forceinline__ void block_gemv_h2(const T* __restrict__ xrow, const uint32_t* __restrict__ qweight,
                                              const T* __restrict__ scales, const uint32_t* __restrict__ qzeros,
                                              int n8, int n, int k, int g, int word0, bool col_ok, int chunk_rows,
                                              int chunks_per_block, float (&y)[1][kLaneCols]) {
  using T2 = typename HalfTraits<T>::T2;
  using gemv::word_pairs;
  const int warp = threadIdx.x >> 5, rl = (threadIdx.x & 31) >> 3;
#pragma unroll
  for (int c = 0; c < kLaneCols; ++c) y[0][c] = 0.f;
  const uint64_t policy = evict_first_policy();
  const auto h2 = [](uint32_t v) { return *reinterpret_cast<const T2*>(&v); };
  T2 zc[WPT][4];
  uint4 sv[WPT];
  // The group's (magic + z / 16) pairs and scales for the lane's words (zeros: nothing loaded).
  const auto load_group = [&](int grp) {
#pragma unroll
    for (int j = 0; j < WPT; ++j) {
      uint32_t zr[4] = {0u, 0u, 0u, 0u};
      sv[j] = make_uint4(0, 0, 0, 0);
      if (col_ok) {
        word_pairs<T>(__ldg(qzeros + static_cast<int64_t>(grp) * n8 + word0 + j), zr);
        sv[j] = __ldg(reinterpret_cast<const uint4*>(scales + static_cast<int64_t>(grp) * n + (word0 + j) * 8));
      } else {
        word_pairs<T>(0u, zr);
      }
#pragma unroll
      for (int p = 0; p < 4; ++p) zc[j][p] = h2(zr[p]);
    }
  };
  const int c_end = min((blockIdx.y + 1) * chunks_per_block, (k + chunk_rows - 1) / chunk_rows);
  for (int chunk = blockIdx.y * chunks_per_block + warp; chunk < c_end; chunk += kWarps) {
    const int row0 = chunk * chunk_rows, row_end = min(row0 + chunk_rows, k);
#pragma unroll 1
    for (int base = row0; base < row_end; base += kBatchRows) {
      if (base == row0 || base % g == 0) load_group(base / g);
      // The next group's zeros and scales into L2 while this batch loads.
      const int next = base + kBatchRows;
      if (col_ok && next % g == 0 && next < row_end) {
        prefetch_l2(qzeros + static_cast<int64_t>(next / g) * n8 + word0);
        prefetch_l2(scales + static_cast<int64_t>(next / g) * n + word0 * 8);
      }
      Words<WPT> w[kLoads];
      T xv[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int r = base + rl + 4 * u;
        if (col_ok) {
          w[u].load(qweight + static_cast<int64_t>(r) * n8 + word0, policy);
        } else {
#pragma unroll
          for (int j = 0; j < WPT; ++j) w[u].v[j] = 0u;
        }
        xv[u] = xrow[r];
      }
#pragma unroll
      for (int j = 0; j < WPT; ++j) {
        T2 part[4];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          uint32_t r[4];
          word_pairs<T>(w[u].v[j], r);
          T2 xx;
          if constexpr (std::is_same_v<T, __half>) {
            xx = __half2half2(xv[u]);
          } else {
            xx = __bfloat162bfloat162(xv[u]);
          }
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const T2 v = __hsub2(h2(r[p]), zc[j][p]);
            part[p] = u == 0 ? __hmul2(v, xx) : __hfma2(v, xx, part[p]);
          }
        }
        const uint32_t sw[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const float2 sf = HalfTraits<T>::to_float2(sw[p]);
          const float2 pf = HalfTraits<T>::to_float2(*reinterpret_cast<const uint32_t*>(&part[p]));
          y[0][j * 8 + 2 * p] = fmaf(sf.x, pf.x, y[0][j * 8 + 2 * p]);
          y[0][j * 8 + 2 * p + 1] = fmaf(sf.y, pf.y, y[0][j * 8 + 2 * p + 1]);
        }
      }
    }
  }
}

// block_gemv_h2 as a rolling ring (form 2, at one token), on LaneMap<2>: a lane's batch is 16
// rows (base + rl + 2u) of its 2 words. Rows are consumed one at a time and each row's registers
// are refilled with the same row of the warp's next batch (across chunks, the next chunk's first)
// as soon as it is consumed, so a lane keeps its loads in flight while it sums, where
// block_gemv_h2 issues its next batch only after consuming the whole current one. x is fetched
// once per batch (lane l holds row base + l, shuffled to the row lanes), the zero words at each
// group's first batch (L2-prefetched a batch before), the scales from L1 at each batch's close.
// Loads are unconditional (no branch around them): a lane outside the columns (or of a bad id)
// reads its row's first words and adds them with scale 0.
// wait(): called once by every thread before x is read: after the first batch's weight loads and
// zero words (which do not depend on the previous kernel), so a caller may put its PDL wait there.
// load_x(row) -> T: the input's element `row` (by default xrow[row]).
template <typename T, typename Wait, typename XLoad>
__device__ __forceinline__ void block_gemv_ring(XLoad&& load_x, const uint32_t* __restrict__ qweight,
                                                const T* __restrict__ scales, const uint32_t* __restrict__ qzeros,
                                                int n8, int n, int k, int g, int word0, bool col_ok, int chunk_rows,
                                                int chunks_per_block, float (&y)[1][LaneMap<2>::kCols], Wait&& wait) {
  using L = LaneMap<2>;
  constexpr int kW = L::kWords, kRows = kBatchRows / L::kRowLanes;
  using T2 = typename HalfTraits<T>::T2;
  using gemv::word_pairs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = lane / L::kColLanes;
#pragma unroll
  for (int c = 0; c < L::kCols; ++c) y[0][c] = 0.f;
  const int c_end = min((blockIdx.y + 1) * chunks_per_block, (k + chunk_rows - 1) / chunk_rows);
  int chunk = blockIdx.y * chunks_per_block + warp;
  if (chunk >= c_end) {
    wait();
    return;
  }
  const uint64_t policy = evict_first_policy();
  const auto h2 = [](uint32_t v) { return *reinterpret_cast<const T2*>(&v); };
  const int wcol = col_ok ? word0 : 0;
  const int64_t step = int64_t{L::kRowLanes} * n8;  // a lane's rows u and u + 1
  const auto rows_at = [&](int b) { return qweight + static_cast<int64_t>(b + rl) * n8 + wcol; };
  int base = chunk * chunk_rows, row_end = min(base + chunk_rows, k);
  Words<kW> w[kRows];
  {
    const uint32_t* p = rows_at(base);
#pragma unroll
    for (int u = 0; u < kRows; ++u) w[u].load(p + u * step, policy);
  }
  uint32_t zw[kW];
  const auto zero_words = [&](int grp) {
#pragma unroll
    for (int j = 0; j < kW; ++j) zw[j] = col_ok ? __ldg(qzeros + static_cast<int64_t>(grp) * n8 + word0 + j) : 0u;
  };
  int grp = base / g;
  zero_words(grp);
  wait();
  T xl = load_x(base + lane);  // rows base .. base + 31, one a lane
  // One batch: sum it and, kMore, refill each row with the row of the batch at pn.
  const auto batch = [&]<bool kMore>(const uint32_t* pn) {
    T2 zc[kW][4];
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      uint32_t zr[4];
      word_pairs<T>(zw[j], zr);
#pragma unroll
      for (int q = 0; q < 4; ++q) zc[j][q] = h2(zr[q]);
    }
    T2 part[kW][4];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const T xs = __shfl_sync(0xffffffffu, xl, rl + L::kRowLanes * u);
      T2 xx;
      if constexpr (std::is_same_v<T, __half>) {
        xx = __half2half2(xs);
      } else {
        xx = __bfloat162bfloat162(xs);
      }
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        uint32_t r[4];
        word_pairs<T>(w[u].v[j], r);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const T2 v = __hsub2(h2(r[q]), zc[j][q]);
          part[j][q] = u == 0 ? __hmul2(v, xx) : __hfma2(v, xx, part[j][q]);
        }
      }
      if constexpr (kMore) w[u].load(pn + u * step, policy);
    }
    // Partials of 16 products of (q - z) / 16 and x: below 16 max|x|, so fp16 holds them for
    // |x| < 4094 (block_gemv_h2's 8 rows allow 8188).
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      const uint4 sv = col_ok ? __ldg(reinterpret_cast<const uint4*>(scales + static_cast<int64_t>(grp) * n + (word0 + j) * 8))
                              : make_uint4(0, 0, 0, 0);
      const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 sf = HalfTraits<T>::to_float2(sw[q]);
        const float2 pf = HalfTraits<T>::to_float2(*reinterpret_cast<const uint32_t*>(&part[j][q]));
        y[0][j * 8 + 2 * q] = fmaf(sf.x, pf.x, y[0][j * 8 + 2 * q]);
        y[0][j * 8 + 2 * q + 1] = fmaf(sf.y, pf.y, y[0][j * 8 + 2 * q + 1]);
      }
    }
  };
#pragma unroll 1
  for (;;) {
    // Where the warp's next batch starts; none: the last batch, without refills.
    int nbase = base + kBatchRows;
    if (nbase >= row_end) {
      chunk += kWarps;
      if (chunk >= c_end) break;
      nbase = chunk * chunk_rows;
      row_end = min(nbase + chunk_rows, k);
    }
    const T xn = load_x(nbase + lane);
    const int ngrp = nbase / g;
    if (ngrp != grp && col_ok) {  // into L2 for the next group's first batch
      prefetch_l2(qzeros + static_cast<int64_t>(ngrp) * n8 + word0);
      prefetch_l2(scales + static_cast<int64_t>(ngrp) * n + word0 * 8);
    }
    batch.template operator()<true>(rows_at(nbase));
    if (ngrp != grp) zero_words(ngrp), grp = ngrp;
    base = nbase, xl = xn;
  }
  batch.template operator()<false>(nullptr);
}

// One block's K loop in the form kForm picks (0: fp32 sums, block_gemv; 1: half2, block_gemv_h2;
// 2: half2 as a ring, block_gemv_ring); its sums come out in units of 1 / kSumUnit<kForm>.
template <int kForm>
constexpr float kSumUnit = kForm ? 16.f : 256.f;
// wait(): as block_gemv_ring's (the other forms call it first).
template <typename T, int kForm, typename Wait>
__device__ __forceinline__ void expert_gemv(const T* __restrict__ xrow, const uint32_t* __restrict__ qweight,
                                            const T* __restrict__ scales, const uint32_t* __restrict__ qzeros, int n8,
                                            int n, int k, int g, int word0, bool col_ok, int chunk_rows,
                                            int chunks_per_block, float (&y)[1][LaneMap<kForm>::kCols], Wait&& wait) {
  if constexpr (kForm == 2) {
    block_gemv_ring<T>([xrow](int r) { return xrow[r]; }, qweight, scales, qzeros, n8, n, k, g, word0, col_ok,
                       chunk_rows, chunks_per_block, y, wait);
  } else if constexpr (kForm == 1) {
    wait();
    block_gemv_h2<T>(xrow, qweight, scales, qzeros, n8, n, k, g, word0, col_ok, chunk_rows, chunks_per_block, y);
  } else {
    wait();
    block_gemv<T>(xrow, qweight, scales, qzeros, n8, n, k, g, word0, col_ok, chunk_rows, chunks_per_block, y);
  }
}

// kPart: the split sums go to a.h_part (FASTAWQ_MOE_H_PARTIALS; launched only with splits13 > 1).
// kZero: the block zeroes its share of a.out_sums (moe_gemv_w4_sums), which w2 adds into.
template <typename T, typename Id, int ACT, int kForm, bool kPart = false, bool kZero = false>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_w13_gemv_kernel(MoeGemvArgs a) {
  constexpr float kUnit = kSumUnit<kForm>;
  using Tr = HalfTraits<T>;
  __shared__ TileRed sh;
  pdl_wait();  // the ids come from the routing kernel before this one
  pdl_launch_dependents();
  if constexpr (kZero) {  // after the wait: the buffer may be memory an earlier kernel still read
    moe::zero_share<kGemvThreads>(a.out_sums, static_cast<int64_t>(a.n_assign / a.topk) * a.hidden);
  }
  const auto [f, valid, ex] = assignment<Id>(a);
  using L = LaneMap<kForm>;
  const int tile = blockIdx.x, cl = threadIdx.x % L::kColLanes;
  const int k = a.hidden, inter = a.inter, n = 2 * inter, n8 = n / 8, g = a.group13;
  // The first half of the column lanes on gate words, the second on the same up words.
  constexpr int kHalfLanes = L::kColLanes / 2;
  const int gate_word = tile * (4 * WPT) + (cl % kHalfLanes) * L::kWords;
  const int word0 = (cl / kHalfLanes) * (inter / 8) + gate_word;
  const bool col_ok = valid && gate_word < inter / 8;
  float y[1][L::kCols];
  expert_gemv<T, kForm>(static_cast<const T*>(a.x) + static_cast<int64_t>(f / a.topk) * a.x_stride,
                      a.w13_qweight + ex * k * n8, static_cast<const T*>(a.w13_scales) + ex * (k / g) * n,
                      a.w13_qzeros + ex * (k / g) * n8, n8, n, k, g, word0, col_ok, a.chunk13, a.cpb13, y, [] {});
  reduce_tile<L::kColLanes>(y, sh);

  constexpr int kHalfTile = kTileCols / 2;
  const int col0 = tile * kHalfTile;
  T* h = static_cast<T*>(a.h) + static_cast<int64_t>(f) * inter;
  const auto write = [&](int tc, float gate, float up) {
    h[col0 + tc] = Tr::from_float(act_fn<ACT>(kUnit * gate) * (kUnit * up));
  };
  if constexpr (kPart) {  // this split's sums, in units of 1 / kUnit; w2 adds the splits
    float* part = a.h_part + (static_cast<int64_t>(blockIdx.y) * a.n_assign + f) * n;
    for (int tc = threadIdx.x; tc < kHalfTile; tc += kGemvThreads) {
      if (col0 + tc >= inter) continue;
      __stcg(part + col0 + tc, tile_sum(sh, tc));
      __stcg(part + inter + col0 + tc, tile_sum(sh, kHalfTile + tc));
    }
    return;
  }
  if (gridDim.y == 1) {
    for (int tc = threadIdx.x; tc < kHalfTile; tc += kGemvThreads) {
      if (col0 + tc < inter) write(tc, tile_sum(sh, tc), tile_sum(sh, kHalfTile + tc));
    }
    return;
  }
  float* ws = a.ws13 + static_cast<int64_t>(f) * n;
  for (int tc = threadIdx.x; tc < kHalfTile; tc += kGemvThreads) {
    if (col0 + tc >= inter) continue;
    atomicAdd(ws + col0 + tc, tile_sum(sh, tc));
    atomicAdd(ws + inter + col0 + tc, tile_sum(sh, kHalfTile + tc));
  }
  if (!moe::arrive_last(a.counters13 + static_cast<int64_t>(f) * gridDim.x + tile, gridDim.y, sh.is_last)) return;
  for (int tc = threadIdx.x; tc < kHalfTile; tc += kGemvThreads) {
    if (col0 + tc >= inter) continue;
    float* pg = ws + col0 + tc;
    float* pu = ws + inter + col0 + tc;
    const float gate = __ldcg(pg), up = __ldcg(pu);
    __stcg(pg, 0.f);
    __stcg(pu, 0.f);
    write(tc, gate, up);
  }
}

// kPartAct >= 0 (the ring form only): h is read as w13's split sums in a.h_part, added here and
// passed through activation kPartAct (FASTAWQ_MOE_H_PARTIALS), rounded to T as w13 rounds h.
// kSums: the weighted tiles go into a.out_sums (zeroed by w13) and the block exits.
template <typename T, typename Id, int kForm, int kPartAct = -1, bool kSums = false>
__global__ void __launch_bounds__(kGemvThreads, 4) moe_w2_gemv_kernel(MoeGemvArgs a) {
  static_assert(kPartAct < 0 || kForm == 2, "h from split sums: the ring form only");
  constexpr float kUnit = kSumUnit<kForm>;
  using Tr = HalfTraits<T>;
  __shared__ TileRed sh;
  // The ids may be read before the wait: they come from the routing kernel, which had completed
  // before any w13 block passed its own wait, and this launch starts only once every w13 block
  // has (pdl_launch_dependents follows the wait). Read through L2 (another SM wrote them), they
  // let the block bring its first weight rows into L2 while w13 finishes.
  const auto [f, valid, ex] = assignment<Id>(a, true);
  using L = LaneMap<kForm>;
  const int tile = blockIdx.x, cl = threadIdx.x % L::kColLanes;
  const int k = a.inter, n = a.hidden, n8 = n / 8, g = a.group2;
  const int word0 = tile * (8 * WPT) + cl * L::kWords;
  const bool col_ok = valid && word0 < n8;
  const uint32_t* w2q = a.w2_qweight + ex * k * n8;
  {
    const int chunk = blockIdx.y * a.cpb2 + (threadIdx.x >> 5);
    const int c_end = min((blockIdx.y + 1) * a.cpb2, (k + a.chunk2 - 1) / a.chunk2);
    const int row0 = chunk * a.chunk2 + (threadIdx.x & 31) / L::kColLanes;
    if (chunk < c_end && col_ok) {  // the lane's rows of its first batch
#pragma unroll
      for (int u = 0; u < kBatchRows / L::kRowLanes; ++u) {
        prefetch_l2(w2q + static_cast<int64_t>(row0 + L::kRowLanes * u) * n8 + word0);
      }
    }
  }
  // h comes from the w13 launch. early_loads (FASTAWQ_GEMV_EARLY_LOADS=1): the ring loads its first
  // batch of weights (and zero words) into registers before this wait, not only into L2.
  const auto wait = [] {
    pdl_wait();
    pdl_launch_dependents();
  };
  float y[1][L::kCols];
  if constexpr (kPartAct >= 0) {
    // h over the warp's own rows (its chunks, at most kMoeHPartWarpRows: the host's rule), built
    // into the warp's slice of shared memory right after the wait: a lane a row, the splits' gate
    // and up sums (through L2: w13 wrote them) loaded 8 splits at a time and added in split order,
    // the activation applied and rounded to T as w13 rounds h. The ring then reads h from there.
    // wait_fill runs once per thread (the first call; the ring calls it after its first weight
    // loads, or it ran before the ring without early loads); only the warp meets after it.
    __shared__ __align__(16) T h_s[kWarps * kMoeHPartWarpRows];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunk = a.chunk2;
    const int c_first = blockIdx.y * a.cpb2 + warp;
    const int c_end = min((blockIdx.y + 1) * a.cpb2, (k + chunk - 1) / chunk);
    T* h_w = h_s + warp * kMoeHPartWarpRows;
    const float* part = a.h_part + static_cast<int64_t>(f) * 2 * k;
    const int64_t split_stride = static_cast<int64_t>(a.n_assign) * 2 * k;
    const int splits13 = a.splits13;
    const auto h_of = [&](int r) {
      float gate = 0.f, up = 0.f;
      for (int s0 = 0; s0 < splits13; s0 += 8) {
        float gv[8], uv[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float* p = part + (s0 + u) * split_stride + r;
          const bool ok = s0 + u < splits13;
          gv[u] = ok ? __ldcg(p) : 0.f;
          uv[u] = ok ? __ldcg(p + k) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) gate += gv[u], up += uv[u];
      }
      constexpr float kUnit13 = kSumUnit<2>;  // the units of w13's ring sums
      return Tr::from_float(act_fn<kPartAct>(kUnit13 * gate) * (kUnit13 * up));
    };
    bool filled = false;
    const auto wait_fill = [&] {
      if (filled) return;
      filled = true;
      wait();
      int slot = 0;
      for (int c = c_first; c < c_end; c += kWarps, slot += chunk) {
        const int r0 = c * chunk, r1 = min(r0 + chunk, k);
        for (int r = r0 + lane; r < r1; r += 32) h_w[slot + r - r0] = h_of(r);
      }
      __syncwarp();
    };
    // Row r (of the warp's chunks) in h_w: the warp's i-th chunk at i * chunk.
    const auto load_h = [h_w, c_first, chunk](int r) {
      const int c = r / chunk;
      return h_w[(c - c_first) / kWarps * chunk + (r - c * chunk)];
    };
    if (!a.early_loads) wait_fill();
    block_gemv_ring<T>(load_h, w2q, static_cast<const T*>(a.w2_scales) + ex * (k / g) * n,
                       a.w2_qzeros + ex * (k / g) * n8, n8, n, k, g, word0, col_ok, a.chunk2, a.cpb2, y, wait_fill);
  } else {
    if (!a.early_loads) wait();
    expert_gemv<T, kForm>(static_cast<const T*>(a.h) + static_cast<int64_t>(f) * k, w2q,
                          static_cast<const T*>(a.w2_scales) + ex * (k / g) * n, a.w2_qzeros + ex * (k / g) * n8, n8,
                          n, k, g, word0, col_ok, a.chunk2, a.cpb2, y, wait);
  }
  reduce_tile<L::kColLanes>(y, sh);

  const int col0 = tile * kTileCols, t = f / a.topk;
  const float rw = valid ? kUnit * a.topk_weights[f] : 0.f;
  if constexpr (kSums) {
    float* sums = a.out_sums + static_cast<int64_t>(t) * n;
    for (int tc = threadIdx.x; tc < kTileCols; tc += kGemvThreads) {
      if (col0 + tc < n) atomicAdd(sums + col0 + tc, rw * tile_sum(sh, tc));
    }
    return;
  }
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(t) * n;
  if (a.topk == 1 && gridDim.y == 1) {
    for (int tc = threadIdx.x; tc < kTileCols; tc += kGemvThreads) {
      if (col0 + tc < n) out[col0 + tc] = Tr::from_float(rw * tile_sum(sh, tc));
    }
    return;
  }
  float* ws = a.ws2 + static_cast<int64_t>(t) * n;
  for (int tc = threadIdx.x; tc < kTileCols; tc += kGemvThreads) {
    if (col0 + tc < n) atomicAdd(ws + col0 + tc, rw * tile_sum(sh, tc));
  }
  if (!moe::arrive_last(a.counters2 + static_cast<int64_t>(t) * gridDim.x + tile, a.topk * gridDim.y, sh.is_last)) return;
  for (int tc = threadIdx.x; tc < kTileCols; tc += kGemvThreads) {
    if (col0 + tc >= n) continue;
    float* p = ws + col0 + tc;
    const float v = __ldcg(p);
    __stcg(p, 0.f);
    out[col0 + tc] = Tr::from_float(v);
  }
}

// FASTAWQ_MOE_RING=0: the one-token kernels without the ring (an A/B switch, read once).
bool ring_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("FASTAWQ_MOE_RING");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

// The ring form's launches: split sums handed to w2 (kPart) or not, and the output as fp32 sums
// (kSums) or converted.
template <typename T, typename Id, int ACT, bool kPart, bool kSums>
void launch_ring(const MoeGemvArgs& a, const dim3& grid13, const dim3& grid2, cudaStream_t stream) {
  launch_pdl(moe_w13_gemv_kernel<T, Id, ACT, 2, kPart, kSums>, grid13, dim3(kGemvThreads), 0, stream, a);
  launch_pdl(moe_w2_gemv_kernel<T, Id, 2, kPart ? ACT : -1, kSums>, grid2, dim3(kGemvThreads), 0, stream, a);
}

// Returns whether it wrote a.out_sums (the ring form, when asked) rather than a.out.
template <typename T, typename Id, int ACT>
bool launch_typed(const MoeGemvArgs& a, cudaStream_t stream) {
  const dim3 grid13(a.tiles13, a.splits13, a.n_assign), grid2(a.tiles2, a.splits2, a.n_assign);
  // The half2 form at one token only (H200, RESULTS.md session 11: Mixtral-8x7B experts 88.9 ->
  // 83.7 us at T = 1, but 268.2 -> 279.0 at T = 4; Qwen3-30B-A3B unchanged at both), as a ring
  // unless FASTAWQ_MOE_RING=0 (H200, RESULTS.md session 13: Mixtral-8x7B experts 84.2 -> 68.9 us,
  // Qwen3-30B-A3B 20.3 -> 16.9 us; Mixtral decode 271.8 -> 313.4 tokens/s).
  if (a.n_assign == a.topk && gemv::h2_enabled<T>()) {
    if (ring_enabled()) {
      // h_part: FASTAWQ_MOE_H_PARTIALS=1 with w13 split (the host); out_sums: moe_gemv_w4_sums.
      const bool part = a.h_part != nullptr, sums = a.out_sums != nullptr;
      if (part && sums) {
        launch_ring<T, Id, ACT, true, true>(a, grid13, grid2, stream);
      } else if (part) {
        launch_ring<T, Id, ACT, true, false>(a, grid13, grid2, stream);
      } else if (sums) {
        launch_ring<T, Id, ACT, false, true>(a, grid13, grid2, stream);
      } else {
        launch_ring<T, Id, ACT, false, false>(a, grid13, grid2, stream);
      }
      return sums;
    }
    launch_pdl(moe_w13_gemv_kernel<T, Id, ACT, 1>, grid13, dim3(kGemvThreads), 0, stream, a);
    launch_pdl(moe_w2_gemv_kernel<T, Id, 1>, grid2, dim3(kGemvThreads), 0, stream, a);
  } else {
    launch_pdl(moe_w13_gemv_kernel<T, Id, ACT, 0>, grid13, dim3(kGemvThreads), 0, stream, a);
    launch_pdl(moe_w2_gemv_kernel<T, Id, 0>, grid2, dim3(kGemvThreads), 0, stream, a);
  }
  return false;
}

template <typename T, typename Id>
bool launch_act(const MoeGemvArgs& a, cudaStream_t stream) {
  switch (a.act) {
    case 0: return launch_typed<T, Id, 0>(a, stream);
    case 1: return launch_typed<T, Id, 1>(a, stream);
    default: return launch_typed<T, Id, 2>(a, stream);
  }
}

template <typename T>
bool launch_ids(const MoeGemvArgs& a, cudaStream_t stream) {
  if (a.ids_int64) return launch_act<T, int64_t>(a, stream);
  return launch_act<T, int32_t>(a, stream);
}

}  // namespace

bool launch_moe_gemv(const MoeGemvArgs& a, cudaStream_t stream) {
  if (a.dtype == HalfType::kHalf) return launch_ids<__half>(a, stream);
  return launch_ids<__nv_bfloat16>(a, stream);
}

}  // namespace fastawq
