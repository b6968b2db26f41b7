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
// H200 (benchmarks/RESULTS.md, session 14), geomean x cuBLAS fp16 over the Llama-3-8B shapes with
// the best tile: 1.14 / 0.82 / 0.52 / 0.42 / 0.30 at M = 16 / 32 / 64 / 128 / 256, no better than the
// register ring it replaced: ncu finds it bound by its instructions per warp at low occupancy, not
// by loads in flight. Not in the automatic choice (backend.py).
//
// Work: a block is 4 warps side by side on a 128 * CC-column tile (32 * CC columns each) and MT * 16
// rows, all on one contiguous range of 32-row steps (blockIdx.z splits K). Each warp stages its
// weights (read once, past L1) and the x rows its lanes need (through L1: the block's 4 warps read
// the same) in its own cp.async ring in shared memory, P - 1 steps in flight while one is consumed.
// Rows beyond M are clamped to row M - 1 on load and never stored. Blocks of one column tile
// and K range are adjacent in blockIdx.x (the M blocks), so M > 64 reads a tile's weights from DRAM
// once and from L2 after. Split K adds into the zeroed fp32 workspace [M, N] with 16-byte
// reductions; the last block of a (column tile, M block) to arrive converts and re-zeroes it.
//
// No L2 eviction hint on the weights' copies: ptxas 13.x can drop the createpolicy that feeds a
// cp.async's L2::cache_hint and leave the copy reading an unset uniform register as its
// descriptor, which traps (cudaErrorIllegalInstruction) -- it did here, in the main loop's refill
// (benchmarks/CUDA_NOTES.md, session 14; tests/test_sass.py checks every kernel's SASS for it).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace {

using gemv::column_pair;
using gemv::dequant_pair;

// Where x comes from (XMode, a template parameter; FASTAWQ_GEMM_SHARE_X / _STAGE_X pick it at each
// call). The block's shared memory: per warp a ring of P steps, each step kItems 16-byte items per lane
// (CC weight loads, then x rows g and g + 8 of each m-tile), lane-contiguous so every 16-byte
// access is conflict-free. A lane reads back only what it copied itself, so cp.async.wait_group
// alone orders the ring (no barrier), and a block's warps never wait for each other before the tail.
// kXShared (FASTAWQ_GEMM_SHARE_X=1): one ring for the block, each slot the 4 warps'
// weights (CC items a lane each) and the step's x tile once ([16 MT rows][4 chunks of 8 k], copied
// by the block's threads a 16-byte item each): the 4 warps no longer copy and hold the same x
// rows, so a slot is 4 CC + 2 MT KB against 4 (CC + 2 MT) KB (at MT = CC = 1, 3 KB against 6:
// twice the blocks an SM by shared memory). The price: one barrier a step (each warp reads x
// that other threads copied, and a slot is refilled only once every warp has consumed it).
// kXStaged (FASTAWQ_GEMM_STAGE_X=1): the per-warp ring holds weights only, and the block's x for
// its whole K range (at most kStageSteps: 16 steps at MT = 1, 8 above; 16-32 KB) is staged once,
// after the PDL wait, through registers in the mma's A order: the 16 bytes at (step, m-tile, h,
// lane (g, t)) are the lane's A quad of k-step h, {x[g][k0, k0 + 1], x[g + 8][k0, k0 + 1], x[g][k0 + 2, k0 + 3],
// x[g + 8][k0 + 2, k0 + 3]} with k0 = 8t + 4h, so a quad is one 16-byte shared load into the four
// consecutive registers the mma reads (the other modes load rows g and g + 8 and move words into
// quads: 28 IMAD.MOV a step in the SASS, CUDA_NOTES.md session 14). No x copies, pointers or
// barriers in the main loop, and half the shared memory of kXPerWarp at MT = CC = 1.
enum XMode : int { kXPerWarp = 0, kXShared = 1, kXStaged = 2 };
// At MT = 4 a cap of 4 steps would cut K into ranges so short that the split-K sums (M x N fp32
// a split) outweigh the weights; 8 steps keep Llama's 4096 x 4096 at M = 64 to one wave of 16 splits.
template <int MT>
constexpr int kStageSteps = MT == 1 ? 16 : 8;
template <int MT>
constexpr int kStageBytes = kStageSteps<MT> * MT * 1024;

