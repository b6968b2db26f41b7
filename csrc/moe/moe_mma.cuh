// W4A16 mixture-of-experts for a few tokens per expert, on the tensor cores and on the AWQ layout
// itself: one block row per expert, each block gathering the assignments routed to its expert, so
// an expert's weights are read once per call however many tokens chose it (moe_gemv.cu reads them
// once per assignment: Qwen3-30B-A3B at 16 tokens reads 128 expert matrices for ~82 distinct).
//
// "Swap AB" mma.sync m16n8k16: output columns are the mma's rows, the expert's tokens its 8
// columns, in passes of 8 or 16 tokens (one or two n-tiles sharing each A fragment; the host
// picks by the load, 16 once experts get more than 8). The mma's k and row labels are free, so
// they are chosen to match what a lane can load from the AWQ layout [K, N/8] (word = 8 columns of
// one row, column AWQ_ORDER[i] in nibble i):
//   a block's tile is two groups of 8 words (w13: the gate words of 64 columns and the same up
//   words; w2: 128 columns), and lane (g, t) of a warp takes, for each 32-row step, rows 8t .. 8t + 7
//   of word g of each group (through the ring, below). k-step h takes rows
//   8t + 4h .. + 3; byte b of a word gives one m16 tile: row g is its low nibble (column
//   AWQ_ORDER[2b]), row g + 8 its high nibble. The register of (row, rows r, r + 1) is byte b of
//   word(r) next to byte b of word(r + 1), masked into the magic number's mantissa: one prmt and
//   one lop3 (gemv::column_pair), magic + q exact.
//   B: the same labels make k-step h's fragment x[token g][8t + 4h .. + 3]: one 16-byte load of x
//   per step feeds both k-steps.
//   C: lane (g, t) ends with its 16 columns for tokens 2t, 2t + 1 of the pass.
// No per-weight dequantization arithmetic: per group (scale s, zero z, zm = magic + z) a column
// gains s (sum x (magic + q) - zm sum x), the sum of x from one all-ones mma per k-step. One
// accumulator set serves all groups: it holds y / s of the current group, so the mma keeps adding
// into it, and a group's close rescales it by s / s_next (by s at the last: y). A scale below
// 2^-60 in magnitude (zero) stands in as 2^-60 (gemv::fold_unit says why that is harmless).
//
// Grid: block row z takes the z-th distinct expert the ids reach (a bitmap of them in shared
// memory), so rows = min(E, T * k) + 1 and rows past the distinct count exit at once.
// Work: a block is 4 warps on one column tile, each warp on its own range of 32-row steps, which
// come through a per-warp cp.async ring (copied in coalesced 16-byte chunks, read back by word;
// 430 -> 365 SASS instructions a step against 4- and 8-byte copies of each lane's own words).
// Tail: the warps' sums meet in shared memory; with split K they meet in the zeroed fp32 workspace
// (16-byte reductions, red.global.add.v4.f32), the last block converting (w13: of the expert's
// tile; w2: of a token's tile, whose topk * splits blocks all add into ws2; 4 columns a thread).
// An id outside [0, E) is gathered by the last block row, which adds
// nothing (w13 writes zeros into h) but still arrives, so every counter returns to zero.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/gemv_common.cuh"
#include "moe/moe_common.cuh"

