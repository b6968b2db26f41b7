// W4A16 for small batches (M = 1..32) on the tensor cores, "swap AB", on the load-time repacked
// layout of awq_gemv_packed.h: y^T[N, M] = W^T[N, K] x^T[K, M] with mma.sync m16n8k16, output
// channels as the mma's M (16 per tile) and the batch as its N (8 rows per tile, NT tiles).
//
// Fragments straight from the layout (the mma's k and row orders are free labels):
//   A: lane (g, t) of a warp loads the 16 bytes at (kb = 4s + t, c4 = chunk + g): rows
//      32s + 8t .. +7 of columns 4c4 .. 4c4 + 3. Columns 0, 1 are rows g, g + 8 of m-tile 0, columns
//      2, 3 those of m-tile 1; rows 4h .. 4h + 3 are the lane's k slice {2t, 2t+1, 2t+8, 2t+9} of
//      k-step h = 0, 1. Word j holds rows 2j (even nibbles) and 2j + 1 (odd ones), so the register
//      of (column c, rows 2j, 2j + 1) is byte c of word j and byte c of word j >> 4 side by side
//      (one byte permute), masked and OR-ed into the mantissa of the magic number: magic + q, exact.
//   B: the same k labels make the lane's B fragment of k-step h x[row g][32s + 8t + 4h .. +3], so
//      one 16-byte load of x[row][32s + 8t ..] feeds both k-steps.
//   C: lane (g, t) ends with the columns 4c4 .. 4c4 + 3 for batch rows 2t, 2t + 1.
// No dequantization arithmetic per weight: the mma multiplies x by magic + q, and per group and
// column, sum_k x (q - z) s = s (sum_k x (magic + q) - (magic + z) sum_k x). The sum of x comes from
// one more mma per k-step with A all ones (its result lands in the C layout). Partial sums stay per
// group (<= 128 rows), so the magic offset costs ~8 of fp32's 24 bits.
//
// Work, as the CUDA-core kernel of awq_gemv_packed.cu: a block is 4 warps on one tile of 32 * CC
// columns (CC chunks of 32), each warp on its own contiguous range of 32-row steps. Weights (read
// once) are staged P steps ahead in one of two rings: the lane's own registers (kRegs, one batch
// tile: M <= 8; x is read from L1/L2 as each step is consumed), or a per-warp cp.async ring in
// shared memory that also carries x (two or more batch tiles, whose accumulators leave no
// registers for a ring). Tail: shared memory across the 4 warps, split-K through the zeroed fp32
// workspace with the last block of a column tile converting (gemv::store_tile).
//
// H200 (benchmarks/RESULTS.md, session 10), geomean x cuBLAS fp16 over the Llama-3-8B shapes:
// register ring 1.76 / 1.67 / 1.61 / 1.43 at M = 1 / 2 / 4 / 8, where the cp.async ring gave 1.34 /
// 1.32 / 1.30 / 1.27 with the same instructions: per warp the cp.async ring's wait held each step
// for the oldest copy, and the time stayed flat from M = 1 to 8 at ~1.4 TB/s whatever the
// instruction count (204 -> 131 SASS instructions a step changed it by 5 %). At M = 16 the
// cp.async ring stays (1.03 against 0.95). So the kernel serves M = 3..16 (backend.py); the
// CUDA-core GEMV, with its half2 sums, keeps M = 1 and 2 (2.18 / 1.72 against 1.76 / 1.66, session 11).
#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/gemv_common.cuh"