template <int MT, int CC, int kX = kXPerWarp>
constexpr int kRingStepBytes = kX == kXShared   ? kPackedThreads / 32 * CC * 512 + MT * 1024
                               : kX == kXStaged ? CC * 512
                                                : (CC + 2 * MT) * 32 * 16;
template <int MT, int CC, int P, int kX = kXPerWarp>
constexpr int kRingBytes =
    kX == kXShared ? P * kRingStepBytes<MT, CC, kX> : kPackedThreads / 32 * P * kRingStepBytes<MT, CC, kX>;

template <typename T, int MT, int CC, int P, int kX>
__global__ void __launch_bounds__(kPackedThreads) awq_gemm_packed_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int m, int n, int k, int group_size,
    int steps_per_block, bool early_loads) {
  using Tr = HalfTraits<T>;
  using T2 = typename Tr::T2;
  constexpr bool kShareX = kX == kXShared, kStaged = kX == kXStaged;
  constexpr int kStepBytes = kRingStepBytes<MT, CC, kX>;
  static_assert(!kShareX || P >= 2, "the shared ring waits for P - 2 younger steps");
  constexpr int kRows = 16 * MT;
  constexpr int kQuads = kPackedThreads / 32 * 8 * CC;  // 4-column chunks of the block's tile
  extern __shared__ __align__(16) uint8_t ring_smem[];
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
  const int64_t w_step = 4 * static_cast<int64_t>(n4);
  const uint4* w_next = wp + static_cast<int64_t>(t) * n4 + c4w + g + s0 * w_step;

  // Per warp: item i of slot p at ring0 + p * kStepBytes + i * 512. Shared: slot p at base + p *
  // kStepBytes holds warp w's item cc at (w CC + cc) 512 + 16 lane, then the x tile, item j at
  // 512 * 4 CC + 16 j. Staged: the 4 warps' rings, then the x quads from xstage0 (lane (g, t) at
  // + 16 (8 t + g), step r's m-tile mt and k-step h at + ((r MT + mt) 2 + h) 512). Global sources
  // step one step per issue.
  const uint32_t base = smem_addr(ring_smem);
  const uint32_t ring0 = kShareX ? pinned(base + warp * CC * 512 + lane * 16)
                                 : pinned(base + warp * (P * kStepBytes) + lane * 16);
  // The lane's place in a weight item: the layout's row order (gemv::row_order_offset: a warp's copy
  // of 512 bytes in 4 shared wavefronts, where 16 lane scattered each 128-byte line over 8 places and
  // took 32); the x items keep 16 lane, where a row's 4 chunks are the 4 lanes t of one g. H100,
  // session 36, same call: geomean x cuBLAS fp16 at M = 16 / 32 / 64 1.54 / 1.06 / 0.60 against
  // 1.33 / 1.02 / 0.59 (the kernel runs M >= 9 where awq_wgmma_packed does not: before Hopper).
  const uint32_t wring0 = pinned(ring0 - lane * 16 + gemv::row_order_offset(g, t));
  [[maybe_unused]] const uint32_t xring0 = pinned(base + kPackedThreads / 32 * CC * 512);
  [[maybe_unused]] const uint32_t xstage0 = base + kPackedThreads / 32 * P * kStepBytes;
  constexpr int kXCopies = kStaged ? 1 : (kShareX ? (MT * 64 + kPackedThreads - 1) / kPackedThreads : 2 * MT);
  const T* x_next[kXCopies];  // set after the PDL wait (the staged form copies none)
  const auto w_addr = [&](int slot, int cc) { return wring0 + slot * kStepBytes + cc * 512; };
  const auto x_addr = [&](int slot, int mt, int r) {
    if constexpr (kShareX) {
      return xring0 + slot * kStepBytes + (mt * 64 + (8 * r + g) * 4 + t) * 16;
    } else {
      return ring0 + slot * kStepBytes + (CC + 2 * mt + r) * 512;
    }
  };
  const auto issue = [&](int slot) {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) cp_async16_at(w_addr(slot, cc), w_next + 8 * cc, col_ok[cc]);
    if constexpr (!kStaged) {
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        if constexpr (kShareX) {
          if (static_cast<int>(threadIdx.x) + kPackedThreads * i < MT * 64) {
            cp_async16_ca_at(xring0 + slot * kStepBytes + (threadIdx.x + kPackedThreads * i) * 16, x_next[i]);
          }
        } else {
          cp_async16_ca_at(x_addr(slot, i >> 1, i & 1), x_next[i]);
        }
        x_next[i] += kPackedBatchRows;
      }
    }
    w_next += w_step;
  };
  // The ring: step s is copied into slot (s - s0) % P while P - 1 younger steps are in flight; one
  // commit group per step (empty past the range), so wait_group counts steps. (A ring of register
  // loads does not pipeline: ptxas tracks all of a warp's global loads on one scoreboard, so the
  // first use of the oldest slot waits for the youngest too.)
  const auto fill_ring = [&]() {
#pragma unroll
    for (int d = 0; d < P - 1; ++d) {
      if (s0 + d < s1) issue(d);
      cp_async_commit();
    }
  };

  // Before the PDL wait: the staged form with FASTAWQ_GEMV_EARLY_LOADS=1 copies its first P - 1
  // steps of weights into the ring (no kernel that can launch this one early writes weights:
  // awq_gemv_packed.h); otherwise they are only prefetched into L2 (awq_gemv_packed.cu says why).
  const bool early = kStaged && early_loads;
  if (early) {
    fill_ring();
  } else {
    for (int s = s0; s < min(s0 + P, s1); ++s) {
#pragma unroll
      for (int cc = 0; cc < CC; ++cc) {
        if (col_ok[cc]) prefetch_l2(w_next + (s - s0) * w_step + 8 * cc);
      }
    }
  }
  pdl_wait();
  pdl_launch_dependents();

  if constexpr (kStaged) {
    // Item j of the block's x: step j / (32 MT), m-tile (j / 32) % MT, chunk (j / 8) % 4 (t), row
    // pair j % 8 (g); its 16-byte loads of rows g and g + 8 (clamped to row M - 1: they feed only
    // outputs never stored) become the quads of k-steps 0 and 1 at xstage0 + 1024 (j / 32) +
    // 16 (j % 32) and + 512. A round's loads (up to 4 items a thread: 8 in flight) are all issued
    // before its first store, one L2 round trip a round (one round at MT = 1 and 2, two at MT = 4,
    // whose 8 items would hold 64 registers of x at once).
    constexpr int kPer = kStageSteps<MT> * MT * 32 / kPackedThreads, kRound = kPer < 4 ? kPer : 4;
    const int items = (s1 - s0) * MT * 32;
#pragma unroll
    for (int i0 = 0; i0 < kPer; i0 += kRound) {
      uint4 u[kRound], v[kRound];
#pragma unroll
      for (int i = 0; i < kRound; ++i) {
        const int j = static_cast<int>(threadIdx.x) + kPackedThreads * (i0 + i);
        if (j < items) {
          const int r = j / (32 * MT), mt = (j >> 5) % MT, c = (j >> 3) & 3, p = j & 7;
          const int row = row0 + 16 * mt + p;
          const T* src = x + static_cast<int64_t>(s0 + r) * kPackedBatchRows + 8 * c;
          u[i] = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(min(row, m - 1)) * k);
          v[i] = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(min(row + 8, m - 1)) * k);
        }
      }