namespace fastawq {
namespace {

using gemv::column_pair;
constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kTileCols = 128;   // both kernels: 16 columns per lane, 8 lanes side by side
constexpr int kStepRows = 32;

static_assert(kMoeMmaTile13 * 2 == kTileCols && kMoeMmaTile2 == kTileCols, "tiles of launch.h");

// Column of nibble i of an AWQ word (reference.AWQ_ORDER).
__host__ __device__ constexpr int awq_col(int i) { return i < 4 ? 2 * i : 2 * (i - 4) + 1; }

// 4 values rounded to T at p (8-byte aligned), one store.
template <typename T>
__device__ __forceinline__ void store4(T* p, float4 v) {
  using Tr = HalfTraits<T>;
  const T h[4] = {Tr::from_float(v.x), Tr::from_float(v.y), Tr::from_float(v.z), Tr::from_float(v.w)};
  *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(h);
}

template <int ACT>
__device__ __forceinline__ float4 act_mul4(float4 gate, float4 up) {
  using moe::act_fn;
  return make_float4(act_fn<ACT>(gate.x) * up.x, act_fn<ACT>(gate.y) * up.y, act_fn<ACT>(gate.z) * up.z,
                     act_fn<ACT>(gate.w) * up.w);
}

// Per-warp cp.async ring of kRing steps. A step is 32 rows x the tile's 16 words (2 KB), copied in
// 16-byte chunks (4 consecutive words of one group) by whichever lane keeps the copy coalesced,
// and read back by word: lane (g, t) reads word g of each group in rows 8t .. 8t + 7. Row r sits
// at 144 (r / 8) + 16 (r % 8) words, its word w at w ^ (8 ((r / 16) % 2)): the 16 pad words after
// every 8 rows and the swap of the groups' halves in rows 16 .. 31 put the 32 lanes of every read
// on 32 different banks (rows 8t + i: bank 16 (t + i) + g + 8 (j ^ (t / 2)) mod 32).
// Ids a thread reads at once in block_expert and gather.
constexpr int kIdBatch = 16;
constexpr int kRing = 3;  // two steps in flight while one is consumed
constexpr int kSlotWords = 4 * 144;
__host__ __device__ constexpr int ring_word(int r, int w) {
  return 144 * (r >> 3) + 16 * (r & 7) + (w ^ (8 * ((r >> 4) & 1)));
}
template <int NT>
struct Ring {
  uint32_t w[kRing][kSlotWords];
  uint4 x[kRing][NT][32];
};

// NT = 2 takes 48,528 bytes, under the 48 KB (49,152) of static shared memory; NT = 3 (~58 KB) comes
// from dynamic shared memory (block_smem).
template <int NT>
struct Smem {
  uint16_t rows[kMoeMmaMaxAssign];  // the block's assignments f (< 2^16), ascending
  union {
    Ring<NT> ring[kWarps];
    uint4 pairs[kWarps][2][kTileCols / 32][32];  // run_work_packed: the current and next groups' pairs
    float red[kWarps][8 * NT][kTileCols];  // the warps' sums of one pass
    int convert[kMoeMmaMaxAssign];  // w2: tokens whose tile this block converts
  };
  unsigned present[kMoeMmaMaxExperts / 32];  // the experts the call's ids reach
  int prefix[kMoeMmaMaxExperts / 32];        // persistent form: set bits of present before each word
  int warp_hits[kIdBatch][kWarps];
  int expert;
  int n_convert;
  int is_last;
  int distinct, bad, item;  // persistent form: experts reached, any id outside [0, E), the item
  int ahead;                // persistent form: the item claimed ahead (-1: none)
};
static_assert(sizeof(Smem<2>) <= 48 * 1024, "moe_mma's static shared memory");

// The block's Smem: static for NT = 1 / 2 (the instances as they were), dynamic for NT = 3, whose
// launch passes sizeof(Smem<3>) and opts in above 48 KB (launch_two).
template <int NT>
__device__ __forceinline__ Smem<NT>& block_smem() {
  if constexpr (NT == 3) {
    extern __shared__ __align__(16) unsigned char moe_dynamic_smem[];
    return *reinterpret_cast<Smem<NT>*>(moe_dynamic_smem);
  } else {
    __shared__ Smem<NT> sm;
    return sm;
  }
}

// The experts the call's ids reach into sm.present (a bitmap); sm.bad = 1 when an id lies outside
// [0, E). Ends with the block met.
template <typename Id, typename S>
__device__ void mark_experts(const MoeMmaArgs& a, S& sm) {
  const Id* ids = static_cast<const Id*>(a.ids);
  const int words = (a.num_experts + 31) / 32;
  for (int w = threadIdx.x; w < words; w += kThreads) sm.present[w] = 0u;
  if (threadIdx.x == 0) sm.bad = 0;
  __syncthreads();
  // kIdBatch ids a thread are loaded before any is used: one L2 round trip per 2,048 ids, where
  // the compiler's own unroll by 4 left a dependent round trip per 512 (4 at T * k = 2,048).
  for (int f0 = threadIdx.x; f0 < a.n_assign; f0 += kIdBatch * kThreads) {
    int64_t id[kIdBatch];
#pragma unroll
    for (int u = 0; u < kIdBatch; ++u) {
      const int f = f0 + u * kThreads;
      id[u] = f < a.n_assign ? static_cast<int64_t>(ids[f]) : 0;
    }
#pragma unroll
    for (int u = 0; u < kIdBatch; ++u) {
      if (f0 + u * kThreads >= a.n_assign) continue;
      if (id[u] >= 0 && id[u] < a.num_experts) {
        atomicOr(&sm.present[id[u] >> 5], 1u << (id[u] & 31));
      } else {
        sm.bad = 1;
      }
    }
  }
  __syncthreads();
}

// Warp 0 (the other warps return at once): sm.expert = the blockIdx.z-th set bit of sm.present
// (the experts in ascending order), or -1 when fewer are set. The caller's barrier publishes it.
template <typename S>
__device__ void nth_expert(const MoeMmaArgs& a, S& sm) {
  if (threadIdx.x >= 32) return;
  // Which word holds the z-th set bit: a scan of the words' counts.
  const int lane = threadIdx.x, z = blockIdx.z;
  const int words = (a.num_experts + 31) / 32;
  const unsigned w = lane < words ? sm.present[lane] : 0u;
  const int c = __popc(w);
  int incl = c;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  const unsigned found = __ballot_sync(0xffffffffu, incl > z);
  if (found == 0u) {
    if (lane == 0) sm.expert = -1;
  } else if (lane == __ffs(found) - 1) {
    unsigned m = w;
    for (int i = z - (incl - c); i > 0; --i) m &= m - 1u;  // drop the lower set bits
    sm.expert = 32 * lane + __ffs(m) - 1;
  }
}

// Block row z's expert: the z-th distinct valid id of the call (ascending), or -1 when the ids
// reach fewer experts; the last row gathers the ids outside [0, E) (returns E). So the grid needs
// min(E, T * k) + 1 rows, not E + 1.
template <typename Id, typename S>
__device__ int block_expert(const MoeMmaArgs& a, S& sm) {
  if (blockIdx.z == gridDim.z - 1) return a.num_experts;
  mark_experts<Id>(a, sm);
  nth_expert(a, sm);  // into sm.expert
  __syncthreads();
  return sm.expert;
}

// Persistent form: the block rows of the launch, the distinct experts the ids reach (ascending)
// and one more when an id lies outside [0, E). Every block computes the same list (sm.present,
// sm.prefix); row_expert reads it.
template <typename Id, typename S>
__device__ int expert_rows(const MoeMmaArgs& a, S& sm) {
  mark_experts<Id>(a, sm);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int words = (a.num_experts + 31) / 32;
    const int c = lane < words ? __popc(sm.present[lane]) : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    sm.prefix[lane] = incl - c;
    if (lane == 31) sm.distinct = incl;
  }
  __syncthreads();
  return sm.distinct + sm.bad;
}

// Persistent form, one thread: row z's expert (E for the row past the distinct experts: the ids
// outside [0, E)). The word holding the z-th set bit is the last one whose prefix is <= z.
template <typename S>
__device__ int row_expert(const MoeMmaArgs& a, const S& sm, int z) {
  if (z >= sm.distinct) return a.num_experts;
  int lo = 0, hi = (a.num_experts + 31) / 32 - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (sm.prefix[mid] <= z) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  unsigned m = sm.present[lo];
  for (int i = z - sm.prefix[lo]; i > 0; --i) m &= m - 1u;
  return 32 * lo + __ffs(m) - 1;
}

// The assignments of expert e (or, for e == E, those with an id outside [0, E)) into sm.rows, in
// ascending order; returns how many (the same in every thread).
template <typename Id, typename S>
__device__ int gather(const MoeMmaArgs& a, int e, S& sm) {
  const Id* ids = static_cast<const Id*>(a.ids);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool expert = e < a.num_experts;
  // Rounds of kThreads ids, kIdBatch rounds at a time: the batch's ids are all loaded, and reduced
  // to one bit each, before the first ballot (with each load inside its round's branch, next to
  // that round's ballot, the compiler issued them one L2 round trip after another: 16 a batch in
  // the SASS of session 27); each warp publishes its hit count of every round, and one barrier (not
  // two per round) orders them.
  int count = 0;
  for (int base0 = 0; base0 < a.n_assign; base0 += kIdBatch * kThreads) {
    unsigned hits = 0u;  // bit u: this thread's id of round u is one the block gathers
    {
      int64_t id[kIdBatch];
#pragma unroll
      for (int u = 0; u < kIdBatch; ++u) {
        const int f = base0 + u * kThreads + threadIdx.x;
        id[u] = f < a.n_assign ? static_cast<int64_t>(ids[f]) : 0;
      }
#pragma unroll
      for (int u = 0; u < kIdBatch; ++u) {
        const bool valid = base0 + u * kThreads + static_cast<int>(threadIdx.x) < a.n_assign;
        const bool hit = valid && (expert ? id[u] == e : (id[u] < 0 || id[u] >= a.num_experts));
        hits |= static_cast<unsigned>(hit) << u;
      }
    }
    unsigned mask[kIdBatch];
#pragma unroll
    for (int u = 0; u < kIdBatch; ++u) {
      mask[u] = __ballot_sync(0xffffffffu, (hits >> u) & 1u);
      if (lane == 0) sm.warp_hits[u][warp] = __popc(mask[u]);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kIdBatch; ++u) {
      int before = count, total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int c = sm.warp_hits[u][w];
        total += c;
        before += w < warp ? c : 0;
      }
      if (mask[u] >> lane & 1u) {
        sm.rows[before + __popc(mask[u] & ((1u << lane) - 1u))] = static_cast<uint16_t>(base0 + u * kThreads + threadIdx.x);
      }
      count += total;
    }
    __syncthreads();  // warp_hits is rewritten by the next batch
  }
  return count;
}