namespace fastawq {
namespace {

using gemv::column_pair;
constexpr int kWarps = kPackedThreads / 32;

// f(cc, i, nt, r) for every accumulator of a lane: chunk cc, m-tile i, batch tile nt, element r.
template <int CC, int NT, typename F>
__device__ __forceinline__ void for_each_fragment(F&& f) {
#pragma unroll
  for (int cc = 0; cc < CC; ++cc)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) f(cc, i, nt, r);
}

// Shared memory of one block: the cp.async ring of each warp's lanes (weights then activations of
// P steps, 16 bytes per lane and item, lane-contiguous so every 16-byte access is conflict-free),
// reused for the warps' partial sums once the ring is drained.
template <int NT, int CC, int P>
struct MmaSmem {
  static constexpr int kItems = CC + NT;
  union {
    uint4 ring[kWarps][P][kItems][32];
    float red[kWarps][NT * 8][CC * 32];
  };
  int is_last;
};

// kRegs: the ring is P steps of registers instead (P - 1 steps in flight while one is consumed):
// each lane's 16-byte loads land in its own registers, with no shared-memory round trip and no
// cp.async bookkeeping; shared memory then holds only the tail's partial sums.
// DEFER (FASTAWQ_MMA_DEFER=1, with kRegs; an A/B switch): each slot's refill waits until the next
// slot's first use. Every weight load of a warp gets one scoreboard, so a slot's first use waits for
// all loads in flight; refilled right after its own use, the previous slot's load was among them and
// each step waited a whole memory latency (SASS, CUDA_NOTES.md session 17). Deferred, the loads a
// first use waits for were issued a step of math earlier.
template <typename T, int NT, int CC, int P, bool kRegs, bool DEFER = false>
__global__ void __launch_bounds__(kPackedThreads, DEFER && NT == 1 && CC == 1 ? 5 : 0) awq_mma_packed_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int m, int n, int k, int group_size,
    int steps_per_warp) {
  using Tr = HalfTraits<T>;
  constexpr int kRows = NT * 8;
  constexpr int kTileCols = CC * 32;
  __shared__ MmaSmem<NT, CC, kRegs ? 1 : P> sm;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n4 = n >> 2;
  const int c4 = static_cast<int>(pinned(blockIdx.x * (8 * CC) + g));  // the lane's chunk cc is at c4 + 8 cc
  bool col_ok[CC];
#pragma unroll
  for (int cc = 0; cc < CC; ++cc) col_ok[cc] = c4 + 8 * cc < n4;  // n % 8 == 0: whole 4-column chunks
  const int s_total = k / kPackedBatchRows;
  const int s0 = (blockIdx.y * kWarps + warp) * steps_per_warp;
  const int s1 = min(s0 + steps_per_warp, s_total);
  const uint64_t policy = evict_first_policy();
  const uint4* w_lane = wp + static_cast<int64_t>(t) * n4 + c4;  // + 4 n4 per step, + 8 per chunk
  const int64_t w_step = 4 * static_cast<int64_t>(n4);
  const int steps_per_group = group_size / kPackedBatchRows;

  // L2 prefetch of the first P steps before the PDL wait, as awq_gemv_packed.cu says why.
  for (int s = s0; s < min(s0 + P, s1); ++s) {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      if (col_ok[cc]) prefetch_l2(w_lane + s * w_step + 8 * cc);
    }
  }
  pdl_wait();
  pdl_launch_dependents();

  // The lane's B rows: batch row nt * 8 + g (clamped: rows >= m only feed columns never stored).
  const T* x_lane[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) x_lane[nt] = x + static_cast<int64_t>(min(nt * 8 + g, m - 1)) * k + 8 * t;

  // The ring: step s is copied into slot (s - s0) % P while P - 1 younger steps are in flight. A
  // lane reads back only the bytes it copied itself, so cp.async.wait_group alone orders them (no
  // barrier), and the warps of a block never wait for each other until the tail.
  // Addresses step instead of being recomputed per copy: the shared slots as 32-bit addresses
  // (item i of slot p at ring0 + p * kSlotBytes + i * 512), the global sources as pointers that
  // advance one step per issue (issue is called for s0, s0 + 1, ... in order).
  constexpr uint32_t kSlotBytes = MmaSmem<NT, CC, kRegs ? 1 : P>::kItems * 32 * 16;
  // (The register ring has no shared ring: pinned() is volatile, so it is not even computed there.)
  const uint32_t ring0 = kRegs ? 0u : pinned(smem_addr(&sm.ring[warp][0][0][lane]));
  const uint4* w_next = w_lane + s0 * w_step;
  const T* x_next[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) x_next[nt] = x_lane[nt] + static_cast<int64_t>(s0) * kPackedBatchRows;
  const auto issue = [&](int slot) {
    const uint32_t dst = ring0 + slot * kSlotBytes;
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) cp_async16_stream_at(dst + cc * 512, w_next + 8 * cc, col_ok[cc], policy);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      cp_async16_at(dst + (CC + nt) * 512, x_next[nt], true);
      x_next[nt] += kPackedBatchRows;
    }
    w_next += w_step;
  };
  const uint4* sz_lane = sz + static_cast<int64_t>(s0 / steps_per_group) * n4 + c4;  // the current group's row
  const auto load_scales = [&](uint4(&sv)[CC]) {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) sv[cc] = col_ok[cc] ? __ldg(sz_lane + 8 * cc) : make_uint4(0, 0, 0, 0);
  };

  float y[CC][2][NT][4], acc[CC][2][NT][4], xs[NT][4];
  for_each_fragment<CC, NT>([&](int cc, int i, int nt, int r) { y[cc][i][nt][r] = acc[cc][i][nt][r] = 0.f; });
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) xs[nt][r] = 0.f;
  const uint32_t ones[4] = {Tr::kOne2, Tr::kOne2, Tr::kOne2, Tr::kOne2};

  uint4 sv[CC];  // the current group's (scale, zero) pairs, fetched when the group starts
  if (s0 < s1) load_scales(sv);
  if constexpr (!kRegs) {
#pragma unroll
    for (int d = 0; d < P - 1; ++d) {
      if (s0 + d < s1) issue(d);
      cp_async_commit();  // one group per step, empty past the range, so wait_group counts steps
    }
  }

  // after_first(): once chunk 0's weights of k-step 0 are in use.
  const auto consume = [&](const uint4(&wc)[CC], const uint4(&xc)[NT], auto&& after_first) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t b0[NT], b1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        b0[nt] = h == 0 ? xc[nt].x : xc[nt].z;
        b1[nt] = h == 0 ? xc[nt].y : xc[nt].w;
        Mma<T>::run(xs[nt], ones, b0[nt], b1[nt]);
      }