#pragma unroll
      for (int i = 0; i < kRound; ++i) {
        const int j = static_cast<int>(threadIdx.x) + kPackedThreads * (i0 + i);
        if (j < items) {
          const uint32_t at = xstage0 + (j >> 5) * 1024 + (j & 31) * 16;
          st_shared128_at(at, make_uint4(u[i].x, v[i].x, u[i].y, v[i].y));
          st_shared128_at(at + 512, make_uint4(u[i].z, v[i].z, u[i].w, v[i].w));
        }
      }
    }
    __syncthreads();
  } else {
    // The x rows a thread copies (rows past M clamped to row M - 1: they feed only outputs never
    // stored). Per warp: the lane's rows row0 + 16 mt + 8 r + g, chunk t. Shared: item j = tid + 128 q
    // of the block's x tile, row row0 + j / 4, chunk j % 4.
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      int row, chunk;
      if constexpr (kShareX) {
        const int j = min(static_cast<int>(threadIdx.x) + kPackedThreads * i, MT * 64 - 1);
        row = row0 + (j >> 2), chunk = j & 3;
      } else {
        row = row0 + 16 * (i >> 1) + 8 * (i & 1) + g, chunk = t;
      }
      x_next[i] =
          x + static_cast<int64_t>(min(row, m - 1)) * k + 8 * chunk + static_cast<int64_t>(s0) * kPackedBatchRows;
    }
  }

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

  float acc[MT][CC][4][4] = {};
  // Staged: the lane's quads of the current step (advanced by MT KB a step).
  [[maybe_unused]] uint32_t xq = kStaged ? pinned(xstage0 + (8 * t + g) * 16) : 0;

  const auto consume = [&](int slot) {
    uint4 xc[MT][2];  // staged: quads of k-steps 0, 1; otherwise rows g, g + 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (kStaged) {
          xc[mt][r] = ld_shared128_at(xq + (2 * mt + r) * 512);
        } else {
          xc[mt][r] = ld_shared128_at(x_addr(slot, mt, r));
        }
      }
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      const uint4 w = ld_shared128_at(w_addr(slot, cc));
      uint32_t b[2][4][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t word = h == 0 ? (r == 0 ? w.x : w.y) : (r == 0 ? w.z : w.w);
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
          uint32_t a[4];
          if constexpr (kStaged) {
            a[0] = xc[mt][h].x, a[1] = xc[mt][h].y, a[2] = xc[mt][h].z, a[3] = xc[mt][h].w;
          } else {
            a[0] = h == 0 ? xc[mt][0].x : xc[mt][0].z, a[1] = h == 0 ? xc[mt][1].x : xc[mt][1].z;
            a[2] = h == 0 ? xc[mt][0].y : xc[mt][0].w, a[3] = h == 0 ? xc[mt][1].y : xc[mt][1].w;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma<T>::run(acc[mt][cc][j], a, b[h][j][0], b[h][j][1]);
        }
    }
  };

  if (s0 < s1) {
    load_scales();
    set_group();
  }
  if (!early) fill_ring();
  int group_left = steps_per_group - s0 % steps_per_group;  // steps until the current group ends
  int slot = 0;