// a.one_round (at most kThreads assignments): block_expert and gather in one, each thread holding
// assignment threadIdx.x's id from a single load. Returns the assignments' count in sm.rows
// (ascending, as gather leaves them) and sets e to the block's expert (E on the last row: the ids
// outside [0, E); -1 when the ids reach fewer experts than the row: the count is then 0).
template <typename Id, typename S>
__device__ int one_round_rows(const MoeMmaArgs& a, S& sm, int& e) {
  static_assert(kMoeMmaOneRoundAssign == kThreads, "one id a thread");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int f = threadIdx.x;
  const bool valid = f < a.n_assign;
  const int64_t id = valid ? static_cast<int64_t>(static_cast<const Id*>(a.ids)[f]) : 0;
  const bool in_range = id >= 0 && id < a.num_experts;
  if (blockIdx.z == gridDim.z - 1) {
    e = a.num_experts;
  } else {
    const int words = (a.num_experts + 31) / 32;
    for (int w = threadIdx.x; w < words; w += kThreads) sm.present[w] = 0u;
    __syncthreads();
    if (valid && in_range) atomicOr(&sm.present[id >> 5], 1u << (id & 31));
    __syncthreads();
    nth_expert(a, sm);  // into sm.expert, as block_expert finds it
    __syncthreads();
    e = sm.expert;
    if (e < 0) return 0;
  }
  const bool hit = valid && (e < a.num_experts ? id == e : !in_range);
  const unsigned mask = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) sm.warp_hits[0][warp] = __popc(mask);
  __syncthreads();
  int before = 0, total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int c = sm.warp_hits[0][w];
    total += c;
    before += w < warp ? c : 0;
  }
  if (hit) sm.rows[before + __popc(mask & ((1u << lane) - 1u))] = static_cast<uint16_t>(f);
  __syncthreads();  // the rows are read by every thread from here
  return total;
}

// The current group's scales (8 per word, in column order) and zero words of the lane's two words.
struct Group {
  uint4 s[2];
  uint32_t z[2];
};

// One block's work: expert e (E: the ids outside [0, E)), column tile tile() of tiles() and K split
// split() of splits(). The two-launch form reads them from its grid, as the kernel did before the
// persistent form shared its body (same SASS); the persistent form from its work item.
struct GridWork {
  int e;
  __device__ int tile() const { return blockIdx.x; }
  __device__ int tiles() const { return gridDim.x; }
  __device__ int split() const { return blockIdx.y; }
  __device__ int splits() const { return gridDim.y; }
};
// The two-launch w2 grid with its prologue before the PDL wait (FASTAWQ_MOE_MMA_EARLY_W2): the
// same blocks, but run_work issues the first weights before the count and waits (wait_h) before x.
struct EarlyGridWork : GridWork {};
struct ItemWork {
  int e, tile_, tiles_, split_, splits_;
  __device__ int tile() const { return tile_; }
  __device__ int tiles() const { return tiles_; }
  __device__ int split() const { return split_; }
  __device__ int splits() const { return splits_; }
};

// Persistent form: publish (release) that this block's stores are done, by one add to `counter`.
__device__ __forceinline__ void publish(int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) red_release_gpu(counter, 1);
}

// The lane's B row of n-tile q in pass `pass`: x[token][8t ..] (w13) or h[assignment][8t ..] (w2)
// of the pass's assignment 8q + g (clamped: rows past the pass only feed columns never stored).
template <typename T, bool kW13, int NT>
__device__ __forceinline__ void pass_x_rows(const MoeMmaArgs& a, const Smem<NT>& sm, int pass, int rows_here, int g,
                                            int t, const T* (&xrow)[NT]) {
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    const int f = sm.rows[pass * 8 * NT + min(8 * q + g, rows_here - 1)];
    xrow[q] = (kW13 ? static_cast<const T*>(a.x) + static_cast<int64_t>(f / a.topk) * a.x_stride
                    : static_cast<const T*>(a.h) + static_cast<int64_t>(f) * a.inter) +
              8 * t;
  }
}

// w13's block row of the ids outside [0, E): the tile's columns of their h rows are zeros.
template <typename T, typename S>
__device__ __forceinline__ void zero_h_rows(const MoeMmaArgs& a, const S& sm, int tile, int count) {
  for (int idx = threadIdx.x; idx < count * kMoeMmaTile13; idx += kThreads) {
    const int col = tile * kMoeMmaTile13 + idx % kMoeMmaTile13;
    if (col < a.inter) {
      static_cast<T*>(a.h)[static_cast<int64_t>(sm.rows[idx / kMoeMmaTile13]) * a.inter + col] =
          HalfTraits<T>::from_float(0.f);
    }
  }
}

// One pass's outputs, once every warp's sums of it are in sm.red (and the block has met): w13
// stores act(gate) * up into h (or, with split K, adds gate and up into ws13); w2 adds the tokens'
// routing-weighted columns into ws2 (or stores them, top-1 without split K).
// kWide (w2's wide form of the packed kernel): each warp holds the sums of its own
// 128-column tile of the block's kWarps, so a column is read from one warp's row, not summed.
template <typename T, bool kW13, int ACT, int NT, bool kWide = false>
__device__ __forceinline__ void pass_out(const MoeMmaArgs& a, Smem<NT>& sm, bool expert, int tile, int splits, int n,
                                         int pass, int rows_here) {
  constexpr int kPassRows = 8 * NT;
  // The warps' sums of 4 adjacent columns c .. c + 3 (c % 4 == 0; I and H are multiples of 32, so
  // such a quad is all inside the layer or all outside, and 16-byte aligned in ws13 and ws2).
  const auto tile_sum4 = [&](int row, int c) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 p = *reinterpret_cast<const float4*>(&sm.red[w][row][c]);
      v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
    }
    return v;
  };
  if constexpr (kW13) {
    constexpr int kQuads = kMoeMmaTile13 / 4;
    for (int idx = threadIdx.x; idx < rows_here * kQuads; idx += kThreads) {
      const int row = idx / kQuads, c = 4 * (idx % kQuads), col = tile * kMoeMmaTile13 + c;
      if (col >= a.inter) continue;
      const int64_t fr = sm.rows[pass * kPassRows + row];
      const float4 gate = tile_sum4(row, c), up = tile_sum4(row, kMoeMmaTile13 + c);
      if (splits == 1) {
        store4(static_cast<T*>(a.h) + fr * a.inter + col, act_mul4<ACT>(gate, up));
      } else {
        red_add4(a.ws13 + fr * n + col, gate);
        red_add4(a.ws13 + fr * n + a.inter + col, up);
      }
    }
  } else {
    constexpr int kBlockCols = kTileCols * (kWide ? kWarps : 1);
    constexpr int kQuads = kBlockCols / 4;
    for (int idx = threadIdx.x; idx < rows_here * kQuads; idx += kThreads) {
      const int row = idx / kQuads, c = 4 * (idx % kQuads), col = tile * kBlockCols + c;
      if (col >= a.hidden) continue;
      const int fr = sm.rows[pass * kPassRows + row];
      const int64_t off = static_cast<int64_t>(fr / a.topk) * a.hidden + col;
      const float rw = expert ? a.topk_weights[fr] : 0.f;
      const float4 s = kWide ? *reinterpret_cast<const float4*>(&sm.red[c / kTileCols][row][c % kTileCols])
                             : tile_sum4(row, c);
      const float4 v = make_float4(rw * s.x, rw * s.y, rw * s.z, rw * s.w);
      if (a.topk == 1 && splits == 1) {
        store4(static_cast<T*>(a.out) + off, v);  // the token's only slot: no one else adds to it
      } else if (expert) {
        red_add4(a.ws2 + off, v);
      }
    }
  }
}