#pragma unroll
      for (int cc = 0; cc < CC; ++cc) {
        const uint32_t w0 = h == 0 ? wc[cc].x : wc[cc].z, w1 = h == 0 ? wc[cc].y : wc[cc].w;
        const uint32_t w0s = w0 >> 4, w1s = w1 >> 4;
        const uint32_t a0[4] = {column_pair<T, 0>(w0, w0s), column_pair<T, 1>(w0, w0s), column_pair<T, 0>(w1, w1s),
                                column_pair<T, 1>(w1, w1s)};
        const uint32_t a1[4] = {column_pair<T, 2>(w0, w0s), column_pair<T, 3>(w0, w0s), column_pair<T, 2>(w1, w1s),
                                column_pair<T, 3>(w1, w1s)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          Mma<T>::run(acc[cc][0][nt], a0, b0[nt], b1[nt]);
          Mma<T>::run(acc[cc][1][nt], a1, b0[nt], b1[nt]);
        }
        if (h == 0 && cc == 0) after_first();
      }
    }
  };

  // y += s (acc - (magic + z) xs) per column, then the group's sums restart.
  const auto close_group = [&]() {
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) {
      const T* p = reinterpret_cast<const T*>(&sv[cc]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // column j: m-tile j / 2, fragment rows g (j even) or g + 8
        const float sc = Tr::to_float(p[2 * j]);
        const float zm = Tr::kMagic + Tr::to_float(p[2 * j + 1]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& a = acc[cc][j >> 1][nt][2 * (j & 1) + e];
            float& o = y[cc][j >> 1][nt][2 * (j & 1) + e];
            o = fmaf(sc, fmaf(-zm, xs[nt][e], a), o);
            a = 0.f;
          }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) xs[nt][r] = 0.f;
  };

  int group_left = steps_per_group - s0 % steps_per_group;  // steps until the current group ends
  // After step s: close the group when the next step starts a new one or the warp's range ends
  // (group_size % 32 == 0: a step never straddles groups).
  // DEFER: the next group's pairs are loaded at its first step's first use, not at the close (there
  // the next step's first use would wait for them, on the weights' scoreboard).
  [[maybe_unused]] bool scales_due = false;
  const auto after_step = [&](int s) {
    if (--group_left == 0 || s + 1 == s1) {
      close_group();
      group_left = steps_per_group;
      sz_lane += n4;
      if (s + 1 < s1) {
        if constexpr (DEFER) {
          scales_due = true;
        } else {
          load_scales(sv);
        }
      }
    }
  };
  if constexpr (kRegs) {
    // Slot r holds steps s0 + r, s0 + r + P, ...: consumed, then refilled with the step P later.
    // x (a few KB, L1/L2-resident after the first warps) is read as each step is consumed.
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
#pragma unroll 1
    for (int s = s0; s < s1; s += P) {
#pragma unroll
      for (int r = 0; r < P; ++r) {
        if (s + r < s1) {
          uint4 xc[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            xc[nt] = __ldg(reinterpret_cast<const uint4*>(x_next[nt]));
            x_next[nt] += kPackedBatchRows;
          }
          if constexpr (DEFER) {
            // The previous slot's refill (step s + r - 1 + P), after this slot's first use.
            const int sp = s + r - 1;
            consume(rw[r], xc, [&]() {
              if (sp >= s0 && sp + P < s1) fetch(rw[(r + P - 1) % P]);
              if (scales_due) load_scales(sv), scales_due = false;
            });
          } else {
            consume(rw[r], xc, []() {});
            if (s + r + P < s1) fetch(rw[r]);
          }
          after_step(s + r);
        }
      }
    }
  } else {
    int slot = 0;
#pragma unroll 1
    for (int s = s0; s < s1; ++s) {
      // Refill the slot consumed last iteration with step s + P - 1, then wait for step s.
      const int refill = slot == 0 ? P - 1 : slot - 1;
      if (s + P - 1 < s1) issue(refill);
      cp_async_commit();
      cp_async_wait<P - 1>();
      uint4 wc[CC], xc[NT];
      const uint32_t src = ring0 + slot * kSlotBytes;
#pragma unroll
      for (int cc = 0; cc < CC; ++cc) wc[cc] = ld_shared128_at(src + cc * 512);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xc[nt] = ld_shared128_at(src + (CC + nt) * 512);
      consume(wc, xc, []() {});
      slot = slot == P - 1 ? 0 : slot + 1;
      after_step(s);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring before the partial sums reuse it

  // C fragment (g, t): element r is batch row 2t + (r & 1) of fragment row g (r < 2) or g + 8.
  for_each_fragment<CC, NT>([&](int cc, int i, int nt, int r) {
    sm.red[warp][nt * 8 + 2 * t + (r & 1)][32 * cc + 4 * g + 2 * i + (r >> 1)] = y[cc][i][nt][r];
  });
  __syncthreads();

  gemv::store_tile<T, kRows, kPackedThreads, kWarps, kTileCols>(sm.red, sm.is_last, bias, out, ws, counters, n,
                                                                blockIdx.x * kTileCols, m, 1.f);
}

// P ring slots: as many as fit in ~45 KB of static shared memory, 3..6 (P - 1 steps in flight).
template <int NT, int CC>
constexpr int ring_depth() {
  constexpr int fit = 46080 / (kWarps * 32 * 16 * (CC + NT));
  return fit > 6 ? 6 : (fit < 3 ? 3 : fit);
}

// The register ring's depth: about 8 16-byte weight loads of a lane across its slots.
template <int NT, int CC>
constexpr int register_ring_depth() {
  constexpr int d = 8 / CC;
  return d > 6 ? 6 : (d < 2 ? 2 : d);
}

// The register ring's deferred refills (DEFER above), unless FASTAWQ_MMA_DEFER=0 (read at each call,
// so a graph reads it at capture and the split plan's occupancy query sees the launch's instance).
// H200, session 18 (RESULTS.md): Llama-3-8B shape decode +1.7 % at batch 4, +1.8 % at batch 8.
bool mma_defer() { return env_switch("FASTAWQ_MMA_DEFER") != 0; }

template <typename T, int NT, int CC>
auto kernel_of(bool regs) {
  if (regs && mma_defer()) return awq_mma_packed_kernel<T, NT, CC, register_ring_depth<NT, CC>(), true, true>;
  return regs ? awq_mma_packed_kernel<T, NT, CC, register_ring_depth<NT, CC>(), true>
              : awq_mma_packed_kernel<T, NT, CC, ring_depth<NT, CC>(), false>;
}

template <typename T, int NT, int CC>
void launch_cfg(const MmaPackedArgs& a, cudaStream_t stream, int* resident) {
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel_of<T, NT, CC>(a.register_ring), kPackedThreads, 0);
    return;
  }
  launch_pdl(kernel_of<T, NT, CC>(a.register_ring), dim3(a.col_tiles, a.splits), dim3(kPackedThreads), 0, stream,
             static_cast<const T*>(a.x), reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz),
             static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n, a.k,
             a.group_size, a.steps_per_warp);
}

template <typename T, int NT>
void launch_nt(const MmaPackedArgs& a, cudaStream_t stream, int* resident) {
  switch (a.chunks) {  // the host entry sends only the chunk counts of mma_packed_chunks_ok
    case 1: return launch_cfg<T, NT, 1>(a, stream, resident);
    case 2: return launch_cfg<T, NT, 2>(a, stream, resident);
    default:
      if constexpr (NT < 4) return launch_cfg<T, NT, 4>(a, stream, resident);
  }
}

template <typename T>
void launch_t(const MmaPackedArgs& a, cudaStream_t stream, int* resident) {
  const int nt = mma_packed_tiles(a.m);
  if (nt == 1) return launch_nt<T, 1>(a, stream, resident);
  if (nt == 2) return launch_nt<T, 2>(a, stream, resident);
  return launch_nt<T, 4>(a, stream, resident);
}

}  // namespace

void launch_awq_mma_packed(const MmaPackedArgs& a, cudaStream_t stream) {
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, stream, nullptr); });
}

int mma_packed_resident_blocks(const MmaPackedArgs& a) {
  int blocks = 0;
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, nullptr, &blocks); });
  return blocks > 0 ? blocks : 1;
}

}  // namespace fastawq