#pragma unroll 1
  for (int s = s0; s < s1; ++s) {
    const int refill = slot == 0 ? P - 1 : slot - 1;
    if constexpr (kShareX) {
      // Wait for this thread's copies of step s, then meet: every thread's copies of step s have
      // landed and every warp is done with step s - 1, whose slot is refilled with step s + P - 1.
      cp_async_wait<P - 2>();
      __syncthreads();
      if (s + P - 1 < s1) issue(refill);
      cp_async_commit();
    } else {
      // Refill the slot consumed last step with step s + P - 1, then wait for step s.
      if (s + P - 1 < s1) issue(refill);
      cp_async_commit();
    }
    // The next group's (scale, zero) pairs, fetched a step before they are needed.
    if (group_left == 1 && s + 1 < s1) {
      sz_lane += n4;
      load_scales();
    }
    if constexpr (!kShareX) cp_async_wait<P - 1>();
    consume(slot);
    if constexpr (kStaged) xq += MT * 1024;
    slot = slot == P - 1 ? 0 : slot + 1;
    if (--group_left == 0) {
      group_left = steps_per_group;
      set_group();
    }
  }
  cp_async_wait<0>();

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
  // The staged form fences once a block; the others fence in every thread (session 14's ncu: 1.3 of
  // a warp's 11.6 cycles between instructions).
  gemv::convert_when_last<!kStaged, kPackedThreads>(ws, counters, is_last, row0, kRows, m, blockIdx.y * kQuads,
                                                    kQuads, n, store4);
}