// After the last pass: with split K, the last block of a w13 tile converts ws13 into h; a w2 token's
// tile is converted by whichever of its topk * splits blocks arrives last. w13's persistent form
// publishes its finished tile to done13.
template <typename T, bool kW13, int ACT, int NT, bool kWide = false>
__device__ __forceinline__ void work_tail(const MoeMmaArgs& a, Smem<NT>& sm, int e, int tile, int tiles, int splits,
                                          int count, int n, int* done13) {
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (kW13) {
    if (splits == 1) {
      if (done13 != nullptr) publish(done13);
      return;
    }
    if (!moe::arrive_last(a.counters13 + static_cast<int64_t>(e) * tiles + tile, splits, sm.is_last)) return;
    constexpr int kQuads = kMoeMmaTile13 / 4;
    for (int idx = threadIdx.x; idx < count * kQuads; idx += kThreads) {
      const int col = tile * kMoeMmaTile13 + 4 * (idx % kQuads);
      if (col >= a.inter) continue;
      const int64_t fr = sm.rows[idx / kQuads];
      float4* pg = reinterpret_cast<float4*>(a.ws13 + fr * n + col);
      float4* pu = reinterpret_cast<float4*>(a.ws13 + fr * n + a.inter + col);
      const float4 gate = __ldcg(pg), up = __ldcg(pu);
      __stcg(pg, zero4);
      __stcg(pu, zero4);
      store4(static_cast<T*>(a.h) + fr * a.inter + col, act_mul4<ACT>(gate, up));
    }
    if (done13 != nullptr) publish(done13);
  } else {
    if (a.topk == 1 && splits == 1) return;
    // Each of a token's topk * splits blocks arrives once per assignment it holds; the last one
    // converts the token's tile.
    __threadfence();
    if (threadIdx.x == 0) sm.n_convert = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < count; r += kThreads) {
      const int tok = sm.rows[r] / a.topk;
      int* counter = a.counters2 + static_cast<int64_t>(tok) * tiles + tile;
      if (atomicAdd(counter, 1) == a.topk * splits - 1) {
        *counter = 0;
        sm.convert[atomicAdd(&sm.n_convert, 1)] = tok;
      }
    }
    __syncthreads();
    const int n_convert = sm.n_convert;
    if (n_convert == 0) return;
    __threadfence();
    constexpr int kBlockCols = kTileCols * (kWide ? kWarps : 1);
    constexpr int kQuads = kBlockCols / 4;
    for (int idx = threadIdx.x; idx < n_convert * kQuads; idx += kThreads) {
      const int col = tile * kBlockCols + 4 * (idx % kQuads);
      if (col >= a.hidden) continue;
      const int64_t off = static_cast<int64_t>(sm.convert[idx / kQuads]) * a.hidden + col;
      float4* p = reinterpret_cast<float4*>(a.ws2 + off);
      const float4 v = __ldcg(p);
      __stcg(p, zero4);
      store4(static_cast<T*>(a.out) + off, v);
    }
  }
}

// NT: mma n-tiles per pass, so a pass takes 8 NT tokens and an expert's weights stream once per
// pass; 2 halves the passes (and the dequantization per token) of a loaded expert for 64 more
// accumulator registers, hence 3 blocks an SM instead of 4. 3 (the AWQ layout's two launches, an A/B
// switch): at Qwen3-30B-A3B's T = 256 an expert's ~16 +- 4 tokens take 1.02 passes of 24 on average
// against 1.43 of 16.
// count_fn(): called by every thread once, after the first steps' weight copies are issued (the
// row of ids outside [0, E) copies none): the number of the expert's assignments, in sm.rows (the
// persistent form gathers them there, so its ring fill overlaps the scan; the two-launch form
// gathered them first).
// done13 (w13, persistent form; else null): where to publish that this tile's h columns are final.
// wait_h(): persistent form and EarlyGridWork only, called by every thread once, after the gather
// and before the first copy of x (w2: h), which it may hold back until h is final (the persistent
// form polls w13's tiles, EarlyGridWork waits on the PDL edge); the persistent form also claims its
// next item there (outside the pass loop: what it keeps live stays out of the step loop's
// registers).
template <typename T, typename Id, bool kW13, int ACT, int NT, typename Work, typename CountFn, typename WaitH>
__device__ __forceinline__ void run_work(const MoeMmaArgs& a, Smem<NT>& sm, const Work& wk, CountFn count_fn,
                                         int* done13, WaitH wait_h) {
  using Tr = HalfTraits<T>;
  constexpr int kPassRows = 8 * NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int e = wk.e;
  const bool expert = e < a.num_experts;

  const int k = kW13 ? a.hidden : a.inter;  // rows of the weight
  const int n = kW13 ? 2 * a.inter : a.hidden;
  const int n8 = n / 8;
  const int tile = wk.tile();
  const int splits = wk.splits();

  if constexpr (kW13) {
    if (!expert) {  // ids outside [0, E): their h rows are zeros, written once
      const int count = count_fn();
      if (wk.split() == 0) zero_h_rows<T>(a, sm, tile, count);
      return;
    }
  }

  // The tile's two groups of 8 words of a row: w13 the gate words of its 64 columns and the same up
  // words, w2 the first and second 8 words of its 128 columns. Group j's word w is the global word
  // first + j * apart + w; it exists when word_ok (an expert id outside [0, E) loads none).
  const int first = kW13 ? tile * 8 : tile * 16;
  const int apart = kW13 ? a.inter / 8 : 8;
  const auto word_ok = [&](int j, int w) {
    return expert && (kW13 ? first + w < a.inter / 8 : first + 8 * j + w < n8);
  };
  // The lane's own word of each group (its 16 columns; their scales and zeros).
  const int p0 = first + g, p1 = first + apart + g;
  const bool ok0 = word_ok(0, g), ok1 = word_ok(1, g);
  const int gsize = kW13 ? a.group13 : a.group2;
  const int64_t ex = expert ? e : 0;
  const uint32_t* qw = (kW13 ? a.w13_qweight : a.w2_qweight) + ex * k * n8;
  const T* sc = static_cast<const T*>(kW13 ? a.w13_scales : a.w2_scales) + ex * (k / gsize) * n;
  const uint32_t* qz = (kW13 ? a.w13_qzeros : a.w2_qzeros) + ex * (k / gsize) * n8;
  const int steps = kW13 ? a.steps13 : a.steps2;
  const int s0 = (wk.split() * kWarps + warp) * steps, s1 = min(s0 + steps, k / kStepRows);
  const int steps_per_group = gsize / kStepRows;
  const uint64_t policy = a.evict_normal ? evict_normal_policy() : evict_first_policy();
  const uint32_t ones[4] = {Tr::kOne2, Tr::kOne2, Tr::kOne2, Tr::kOne2};

  // Column (within the block's tile) of nibble i of the lane's word of group j.
  const auto tile_col = [&](int j, int i) { return 64 * j + 8 * g + awq_col(i); };

  // What this lane copies of each step: chunk lane % 4 (group (lane % 4) / 2, words 4 (lane % 2) ..
  // + 3) of rows lane / 4 + 8u, u < 4.
  const int cj = (lane & 3) >> 1, cw = 4 * (lane & 1);
  const bool copy_ok = word_ok(cj, cw);
  const uint32_t* copy_src = qw + static_cast<int64_t>(lane >> 2) * n8 + (copy_ok ? first + cj * apart + cw : 0);

  // Step s's weights into ring slot `slot`: the lane's 4 chunks.
  Ring<NT>& ring = sm.ring[warp];
  const auto issue_w = [&](int slot, int s) {
    const uint32_t* p = copy_src + static_cast<int64_t>(s * kStepRows) * n8;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      cp_async16_stream(&ring.w[slot][ring_word((lane >> 2) + 8 * u, 8 * cj + cw)], p + 8 * u * n8, copy_ok,
                        policy);
    }
  };
  // Each pass's first steps' weights go out before anything else of the pass: x (for w2, h) only
  // once wait_h says h is final; they join the first step's commit group, which wait_group then
  // counts as step s0's.
  const bool streams = expert && s0 < s1;
  const auto issue_first_weights = [&] {
    if (streams) {
#pragma unroll
      for (int d = 0; d < kRing - 1; ++d) {
        if (s0 + d < s1) issue_w(d, s0 + d);
      }
    }
  };
  // The persistent form issues pass 0's first weights before the gather (EarlyGridWork before its
  // PDL wait); the two-launch form, which gathered first, issues each step's weights and x together
  // as it did before sharing this body.
  constexpr bool kEarlyWeights = !std::is_same_v<Work, GridWork>;
  if constexpr (kEarlyWeights) issue_first_weights();
  const int count = count_fn();
  if constexpr (kEarlyWeights) wait_h();

  for (int pass = 0; pass * kPassRows < count; ++pass) {
    const int rows_here = min(kPassRows, count - pass * kPassRows);
    const T* xrow[NT];
    pass_x_rows<T, kW13>(a, sm, pass, rows_here, g, t, xrow);

    // Step s into ring slot `slot`: the lane's weight chunks, and x[token][8t .. + 7] of each n-tile
    // (read by itself).
    const auto issue_x = [&](int slot, int s) {
#pragma unroll
      for (int q = 0; q < NT; ++q) cp_async16(&ring.x[slot][q][lane], xrow[q] + s * kStepRows, true);
    };
    const auto issue = [&](int slot, int s) {
      issue_w(slot, s);
      issue_x(slot, s);
    };
    const auto load_group = [&](Group& gr, int s) {
      const int64_t grp = s / steps_per_group;
      gr.s[0] = ok0 ? __ldg(reinterpret_cast<const uint4*>(sc + grp * n + 8 * p0)) : make_uint4(0, 0, 0, 0);
      gr.s[1] = ok1 ? __ldg(reinterpret_cast<const uint4*>(sc + grp * n + 8 * p1)) : make_uint4(0, 0, 0, 0);
      gr.z[0] = ok0 ? __ldg(qz + grp * n8 + p0) : 0u;
      gr.z[1] = ok1 ? __ldg(qz + grp * n8 + p1) : 0u;
    };

    float acc[NT][2][4][4], xs[NT][4];  // [n-tile][word][byte][C element]; the group's sums of x
#pragma unroll
    for (int q = 0; q < NT; ++q) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[q][j][b][r] = 0.f;
#pragma unroll
      for (int r = 0; r < 4; ++r) xs[q][r] = 0.f;
    }

    // The lane's words of a slot: group j's at read0/read1 + 16 i for row 8t + i (ring_word).
    const uint32_t* read0 = &ring.w[0][ring_word(8 * t, g)];
    const uint32_t* read1 = &ring.w[0][ring_word(8 * t, 8 + g)];
    const auto consume = [&](int slot) {
      uint32_t wr[8][2];  // word g of group j in row 8t + i
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        wr[i][0] = read0[slot * kSlotWords + 16 * i];
        wr[i][1] = read1[slot * kSlotWords + 16 * i];
      }
      uint4 xv[NT];
