// moe_mma's persistent form (FASTAWQ_MOE_MMA_PERSISTENT=1, off by default), in a translation unit
// of its own so its instances compile beside the two-launch ones (moe_mma.cu, moe_mma_packed.cu).
#include "moe/moe_mma.cuh"

namespace fastawq {
namespace {

// Persistent form, claim ahead: the first two steps of each warp's K range of an item (expert e,
// column tile, K split) into L2, by one warp: 4 warps x 64 rows x 2 pieces of 32 bytes (w13: the
// gate and the up words of the tile; w2: its 16 words), 16 prefetches a lane.
__device__ void prefetch_item(const MoeMmaArgs& a, bool w13, int e, int tile, int split, int lane) {
  const int k = w13 ? a.hidden : a.inter;
  const int n8 = (w13 ? 2 * a.inter : a.hidden) / 8;
  const int steps = w13 ? a.steps13 : a.steps2;
  const int first = w13 ? tile * 8 : tile * 16, apart = w13 ? a.inter / 8 : 8;
  const uint32_t* qw = (w13 ? a.w13_qweight : a.w2_qweight) + static_cast<int64_t>(e) * k * n8;
  for (int p = lane; p < kWarps * 64 * 2; p += 32) {
    const int j = p & 1, row_in = (p >> 1) & 63, w = p >> 7;
    const int s0 = (split * kWarps + w) * steps, s1 = min(s0 + steps, k / kStepRows);
    const int row = s0 * kStepRows + row_in;
    const int word = first + j * apart;
    const bool ok = row < s1 * kStepRows && (w13 ? first < a.inter / 8 : word < n8);
    if (ok) prefetch_l2(qw + static_cast<int64_t>(row) * n8 + word);
  }
}

// The persistent form: one launch of as many blocks as fit. Work items are the blocks of both
// grids above over the rows the ids reach (each block lists them the same way: the distinct
// experts ascending, then the bad ids' row when there are any), w13's first (row-major, then split,
// then tile, so neighbouring tiles, which share the AWQ rows' 128-byte lines, go out together),
// then w2's. A block takes the next item from a counter until none is left, so no wave ends with
// idle SMs and w2's items start while w13's last ones drain, without a launch between them.
// A w2 item of row z waits (after issuing its first weight copies) until all of z's w13 tiles have
// published their h columns. That cannot deadlock: every item a w2 item waits on was claimed
// before it, by a block that is running and waits on nothing. The last block out resets the
// counters (graph replays need them zeroed).
// kAhead: FASTAWQ_MOE_MMA_AHEAD (its code costs the step loops registers, so it is an instance of
// its own).
template <typename T, typename Id, int ACT, int NT, bool kAhead>
__global__ void __launch_bounds__(kThreads, moe_mma_blocks_per_sm(8 * NT)) moe_mma_persistent_kernel(MoeMmaArgs a) {
  __shared__ Smem<NT> sm;
  pdl_wait();  // the ids come from the routing kernel
  pdl_launch_dependents();
  int* const next_item = a.sched;
  int* const exits = a.sched + 1;
  int* const done13 = a.sched + 2;  // per row: w13 tiles whose h columns are final
  if (threadIdx.x == 0) sm.ahead = -1;  // expert_rows meets the block before it is read
  const int rows = expert_rows<Id>(a, sm);
  const int per13 = a.tiles13 * a.splits13, per2 = a.tiles2 * a.splits2;
  const int items13 = rows * per13, items = items13 + rows * per2;
  // Item i < items: which launch, block row, column tile and K split.
  struct Item {
    bool w13;
    int z, tile, split;
  };
  const auto decode = [&](int i) {
    const bool w13 = i < items13;
    const int local = w13 ? i : i - items13, per = w13 ? per13 : per2, tiles = w13 ? a.tiles13 : a.tiles2;
    const int z = local / per, r = local - z * per;
    return Item{w13, z, r % tiles, r / tiles};
  };
  int held = -1, count = 0;  // the expert whose assignments sm.rows holds, and how many
  for (;;) {
    if (threadIdx.x == 0) {
      const int item = sm.ahead >= 0 ? sm.ahead : atomicAdd(next_item, 1);
      sm.ahead = -1;
      sm.item = item;
      if (item < items) sm.expert = row_expert(a, sm, decode(item).z);
    }
    __syncthreads();
    const int item = sm.item, e = sm.expert;
    if (item >= items) break;
    const Item it = decode(item);
    const bool w13 = it.w13;
    const int z = it.z;
    // The expert's assignments into sm.rows, unless they are there from the block's last item: once
    // the item's first weight copies are out.
    const auto rows_of = [&] {
      if (e != held) {
        count = gather<Id>(a, e, sm);
        held = e;
      }
      return count;
    };
    const ItemWork wk{e, it.tile, w13 ? a.tiles13 : a.tiles2, it.split, w13 ? a.splits13 : a.splits2};
    const bool real = e < a.num_experts;
    // Claim ahead (FASTAWQ_MOE_MMA_AHEAD=1), by warp 0 once the item no longer waits: the next
    // item is taken now and its first weights start for L2, while this one streams. Still no
    // deadlock: a w13 item (what w2 items wait on) can be held ahead only by a block whose current
    // item is a w13 one too, claimed before it, which waits on nothing.
    const auto claim_ahead = [&] {
      if (!kAhead || threadIdx.x >= 32) return;
      const int lane = threadIdx.x;
      int next = 0, next_e = 0;
      if (lane == 0) {
        next = atomicAdd(next_item, 1);
        sm.ahead = next;
        if (next < items) next_e = row_expert(a, sm, decode(next).z);
      }
      next = __shfl_sync(0xffffffffu, next, 0);
      next_e = __shfl_sync(0xffffffffu, next_e, 0);
      if (next >= items || next_e >= a.num_experts) return;
      const Item n = decode(next);
      prefetch_item(a, n.w13, next_e, n.tile, n.split, lane);
    };
    if (w13) {
      run_work<T, Id, true, ACT, NT>(a, sm, wk, rows_of, real ? done13 + z : nullptr, claim_ahead);
    } else {
      run_work<T, Id, false, 0, NT>(a, sm, wk, rows_of, nullptr, [&] {
        if (real && threadIdx.x == 0) {
          // Microseconds at most; a wait of seconds is a broken schedule: fail the launch (an
          // error the caller sees) rather than hang the GPU.
          for (unsigned spins = 0; ld_acquire_gpu(done13 + z) < a.tiles13; ++spins) {
            if (spins == (1u << 22)) __trap();  // ~2-4 s of polls
            __nanosleep(64);
          }
        }
        __syncthreads();
        claim_ahead();
      });
    }
    __syncthreads();  // sm.item, sm.expert, the rows and the union are rewritten for the next item
  }
  if (threadIdx.x == 0) sm.is_last = atomicAdd(exits, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (sm.is_last) {  // every block has taken its last item: nothing reads the counters any more
    for (int z = threadIdx.x; z < rows; z += kThreads) done13[z] = 0;
    if (threadIdx.x == 0) *next_item = 0, *exits = 0;
  }
}

}  // namespace

void launch_moe_mma_persistent(const MoeMmaArgs& a, cudaStream_t stream) {
  dispatch_instance(a, [&]<typename T, typename Id, int ACT, int NT>() {
    if (a.claim_ahead) {
      launch_pdl(moe_mma_persistent_kernel<T, Id, ACT, NT, true>, dim3(a.persistent_blocks), dim3(kThreads), 0, stream,
                 a);
    } else {
      launch_pdl(moe_mma_persistent_kernel<T, Id, ACT, NT, false>, dim3(a.persistent_blocks), dim3(kThreads), 0,
                 stream, a);
    }
  });
}

}  // namespace fastawq