// The ring's depth: up to 8 steps (7 in flight), 8 weight copies a lane, ~72 KB a block.
template <int MT, int CC, int kX = kXPerWarp>
constexpr int gemm_ring_depth() {
  constexpr int by_weights = 8 / CC;
  constexpr int by_smem =
      73728 / (kX == kXShared ? kRingStepBytes<MT, CC, kX> : kPackedThreads / 32 * kRingStepBytes<MT, CC, kX>);
  constexpr int p = by_weights < by_smem ? by_weights : by_smem;
  return p > 8 ? 8 : (p < 3 ? 3 : p);
}

// FASTAWQ_GEMM_RING_DEPTH=4: the shallower ring (a debugging and A/B switch, read once).
bool shallow_ring() {
  static const bool on = [] {
    const char* v = std::getenv("FASTAWQ_GEMM_RING_DEPTH");
    return v != nullptr && std::string(v) == "4";
  }();
  return on;
}

// FASTAWQ_GEMM_SHARE_X=1 / FASTAWQ_GEMM_STAGE_X=1: the x modes above (A/B switches, read at each
// call, so a graph reads them at capture and the split plan's occupancy query sees the same
// instance as the launch). The staged form is launched only where the host entry set a.stage_x
// (its block's K range fits the staged region); it wins over the shared ring when both are set.
bool share_x() { return env_flag_on("FASTAWQ_GEMM_SHARE_X"); }

template <typename T, int MT, int CC, int kP, int kX = kXPerWarp>
void launch_depth(const GemmPackedArgs& a, cudaStream_t stream, int* resident) {
  constexpr auto kernel = awq_gemm_packed_kernel<T, MT, CC, kP, kX>;
  // The staged form's x region is sized by the launch's steps a block; the opt-in and the
  // occupancy query take the largest (what the host plan assumes when it sizes the grid).
  constexpr int kMaxSmem = kRingBytes<MT, CC, kP, kX> + (kX == kXStaged ? kStageBytes<MT> : 0);
  opt_in_shared_memory<kernel>(kMaxSmem);
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kPackedThreads, kMaxSmem);
    return;
  }
  const int smem =
      kRingBytes<MT, CC, kP, kX> + (kX == kXStaged ? std::min(a.steps_per_warp, kStageSteps<MT>) * MT * 1024 : 0);
  launch_pdl(kernel, dim3(a.m_blocks, a.col_tiles, a.splits), dim3(kPackedThreads), smem, stream,
             static_cast<const T*>(a.x), reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz),
             static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n, a.k,
             a.group_size, a.steps_per_warp, a.early_loads);
}

template <typename T, int MT, int CC>
void launch_cfg(const GemmPackedArgs& a, cudaStream_t stream, int* resident) {
  if (a.stage_x) return launch_depth<T, MT, CC, gemm_ring_depth<MT, CC, kXStaged>(), kXStaged>(a, stream, resident);
  if (share_x()) return launch_depth<T, MT, CC, gemm_ring_depth<MT, CC, kXShared>(), kXShared>(a, stream, resident);
  if (shallow_ring()) return launch_depth<T, MT, CC, 4>(a, stream, resident);
  launch_depth<T, MT, CC, gemm_ring_depth<MT, CC>()>(a, stream, resident);
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

int gemm_packed_stage_steps(const GemmPackedArgs& a) {
  if (!env_flag_on("FASTAWQ_GEMM_STAGE_X")) return 0;
  return a.m_tiles == 1 ? kStageSteps<1> : (a.m_tiles == 2 ? kStageSteps<2> : kStageSteps<4>);
}

}  // namespace fastawq