#pragma unroll
      for (int q = 0; q < NT; ++q) xv[q] = ld_shared128(&ring.x[slot][q][lane]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b0[NT], b1[NT];
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          b0[q] = h == 0 ? xv[q].x : xv[q].z, b1[q] = h == 0 ? xv[q].y : xv[q].w;
          Mma<T>::run(xs[q], ones, b0[q], b1[q]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t r0 = wr[4 * h][j], r1 = wr[4 * h + 1][j], r2 = wr[4 * h + 2][j], r3 = wr[4 * h + 3][j];
          const uint32_t r0s = r0 >> 4, r1s = r1 >> 4, r2s = r2 >> 4, r3s = r3 >> 4;
          const auto tile_mma = [&](auto bc) {
            constexpr int B = decltype(bc)::value;
            const uint32_t fr[4] = {column_pair<T, B>(r0, r1), column_pair<T, B>(r0s, r1s),
                                    column_pair<T, B>(r2, r3), column_pair<T, B>(r2s, r3s)};
#pragma unroll
            for (int q = 0; q < NT; ++q) Mma<T>::run(acc[q][j][B], fr, b0[q], b1[q]);
          };
          tile_mma(std::integral_constant<int, 0>{});
          tile_mma(std::integral_constant<int, 1>{});
          tile_mma(std::integral_constant<int, 2>{});
          tile_mma(std::integral_constant<int, 3>{});
        }
      }
    };

    // acc = r (acc - zm xs) per column, r = s / s_next (s at the warp's last group: acc is then y).
    // The 4 lanes of a quad (one g) hold the same 16 columns, so each derives r and zm for 4 of
    // them and the quad shares them: lane t takes word j = t / 2, nibbles i = 4 (t % 2) .. + 3,
    // whose scales are the low (t even) or high (t odd) halves of the 4 words of s[j]
    // (awq_col(i) = 2 (i % 4) + i / 4).
    const auto close_group = [&](const Group& cur, const Group* next) {
      const int hi = t & 1;
      const uint4 sc = t < 2 ? cur.s[0] : cur.s[1];
      const uint4 sn = next == nullptr ? sc : (t < 2 ? next->s[0] : next->s[1]);
      const uint32_t zw = (t < 2 ? cur.z[0] : cur.z[1]) >> (16 * hi);
      const uint32_t scw[4] = {sc.x, sc.y, sc.z, sc.w}, snw[4] = {sn.x, sn.y, sn.z, sn.w};
      float rq[4], zq[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 c2 = Tr::to_float2(scw[u]), n2 = Tr::to_float2(snw[u]);
        const float su = gemv::fold_unit(hi ? c2.y : c2.x);
        rq[u] = next != nullptr ? __fdividef(su, gemv::fold_unit(hi ? n2.y : n2.x)) : su;
        zq[u] = Tr::kMagic + static_cast<float>((zw >> (4 * u)) & 15u);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int src = (lane & ~3) | (2 * j + (i >> 2));
          const float r = __shfl_sync(0xffffffffu, rq[i & 3], src);
          const float zm = __shfl_sync(0xffffffffu, zq[i & 3], src);
#pragma unroll
          for (int q = 0; q < NT; ++q)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& v = acc[q][j][i >> 1][2 * (i & 1) + c];
              v = r * fmaf(-zm, xs[q][c], v);
            }
        }
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) xs[q][r] = 0.f;
    };

    if constexpr (kEarlyWeights) {
      if (pass > 0) issue_first_weights();
    }
    if (streams) {
      Group gr, gn;
      load_group(gr, s0);
#pragma unroll
      for (int d = 0; d < kRing - 1; ++d) {
        if (s0 + d < s1) {
          if constexpr (kEarlyWeights) {
            issue_x(d, s0 + d);
          } else {
            issue(d, s0 + d);
          }
        }
        cp_async_commit();  // one group per step, empty past the range, so wait_group counts steps
      }
      int slot = 0;
      int group_left = steps_per_group - s0 % steps_per_group;  // steps until the current group ends
#pragma unroll 1
      for (int s = s0; s < s1; ++s) {
        // Refill the slot consumed last iteration with step s + kRing - 1 once every lane has read
        // it, then wait for step s: its chunks came from other lanes too, so the warp meets again.
        __syncwarp();
        if (s + kRing - 1 < s1) issue(slot == 0 ? kRing - 1 : slot - 1, s + kRing - 1);
        cp_async_commit();
        cp_async_wait<kRing - 1>();
        __syncwarp();
        // The next group's scales are fetched before the math of the step that ends the group,
        // so the close does not wait for them.
        if (group_left == 1 && s + 1 < s1) load_group(gn, s + 1);
        consume(slot);
        slot = slot == kRing - 1 ? 0 : slot + 1;
        if (--group_left == 0 || s + 1 == s1) {
          if (s + 1 == s1) {
            close_group(gr, nullptr);
          } else {
            close_group(gr, &gn);
            gr = gn;
          }
          group_left = steps_per_group;
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring before the sums reuse it

    // C fragment (g, t) of n-tile q: element r of m-tile (j, b) is nibble 2b + (r >> 1) of word j,
    // token 8q + 2t + (r & 1) of the pass.
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            sm.red[warp][8 * q + 2 * t + (r & 1)][tile_col(j, 2 * b + (r >> 1))] = acc[q][j][b][r];
    __syncthreads();

    pass_out<T, kW13, ACT, NT>(a, sm, expert, tile, splits, n, pass, rows_here);
    __syncthreads();  // red is rewritten by the next pass (or reused as convert)
  }

  work_tail<T, kW13, ACT, NT>(a, sm, e, tile, wk.tiles(), splits, count, n, done13);
}

// moe_mma on experts repacked at load into the packed layout of gemv/awq_gemv_packed.h
// (WQExperts.set_layout("packed"); a.packed: w*_qweight hold wpacked [E, K/8, N], w*_scales szpacked
// [E, K/G, 2N], no qzeros). The expert scan, gather, passes and outputs are run_work's; the step
// is awq_mma_packed's register ring: lane (g, t)'s 16 bytes at (kb = 4s + t, chunk c4) are its whole
// A fragment of 4 columns for a 32-row step, so each step's weights are plain 16-byte loads into
// the lane's own registers, kMoePackedRing steps ahead, with no shared-memory ring, no cp.async wait
// and no __syncwarp a step (session 10, dense, same dequant: 1.43 against the cp.async ring's 1.27x
// cuBLAS at 8 tokens). The tile's 128 columns are 4 chunks of 32 (w13: 2 of gate, 2 of up). CC = 4
// (a.packed_chunks): each warp takes all 4 chunks over its own range of K, with a 2-step ring (16
// bytes x 4 chunks x 2 steps of registers); CC = 2 (FASTAWQ_MOE_PACKED_CHUNKS=2): warps 0 / 1 take
// chunks 0-1 / 2-3 over the first K half of the block's range, warps 2 / 3 the same over the second,
// each range twice as long, with a 4-step ring in the same registers (more loads in flight a warp,
// half the accumulators). A lane owns the C fragment's 4 columns 4 c4 .. + 3 of each of its chunks,
// whose (scale, zero) pairs are one 16-byte load, so a group's close needs no shuffles. Slot r's
// refill waits until slot r + 1's first use (awq_mma_packed's DEFER: every weight load of a warp
// shares one scoreboard, so a refill issued just before the next slot's first use would hold that
// use for a whole memory latency).
// kWide (w2 only, CC = 4; where the host's rule in moe_gemv.cpp picks it): the block's 4 warps take 4 adjacent
// 128-column tiles (512 columns), each warp the block's whole K range, instead of 4 K ranges of one
// tile. At w2's short K (Qwen3-30B-A3B: I = 768, 24 steps) the 4-way K split leaves a warp 6 steps
// between a block's fixed costs (id scan, gather, cross-warp sum, atomics, arrival): wide, a warp
// streams 24 steps, the block holds 4x the bytes for the same fixed part, and no warp's sums are
// added to another's. It pays where its grid fills most of a wave (H100: Mixtral-8x7B w2 at T = 16
// 313 -> 292 us); at Qwen3 T = 16 (0.61 of a wave) w2 alone is faster (47 -> 43 us under ncu) but
// the decode step slower.
template <int CC>
constexpr int moe_packed_ring() { return CC == 4 ? 2 : 4; }

template <typename T, typename Id, bool kW13, int ACT, int NT, int CC, bool kWide, bool kPrefetch, typename Work,
          typename CountFn, typename WaitH>
__device__ __forceinline__ void run_work_packed(const MoeMmaArgs& a, Smem<NT>& sm, const Work& wk, CountFn count_fn,
                                                WaitH wait_h) {
  static_assert(CC == 2 || CC == 4, "chunks a warp");
  static_assert(!kWide || (!kW13 && CC == 4), "the wide form is w2's, with 4 chunks a warp");
  static_assert(!kPrefetch || (!kW13 && CC == 4 && !kWide), "the L2 prefetch: w2's tile form, 4 chunks a warp");
  using Tr = HalfTraits<T>;
  constexpr int kPassRows = 8 * NT, P = moe_packed_ring<CC>();
  // Warps across the tile's columns and along K (wide: each warp its own tile, the whole K range).
  constexpr int kColWarps = kWide ? 1 : 4 / CC, kKWarps = kWide ? 1 : kWarps / kColWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first_chunk = kWide ? 0 : (warp % kColWarps) * CC, kwarp = kWide ? 0 : warp / kColWarps;
  const int g = lane >> 2, t = lane & 3;
  const int e = wk.e;
  const bool expert = e < a.num_experts;
  const int k = kW13 ? a.hidden : a.inter;  // rows of the weight
  const int n = kW13 ? 2 * a.inter : a.hidden;
  const int n4 = n / 4;
  const int tile = wk.tile();
  const int splits = wk.splits();
  const int wtile = kWide ? tile * kWarps + warp : tile;  // the warp's 128-column tile (w2)

  if constexpr (kW13) {
    if (!expert) {
      const int count = count_fn();
      if (wk.split() == 0) zero_h_rows<T>(a, sm, tile, count);
      return;
    }
  }

  // The lane's chunk cc (the tile's chunk first_chunk + cc = q): the 4 columns from 4 c4[cc] of the
  // layer, tile columns 32 q + 4 g .. + 3 (w13: chunks 0, 1 the gate's 64 columns of the tile, 2, 3
  // the same up columns).
  int c4[CC];
  bool col_ok[CC];
#pragma unroll
  for (int cc = 0; cc < CC; ++cc) {
    const int q = first_chunk + cc;
    if constexpr (kW13) {
      const int local = tile * (kMoeMmaTile13 / 4) + 8 * (q & 1) + g;
      c4[cc] = (q < 2 ? 0 : a.inter / 4) + local;
      col_ok[cc] = expert && local < a.inter / 4;
    } else {
      c4[cc] = wtile * (kTileCols / 4) + 8 * q + g;
      col_ok[cc] = expert && c4[cc] < n4;
    }
    if (!col_ok[cc]) c4[cc] = 0;
  }
  const int gsize = kW13 ? a.group13 : a.group2;
  const int64_t ex = expert ? e : 0;
  const uint4* wp = reinterpret_cast<const uint4*>(kW13 ? a.w13_qweight : a.w2_qweight) + ex * (k / 8) * n4;
  const uint4* szp = static_cast<const uint4*>(kW13 ? a.w13_scales : a.w2_scales) + ex * (k / gsize) * n4;
  // The host sized steps13 / steps2 for 4 warps along K (wide: for one); kKWarps of them take as
  // many steps each.
  const int steps = (kW13 ? a.steps13 : a.steps2) * kColWarps;
  const int s0 = (wk.split() * kKWarps + kwarp) * steps, s1 = min(s0 + steps, k / kStepRows);
  const int steps_per_group = gsize / kStepRows;
  const uint64_t policy = a.evict_normal ? evict_normal_policy() : evict_first_policy();
  const uint32_t ones[4] = {Tr::kOne2, Tr::kOne2, Tr::kOne2, Tr::kOne2};
  const uint4* w_lane = wp + static_cast<int64_t>(t) * n4;  // + 4 n4 a step

  // Step s's weights of the lane: one 16-byte load a chunk.
  const auto fetch = [&](uint4(&w)[CC], int s) {
    const uint4* p = w_lane + static_cast<int64_t>(s) * 4 * n4;
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) w[cc] = col_ok[cc] ? gemv::load_stream(p + c4[cc], policy) : make_uint4(0, 0, 0, 0);
  };
  // The (scale, zero) pairs of the lane's columns in the group of step s, into the lane's slot of
  // sm.pairs (one cp.async group: the pairs are the only cp.async copies here, so a close's wait
  // for them waits for nothing else; in registers they would cost 32 of the step loop's).
  const auto stage_pairs = [&](int slot, int s) {
    const uint4* p = szp + static_cast<int64_t>(s / steps_per_group) * n4;
#pragma unroll
    for (int cc = 0; cc < CC; ++cc) cp_async16(&sm.pairs[warp][slot][cc][lane], p + c4[cc], col_ok[cc]);
    cp_async_commit();
  };
  // (Wide: a warp whose tile starts past the layer's columns streams nothing.)
  const bool streams = expert && s0 < s1 && (!kWide || col_ok[0]);
  // kPrefetch (w2's tile form, the host's choice where a.prefetch_steps = N > 0; launch.h): lane
  // 4c + r < 16 brings into L2 the 128-byte line of row 4s + r of chunk c at step s -- the line the 8
  // lanes of that chunk and row load as one -- for the N steps past the register ring. Row 4s + r is
  // the lane's own row (r = t: w_lane), so the line is w_lane's step plus the chunk's first column
  // pf_col (-1: the lane prefetches nothing). Its own instances: the others' registers stay as they were.
  const int pf_c4 = wtile * (kTileCols / 4) + 8 * (lane >> 2);
  const int pf_col = kPrefetch && streams && lane < 4 * CC && pf_c4 < n4 ? pf_c4 : -1;
  const auto prefetch_step = [&](int s) {
    if (pf_col >= 0 && s < s1) prefetch_l2(w_lane + static_cast<int64_t>(s) * 4 * n4 + pf_col);
  };
  uint4 rw[P][CC];
  const auto fetch_first = [&] {
    if (streams) {
#pragma unroll
      for (int r = 0; r < P; ++r) {
        if (s0 + r < s1) fetch(rw[r], s0 + r);
      }
      if constexpr (kPrefetch) {
        for (int s = s0 + P; s < min(s0 + P + a.prefetch_steps, s1); ++s) prefetch_step(s);
      }
    }
  };
  // As run_work: the forms that wait for h (EarlyGridWork) load pass 0's first weights before the
  // count and the wait, the others after the count.
  constexpr bool kEarlyWeights = !std::is_same_v<Work, GridWork>;
  if constexpr (kEarlyWeights) fetch_first();
  const int count = count_fn();
  if constexpr (kEarlyWeights) wait_h();

  for (int pass = 0; pass * kPassRows < count; ++pass) {
    const int rows_here = min(kPassRows, count - pass * kPassRows);
    const T* xrow[NT];
    pass_x_rows<T, kW13>(a, sm, pass, rows_here, g, t, xrow);
    if (!kEarlyWeights || pass > 0) fetch_first();

    float acc[CC][2][NT][4], xs[NT][4];  // [chunk][m-tile][n-tile][C element]; the group's sums of x
#pragma unroll
    for (int cc = 0; cc < CC; ++cc)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int q = 0; q < NT; ++q)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[cc][i][q][r] = 0.f;
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int r = 0; r < 4; ++r) xs[q][r] = 0.f;

    // A: columns 0, 1 of a chunk are rows g, g + 8 of m-tile 0, columns 2, 3 those of m-tile 1;
    // word j of the 16 bytes holds rows 2j, 2j + 1 of k-step j / 2 (awq_mma_packed.cu).
    // after_first(): once chunk 0's weights of k-step 0 are in registers of the mma.
    const auto consume = [&](const uint4(&wc)[CC], const uint4(&xc)[NT], auto&& after_first) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b0[NT], b1[NT];
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          b0[q] = h == 0 ? xc[q].x : xc[q].z;
          b1[q] = h == 0 ? xc[q].y : xc[q].w;
          Mma<T>::run(xs[q], ones, b0[q], b1[q]);
        }
#pragma unroll
        for (int cc = 0; cc < CC; ++cc) {
          const uint32_t w0 = h == 0 ? wc[cc].x : wc[cc].z, w1 = h == 0 ? wc[cc].y : wc[cc].w;
          const uint32_t w0s = w0 >> 4, w1s = w1 >> 4;
          const uint32_t a0[4] = {column_pair<T, 0>(w0, w0s), column_pair<T, 1>(w0, w0s),
                                  column_pair<T, 0>(w1, w1s), column_pair<T, 1>(w1, w1s)};
          const uint32_t a1[4] = {column_pair<T, 2>(w0, w0s), column_pair<T, 3>(w0, w0s),
                                  column_pair<T, 2>(w1, w1s), column_pair<T, 3>(w1, w1s)};
#pragma unroll
          for (int q = 0; q < NT; ++q) {
            Mma<T>::run(acc[cc][0][q], a0, b0[q], b1[q]);
            Mma<T>::run(acc[cc][1][q], a1, b0[q], b1[q]);
          }
          if (h == 0 && cc == 0) after_first();
        }
      }
    };

    // acc = r (acc - zm xs) per column, r = s / s_next (s at the warp's last group: acc is then y),
    // as run_work's close, from the lane's own pairs (slot cur of sm.pairs; the next group's in the
    // other slot).
    const auto close_group = [&](int cur, bool last) {
      cp_async_wait<0>();  // the lane reads back only what it copied: no barrier
#pragma unroll
      for (int cc = 0; cc < CC; ++cc) {
        const uint4 cv = ld_shared128(&sm.pairs[warp][cur][cc][lane]);
        const uint4 nv = last ? cv : ld_shared128(&sm.pairs[warp][cur ^ 1][cc][lane]);
        const T* pc = reinterpret_cast<const T*>(&cv);
        const T* pn = reinterpret_cast<const T*>(&nv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // column j: m-tile j / 2, fragment row g (j even) or g + 8
          const float su = gemv::fold_unit(Tr::to_float(pc[2 * j]));
          const float r = last ? su : __fdividef(su, gemv::fold_unit(Tr::to_float(pn[2 * j])));
          const float zm = Tr::kMagic + Tr::to_float(pc[2 * j + 1]);
#pragma unroll
          for (int q = 0; q < NT; ++q)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& v = acc[cc][j >> 1][q][2 * (j & 1) + c];
              v = r * fmaf(-zm, xs[q][c], v);
            }
        }
      }
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) xs[q][r] = 0.f;
    };

    if (streams) {
      int cur = 0;  // the slot of sm.pairs holding the current group's pairs
      stage_pairs(cur, s0);
      int group_left = steps_per_group - s0 % steps_per_group;  // steps until the current group ends
#pragma unroll 1
      for (int s = s0; s < s1; s += P) {
#pragma unroll
        for (int r = 0; r < P; ++r) {
          const int step = s + r;
          if (step < s1) {
            if constexpr (kPrefetch) prefetch_step(step + P + a.prefetch_steps);
            uint4 xc[NT];
#pragma unroll
            for (int q = 0; q < NT; ++q) xc[q] = __ldg(reinterpret_cast<const uint4*>(xrow[q] + step * kStepRows));
            // The previous slot's refill (step - 1 + P), after this slot's first use; the next
            // group's pairs before the math of the step that ends the group.
            const int sp = step - 1;
            consume(rw[r], xc, [&] {
              if (sp >= s0 && sp + P < s1) fetch(rw[(r + P - 1) % P], sp + P);
              if (group_left == 1 && step + 1 < s1) stage_pairs(cur ^ 1, step + 1);
            });
            if (--group_left == 0 || step + 1 == s1) {
              close_group(cur, step + 1 == s1);
              cur ^= 1;
              group_left = steps_per_group;
            }
          }
        }
      }
    }
    __syncthreads();  // every warp is done with its pairs (red overlaps them) before the sums

    // C fragment (g, t) of chunk cc: element r of m-tile i is column 4 c4 + 2i + (r >> 1), token
    // 8q + 2t + (r & 1) of the pass. With CC = 2 the warp's sums of the other two chunks are zeros
    // (pass_out adds every warp's row).
#pragma unroll
    for (int cc = 0; cc < CC; ++cc)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int q = 0; q < NT; ++q)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            sm.red[warp][8 * q + 2 * t + (r & 1)][32 * (first_chunk + cc) + 4 * g + 2 * i + (r >> 1)] =
                acc[cc][i][q][r];
    if constexpr (CC < 4) {
      const int other = 32 * (CC - first_chunk);  // the first column of the chunks the warp does not take
      for (int idx = lane; idx < kPassRows * 8 * CC; idx += 32) {
        const int row = idx / (8 * CC), c = other + 4 * (idx % (8 * CC));
        *reinterpret_cast<float4*>(&sm.red[warp][row][c]) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    __syncthreads();

    pass_out<T, kW13, ACT, NT, kWide>(a, sm, expert, tile, splits, n, pass, rows_here);
    __syncthreads();  // red is rewritten by the next pass (or reused as convert)
  }

  work_tail<T, kW13, ACT, NT, kWide>(a, sm, e, tile, wk.tiles(), splits, count, n, nullptr);
}

// Two launches: grid (tiles, splits, rows), block row z on the z-th expert the ids reach.
// kEarly (w2 only, FASTAWQ_MOE_MMA_EARLY_W2): everything up to the first read of h runs before the
// PDL wait, so the expert scan, the gather and the first weight copies overlap w13's tail.
// kPacked: the experts in the packed layout (run_work_packed), CC chunks a warp (4 or 2); kWide:
// its w2 with a warp a tile (run_work_packed).
template <typename T, typename Id, bool kW13, int ACT, int NT, bool kEarly = false, bool kPacked = false, int CC = 4,
          bool kWide = false, bool kPrefetch = false>
__global__ void __launch_bounds__(kThreads, moe_mma_blocks_per_sm(8 * NT)) moe_mma_kernel(MoeMmaArgs a) {
  static_assert(!(kW13 && kEarly), "w13 reads its ids only after the PDL wait");
  static_assert(NT != 3 || !kPacked, "24-token passes: the AWQ layout's kernel only");
  Smem<NT>& sm = block_smem<NT>();
  // The ids come from the routing kernel (w13 waits for it), h from the w13 launch (w2). Before w13
  // lets w2 launch it has passed its own wait, so the routing kernel is complete by then.
  if constexpr (!kEarly) pdl_wait();
  pdl_launch_dependents();
  int e, count;
  if (a.one_round) {
    count = one_round_rows<Id>(a, sm, e);
    if (count == 0) return;
  } else {
    e = block_expert<Id>(a, sm);
    if (e < 0) return;
    count = gather<Id>(a, e, sm);
    if (count == 0) return;
  }
  const auto work = [&](const auto& wk, auto wait_h) {
    if constexpr (kPacked) {
      run_work_packed<T, Id, kW13, ACT, NT, CC, kWide, kPrefetch>(a, sm, wk, [count] { return count; }, wait_h);
    } else {
      run_work<T, Id, kW13, ACT, NT>(a, sm, wk, [count] { return count; }, nullptr, wait_h);
    }
  };
  if constexpr (kEarly) {
    work(EarlyGridWork{{e}}, [] { pdl_wait(); });
  } else {
    work(GridWork{e}, [] {});
  }
}

// f.template operator()<T, Id, ACT, NT>() for the call's activation dtype, id type, activation and
// tokens a pass: the one place that maps MoeMmaArgs to kernel instances (moe_mma.cu,
// moe_mma_packed.cu and moe_mma_persistent.cu each instantiate their own kernels through it).
// kPass24: the caller has NT = 3 instances (the AWQ layout's two launches; the host sends 24 nowhere
// else).
template <bool kPass24 = false, typename F>
void dispatch_instance(const MoeMmaArgs& a, F&& f) {
  const auto by_nt = [&]<typename T, typename Id, int ACT>() {
    if constexpr (kPass24) {
      if (a.pass_rows == 24) return f.template operator()<T, Id, ACT, 3>();
    }
    if (a.pass_rows == 16) return f.template operator()<T, Id, ACT, 2>();
    return f.template operator()<T, Id, ACT, 1>();
  };
  const auto by_act = [&]<typename T, typename Id>() {
    switch (a.act) {
      case 0: return by_nt.template operator()<T, Id, 0>();
      case 1: return by_nt.template operator()<T, Id, 1>();
      default: return by_nt.template operator()<T, Id, 2>();
    }
  };
  const auto by_ids = [&]<typename T>() {
    if (a.ids_int64) return by_act.template operator()<T, int64_t>();
    return by_act.template operator()<T, int32_t>();
  };
  if (a.dtype == HalfType::kHalf) return by_ids.template operator()<__half>();
  return by_ids.template operator()<__nv_bfloat16>();
}

// The two launches of the grid form: w13, then w2 (early or not, a.early_w2; wide or not,
// a.w2_wide, which the host sets only for the packed kernel at 4 chunks a warp).
template <typename T, typename Id, int ACT, int NT, bool kPacked, int CC = 4>
void launch_two(const MoeMmaArgs& a, cudaStream_t stream) {
  const dim3 grid13(a.tiles13, a.splits13, a.rows), grid2(a.tiles2, a.splits2, a.rows);
  // NT = 3's Smem is dynamic (block_smem): its size, opted in once per kernel.
  constexpr int kDynamic = NT == 3 ? static_cast<int>(sizeof(Smem<NT>)) : 0;
  const auto launch = [&]<auto kKernel>(dim3 grid) {
    if constexpr (kDynamic > 0) opt_in_shared_memory<kKernel>(kDynamic);
    launch_pdl(kKernel, grid, dim3(kThreads), kDynamic, stream, a);
  };
  launch.template operator()<moe_mma_kernel<T, Id, true, ACT, NT, false, kPacked, CC>>(grid13);
  const auto w2 = [&]<bool kWide, bool kPrefetch = false>() {
    if (a.early_w2) {
      launch.template operator()<moe_mma_kernel<T, Id, false, 0, NT, true, kPacked, CC, kWide, kPrefetch>>(grid2);
    } else {
      launch.template operator()<moe_mma_kernel<T, Id, false, 0, NT, false, kPacked, CC, kWide, kPrefetch>>(grid2);
    }
  };
  if constexpr (kPacked && CC == 4) {
    if (a.w2_wide) return w2.template operator()<true>();
    // (a.prefetch_steps: the packed kernel's tile form at 4 chunks a warp only; launch.h.)
    if (a.prefetch_steps > 0) return w2.template operator()<false, true>();
  }
  w2.template operator()<false>();
}

}  // namespace
}  // namespace fastawq
