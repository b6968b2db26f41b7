// W4A16 for batches of 17 rows and more on Hopper's warpgroup MMA (wgmma, sm_90a), on the
// load-time repacked layout of awq_gemv_packed.h: y^T[N, M] = W^T[N, K] x^T[K, M], "swap AB" as
// awq_mma_packed.cu, with output channels as the wgmma's M (64 a warpgroup instruction) and the
// batch as its N (NT = 16, 32, 64 or 128 rows a block). The weights are the A operand, dequantized in
// registers (wgmma takes A from registers); x is the B operand, read by the tensor cores from shared
// memory through a matrix descriptor. Dequantize + cuBLAS (what the Triton path picks at M >= 64)
// reads 4x the weight bytes and caps that range at 0.8-0.94x cuBLAS fp16 (issue 11); mma.sync
// kernels (awq_gemm_packed.cu) are bound by their instructions a warp (0.52x at M = 64).
//
// Fragments straight from the layout (the k order inside a 32-row step is a free label, as in
// awq_mma_packed.cu):
//   A: lane (g, t) of warp w of a warpgroup loads the 16 bytes at (kb = 4s + t, c4): rows
//      32s + 8t .. +7 of columns 4c4 .. 4c4 + 3, c4 = the block's first + 8 * warp + g. The wgmma A
//      fragment of a warp is mma.m16n8k16's (rows g and g + 8 of the warp's 16, k labels 2t, 2t + 1
//      and 2t + 8, 2t + 9), so column 2i of the lane's four is row g of m-tile i and column 2i + 1 row
//      g + 8, and k-step h's labels 2t, 2t + 1 are rows 8t + 4h, +1 (word 2h), 2t + 8, 2t + 9 rows
//      8t + 4h + 2, +3 (word 2h + 1). Dequantized exactly as awq_gemm_packed's B (prmt, lop3, hsub2,
//      hmul2: what dequantize-then-matmul rounds to).
//   B: x in the same labels, K-major without swizzle: core matrices of 8 rows (tokens) x 8 labels
//      (16 bytes). The 16-byte load of x[token][32s + 8t' ..] holds the four words j = 2h + kc (k-step
//      h, core column kc) at label pair t' of each: four 4-byte shared stores into four planes of
//      core matrices (plane j at j * NT * 16 bytes, token group at 128 bytes, token row at 16, label
//      pair t' at 4 t'), conflict-free for a warp's 8 tokens x 4 chunks. k-step h's descriptor starts
//      at plane 2h, its K neighbour (LBO) one plane on, its N neighbours (SBO) 128 bytes on.
//   D: lane (g, t) of warp w ends with rows g, g + 8 of the warp's 16 in each m-tile, i.e. the four
//      columns 4c4 .. 4c4 + 3, for tokens 8j + 2t + e: one 8-byte store (or 16-byte reduction) each.
//
// Work: a block is 2 warpgroups (256 threads) on a 256-column tile (128 columns each) and NT tokens,
// both on one contiguous range of 32-row steps (blockIdx.z splits K); grid (token tiles, column
// tiles, splits), token tiles adjacent so a column tile's weights come from L2 after the first.
// WG = 1 (the 32-token tile's default; FASTAWQ_WGMMA_WARPGROUPS=1 / 2 forces one or two, the host's
// wgmma_call): blocks of one warpgroup on 128 columns, 2 to 4
// an SM, whose barriers and latencies other blocks fill (at NT = 128 a 2-warpgroup block is alone on
// its SM), at the price of x copied and permuted once per 128 columns instead of 256.
// A ring of P slots in shared memory, P - 1 steps in flight: each slot one step's weights (16 bytes a
// lane) and x (16-byte items, a thread's side by side), both copied by cp.async, one commit group a
// step, and read back only by the thread that copied them, so wait_group alone orders them. After
// its wgmmas are issued, a step puts the next step's x in label order (a thread's own items: one
// 16-byte shared load, four 4-byte stores into the planes). One barrier a step: it publishes those
// planes (fence.proxy.async first: the tensor cores read shared memory through the async proxy) and
// tells every warpgroup that the other has finished the wgmmas of three steps ago (so a slot's planes
// are rewritten only after every wgmma that read them). A registers alternate between two sets (the
// loop runs two steps an iteration): a step waits only for the wgmmas of two steps ago (wait_group 1)
// before it dequantizes into their set, so up to two steps of wgmmas are queued while it does.
// (x loaded into registers P - 2 steps ahead and stored after the wgmmas, the first form, measured
// 0.39x cuBLAS at M = 4096 on an H100: each step waited an L2 round trip before its stores.)
//
// No L2 eviction hint on the weights' copies (ptxas 13.x, awq_gemm_packed.cu says why).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <cooperative_groups.h>

#include "common/dtype.cuh"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "gemv/awq_gemv_packed.h"
#include "gemv/gemv_common.cuh"

// wgmma exists on sm_90a only; other targets of this file compile the launcher and an empty kernel
// (the host entry refuses to launch it: awq_wgmma_packed_declines()).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTAWQ_WGMMA_DEVICE 1
#endif

namespace fastawq {
namespace {

using gemv::column_pair;
using gemv::dequant_pair;

// A block of WG warpgroups: its threads, and the 4-column chunks of its tile (128 columns each).
template <int WG>
constexpr int kThreads = 128 * WG;
template <int WG>
constexpr int kTileC4 = 32 * WG;

// The shared-memory matrix descriptor of a no-swizzle ("interleave") operand: start address, the
// byte distance of core matrices adjacent in K (LBO) and in M/N (SBO), each in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving an accumulator across the asynchronous wgmma (what would make
// ptxas serialize them): an empty asm that "reads and writes" it.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x NT] += A[64 x 16] (registers, 4 a lane) * B[16 x NT] (shared memory, K-major, by
// descriptor), fp32 accumulators, NT / 2 a lane. The fp16 and bf16 forms differ in the PTX type.
#define FASTAWQ_D8(i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define FASTAWQ_A4_DESC "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
#ifdef FASTAWQ_WGMMA_DEVICE
#define FASTAWQ_WGMMA_RUN(AB)                                                                                  \
  __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {           \
    asm volatile(                                                                                              \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                                           \
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." AB "." AB                                                \
        " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"                           \
        : FASTAWQ_D8(0)                                                                                        \
        : FASTAWQ_A4_DESC);                                                                                    \
  }                                                                                                            \
  __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {          \
    asm volatile(                                                                                              \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                           \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB                                                \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, " \
        "p, 1, 1, 0;\n}\n"                                                                                     \
        : FASTAWQ_D8(0), FASTAWQ_D8(8)                                                                         \
        : FASTAWQ_A4_DESC);                                                                                    \
  }                                                                                                            \
  __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {          \
    asm volatile(                                                                                              \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                           \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB                                                \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "    \
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"  \
        : FASTAWQ_D8(0), FASTAWQ_D8(8), FASTAWQ_D8(16), FASTAWQ_D8(24)                                         \
        : FASTAWQ_A4_DESC);                                                                                    \
  }                                                                                                            \
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {          \
    asm volatile(                                                                                              \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                           \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB                                               \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "    \
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, " \
        "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, " \
        "%61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                          \
        : FASTAWQ_D8(0), FASTAWQ_D8(8), FASTAWQ_D8(16), FASTAWQ_D8(24), FASTAWQ_D8(32), FASTAWQ_D8(40),       \
          FASTAWQ_D8(48), FASTAWQ_D8(56)                                                                       \
        : FASTAWQ_A4_DESC);                                                                                    \
  }
#else
#define FASTAWQ_WGMMA_RUN(AB)                                                                 \
  template <int R>                                                                            \
  __device__ __forceinline__ static void run(float (&)[R], const uint32_t (&)[4], uint64_t) { \
    __trap();                                                                                 \
  }
#endif

template <typename T>
struct Wgmma;
template <>
struct Wgmma<__half> {
  FASTAWQ_WGMMA_RUN("f16")
};
template <>
struct Wgmma<__nv_bfloat16> {
  FASTAWQ_WGMMA_RUN("bf16")
};
#undef FASTAWQ_WGMMA_RUN
#undef FASTAWQ_A4_DESC
#undef FASTAWQ_D8

// The pieces both kernels below share: a lane's group constants, a step's dequantization into A
// fragments, a step's wgmmas, and the accumulators' stores.
//
// (magic + z) and s of the lane's four columns in both halves, from their (scale, zero) pairs
// (szpacked's 16 bytes at the lane's chunk).
template <typename T>
struct GroupConsts {
  typename HalfTraits<T>::T2 zm[4], sc[4];
  __device__ __forceinline__ void set(const uint4& sv) {
    using Tr = HalfTraits<T>;
    using T2 = typename Tr::T2;
    const T* p = reinterpret_cast<const T*>(&sv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const T z = __hadd(Tr::from_float(Tr::kMagic), p[2 * j + 1]);  // magic + z, exact
      zm[j] = T2{z, z};
      sc[j] = T2{p[2 * j], p[2 * j]};
    }
  }
};

// A lane's 16 bytes of a step (words 2h, 2h + 1 for k-step h) into the A fragments of both m-tiles.
template <typename T>
__device__ __forceinline__ void dequant_step(const uint4 w, const GroupConsts<T>& gc, uint32_t (&af)[2][2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = h == 0 ? w.x : w.z, hi = h == 0 ? w.y : w.w;  // words 2h, 2h + 1
    const uint32_t lo4 = lo >> 4, hi4 = hi >> 4;
    af[0][h][0] = dequant_pair<T>(column_pair<T, 0>(lo, lo4), gc.zm[0], gc.sc[0]);
    af[0][h][1] = dequant_pair<T>(column_pair<T, 1>(lo, lo4), gc.zm[1], gc.sc[1]);
    af[0][h][2] = dequant_pair<T>(column_pair<T, 0>(hi, hi4), gc.zm[0], gc.sc[0]);
    af[0][h][3] = dequant_pair<T>(column_pair<T, 1>(hi, hi4), gc.zm[1], gc.sc[1]);
    af[1][h][0] = dequant_pair<T>(column_pair<T, 2>(lo, lo4), gc.zm[2], gc.sc[2]);
    af[1][h][1] = dequant_pair<T>(column_pair<T, 3>(lo, lo4), gc.zm[3], gc.sc[3]);
    af[1][h][2] = dequant_pair<T>(column_pair<T, 2>(hi, hi4), gc.zm[2], gc.sc[2]);
    af[1][h][3] = dequant_pair<T>(column_pair<T, 3>(hi, hi4), gc.zm[3], gc.sc[3]);
  }
}

template <int NT>
__device__ __forceinline__ void zero_accumulators(float (&acc)[2][NT / 2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) acc[i][r] = 0.f;
}

template <int NT>
__device__ __forceinline__ void fence_accumulators(float (&acc)[2][NT / 2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int r = 0; r < NT / 2; ++r) fence_operand(acc[i][r]);
}

// A step's wgmmas, one commit group: both m-tiles, both k-steps, B from x's planes at `planes`
// (k-step h's at plane 2h, its K neighbour one plane on, its N neighbours 128 bytes on).
template <typename T, int NT>
__device__ __forceinline__ void issue_step(float (&acc)[2][NT / 2], const uint32_t (&af)[2][2][4], uint32_t planes) {
  constexpr int kPlane = NT * 16;
  fence_accumulators<NT>(acc);
  wgmma_fence();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint64_t desc = smem_desc(planes + 2 * h * kPlane, kPlane, 128);
    Wgmma<T>::run(acc[0], af[0][h], desc);
    Wgmma<T>::run(acc[1], af[1][h], desc);
  }
  wgmma_commit();
  fence_accumulators<NT>(acc);
}

// out[at .. + 3] = v + bias[4 c4 .. + 3], one 8-byte store.
template <typename T>
__device__ __forceinline__ void store4_out(T* out, const T* bias, int64_t at, int c4, const float (&v)[4]) {
  using Tr = HalfTraits<T>;
  T o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = Tr::from_float(bias != nullptr ? v[j] + Tr::to_float(bias[4 * c4 + j]) : v[j]);
  *reinterpret_cast<uint2*>(out + at) = *reinterpret_cast<const uint2*>(o);
}

// The lane's accumulators out: acc[i][4 j + 2 hr + e] is row g + 8 hr of the warp's 16 in m-tile i
// (column 4 c4 + 2 i + hr), token tok0 + 8 j + 2 t + e; into out (+ bias), or with split K added
// into the fp32 workspace ws (+ red_bias where given: the sums form's first split).
template <typename T, int NT>
__device__ __forceinline__ void store_accumulators(const float (&acc)[2][NT / 2], int tok0, int t, int m, int n, int c4,
                                                   bool col_ok, bool split, float* ws, T* out, const T* bias,
                                                   const T* red_bias = nullptr) {
  using Tr = HalfTraits<T>;
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = tok0 + 8 * j + 2 * t + e;
      if (tok >= m || !col_ok) continue;
      const float v[4] = {acc[0][4 * j + e], acc[0][4 * j + 2 + e], acc[1][4 * j + e], acc[1][4 * j + 2 + e]};
      const int64_t at = static_cast<int64_t>(tok) * n + 4 * c4;
      if (split) {
        float r[4] = {v[0], v[1], v[2], v[3]};
        if (red_bias != nullptr) {
#pragma unroll
          for (int q = 0; q < 4; ++q) r[q] += Tr::to_float(red_bias[4 * c4 + q]);
        }
        red_add4(ws + at, make_float4(r[0], r[1], r[2], r[3]));
      } else {
        store4_out<T>(out, bias, at, c4, v);
      }
    }
}

// Where consumer thread `tid` keeps its 16 bytes of a step's weights in a slot's weight region: its
// warp's 512 bytes at 512 warp, in the layout's row order (gemv::row_order_offset). In lane order (16
// tid, the form before session 35) the s36n Nsight Compute report of the 16-token tile (H200) had 32
// shared wavefronts a warp's copy against 4, 62 % of the kernel's 5.5 M in excess. Session 35 (H100,
// same run): geomean x cuBLAS at M = 9 / 16 / 32 1.53 / 1.43 / 1.19 in lane order, 1.82 / 1.63 / 1.27
// in row order; the Llama-3-8B-shape engine at batch 16 1.151x.
__device__ __forceinline__ uint32_t w_slot_offset(int tid) {
  const int lane = tid & 31;
  return (tid >> 5) * 512 + gemv::row_order_offset(lane >> 2, lane & 3);
}

// One slot of the ring: the step's x in the wgmma's order (NT tokens x 32 labels, 4 planes of NT x
// 16 bytes), the same x as copied (a thread's 16-byte items side by side), then the block's
// weights (16 bytes a lane) and, with SR, the (scale, zero) pairs of the group the step starts (16
// bytes a lane quad).
template <int NT>
constexpr int kXBytes = NT * 64;
template <int NT, int WG, bool SR = false>
constexpr int kSlotBytes = 2 * kXBytes<NT> + kThreads<WG> * 16 + (SR ? kThreads<WG> * 4 : 0);

// Blocks an SM the registers must allow: at 2 warpgroups 2 at NT <= 64 (128 registers), 1 at 128;
// at one warpgroup 4 / 3 / 2 at NT <= 32 / 64 / 128 (at 4, NT = 64 would spill).
template <int NT, int WG>
constexpr int kMinBlocks = WG == 2 ? (NT <= 64 ? 2 : 1) : (NT <= 32 ? 4 : (NT == 64 ? 3 : 2));

// The cluster reduction (CR): a (token tile, column tile)'s K splits are one cluster (gridDim.z <= 8
// blocks); each block puts its fp32 partial tile (NT tokens x 128 WG columns, token-major) in its own
// ring, and after a cluster barrier block r sums its 1/C share of the tile across the C blocks'
// shared memory, adds the bias, rounds and stores it; a second barrier keeps every block's shared
// memory alive until the others have read it. No workspace, fence, arrival count or last block.
template <int NT, int WG>
constexpr int kTileFloats = NT * 128 * WG;

template <typename T, int NT, int WG>
__device__ __forceinline__ void cluster_reduce(const float (&acc)[2][NT / 2], float* tile, int tok0, int t, int m,
                                               int n, int c4_local, const T* bias, T* out) {
#ifdef FASTAWQ_WGMMA_DEVICE
  namespace cg = cooperative_groups;
  constexpr int kCols = 128 * WG, kC4 = kCols / 4, kQuads = kTileFloats<NT, WG> / 4;
  cg::cluster_group cluster = cg::this_cluster();
  // Every warpgroup's wgmmas and copies are done (the caller waited): the ring is free.
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = 8 * j + 2 * t + e;
      *reinterpret_cast<float4*>(tile + tok * kCols + 4 * c4_local) =
          make_float4(acc[0][4 * j + e], acc[0][4 * j + 2 + e], acc[1][4 * j + e], acc[1][4 * j + 2 + e]);
    }
  cluster.sync();
  const int c = static_cast<int>(cluster.num_blocks()), r = static_cast<int>(cluster.block_rank());
  const int share = (kQuads + c - 1) / c, q0 = r * share, q1 = min(q0 + share, kQuads);
  const int n4 = n >> 2;
  for (int q = q0 + static_cast<int>(threadIdx.x); q < q1; q += kThreads<WG>) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int b = 0; b < c; ++b) {
      const float4 p = reinterpret_cast<const float4*>(cluster.map_shared_rank(tile, b))[q];
      v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
    }
    const int tok = tok0 + q / kC4, c4 = blockIdx.y * kC4 + q % kC4;
    if (tok < m && c4 < n4) {
      store4_out<T>(out, bias, static_cast<int64_t>(tok) * n + 4 * c4, c4, {v.x, v.y, v.z, v.w});
    }
  }
  cluster.sync();
#endif
}

// MINB: the blocks an SM the registers must allow (kMinBlocks unless an occupancy instance asks more:
// wgmma_occupancy_six()). SR: the (scale, zero) pairs come through the ring with the weights
// (wgmma_scales_in_ring()) instead of an __ldg a step ahead. CR: launched in clusters along K
// (WgmmaPackedArgs::cluster), the splits meet in distributed shared memory (cluster_reduce).
template <typename T, int NT, int P, int WG, int MINB = kMinBlocks<NT, WG>, bool SR = false, bool CR = false>
__global__ void __launch_bounds__(kThreads<WG>, MINB) awq_wgmma_packed_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int m, int n, int k, int group_size,
    int steps_per_block, bool sums) {
#ifdef FASTAWQ_WGMMA_DEVICE
  static_assert(P >= 4, "a slot's planes are rewritten only once every warpgroup is past its wgmmas");
  static_assert(!CR || kTileFloats<NT, WG> * 4 <= P * kSlotBytes<NT, WG, SR>, "the partial tile fits the ring");
  constexpr int kPlane = NT * 16;  // bytes between the x planes (core matrices adjacent in K)
  constexpr int kXItems = 4 * NT;  // 16-byte loads of x a step
  constexpr int kBlock = kThreads<WG>, kC4 = kTileC4<WG>;
  constexpr int kXPer = (kXItems + kBlock - 1) / kBlock;
  extern __shared__ __align__(128) uint8_t ring_smem[];
  __shared__ int is_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n4 = n >> 2;
  const int tok0 = blockIdx.x * NT;
  const int c4 = static_cast<int>(pinned(blockIdx.y * kC4 + warp * 8 + g));
  const bool col_ok = c4 < n4;  // n % 8 == 0: whole 4-column chunks
  const int s_total = k / kPackedBatchRows;
  const int s0 = blockIdx.z * steps_per_block;
  const int s1 = min(s0 + steps_per_block, s_total);
  const int steps_per_group = group_size / kPackedBatchRows;
  const int64_t w_step = 4 * static_cast<int64_t>(n4);
  const uint4* w_next = wp + static_cast<int64_t>(t) * n4 + c4 + s0 * w_step;

  const uint32_t base = pinned(smem_addr(ring_smem));
  // The thread's 16-byte place in a slot's two copy regions (x's, then the weights'): its x item and
  // its weights land at the same offset in each, one register for both (pinned: recomputed, it made
  // ptxas spill the 64-token two-warpgroup instance; the 80-register one spills 4 bytes either way).
  const uint32_t own = pinned(w_slot_offset(tid));
  const int own_item = static_cast<int>(own >> 4);
  const uint32_t w_own = 2 * kXBytes<NT> + own;
  const auto slot_at = [&](int slot) { return base + slot * kSlotBytes<NT, WG, SR>; };
  // SR: lane t = 0 of each quad copies its columns' pairs into the slot of each step that starts a
  // group (and of the range's first), at 16 (8 warp + g) past the weights; the quad reads them back
  // after the step's barrier. The issue stream's own group walk: the pairs' source advances a group
  // after each copy; iss_left steps remain of the issued group, iss_len is the next one's length.
  [[maybe_unused]] const uint32_t sz_at = 2 * kXBytes<NT> + kThreads<WG> * 16 + (warp * 8 + g) * 16;
  [[maybe_unused]] const uint4* sz_iss = sz + static_cast<int64_t>(s0 / steps_per_group) * n4 + c4;
  [[maybe_unused]] int iss_left = 0, iss_len = steps_per_group - s0 % steps_per_group;
  const auto issue_w = [&](int slot) {
    cp_async16_at(slot_at(slot) + w_own, w_next, col_ok);
    w_next += w_step;
    if constexpr (SR) {
      if (iss_left == 0) {
        if (t == 0) cp_async16_at(slot_at(slot) + sz_at, sz_iss, col_ok);
        sz_iss += n4;
        iss_left = iss_len;
        iss_len = steps_per_group;
      }
      --iss_left;
    }
  };

  // The thread's x items: item j = own_item + kBlock * i is token j / 4 (clamped to row M - 1: it
  // feeds only outputs never stored), chunk j % 4; copied to the slot's copy region at 16 j (a
  // token's 64 bytes side by side), then put in the wgmma's order at its offset in each of the 4
  // planes.
  const T* x_src[kXPer];
  uint32_t x_dst[kXPer];
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    const int j = min(own_item + kBlock * i, kXItems - 1), tok = j >> 2, tc = j & 3;
    x_src[i] = x + static_cast<int64_t>(min(tok0 + tok, m - 1)) * k + 8 * tc +
               static_cast<int64_t>(s0) * kPackedBatchRows;
    x_dst[i] = (tok >> 3) * 128 + (tok & 7) * 16 + 4 * tc;
  }
  const auto x_on = [&](int i) { return kXPer * kBlock == kXItems || own_item + kBlock * i < kXItems; };
  const auto issue_x = [&](int slot) {
    const uint32_t at = slot_at(slot) + kXBytes<NT> + own;
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      if (x_on(i)) cp_async16_ca_at(at + kBlock * 16 * i, x_src[i]);
      x_src[i] += kPackedBatchRows;
    }
  };
  // The thread's own copies of the slot's step, into the planes (cp.async.wait_group orders them).
  const auto permute_x = [&](int slot) {
    const uint32_t xs = slot_at(slot);
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      if (!x_on(i)) continue;
      const uint4 r = ld_shared128_at(xs + kXBytes<NT> + own + kBlock * 16 * i);
      st_shared32_at(xs + x_dst[i], r.x);
      st_shared32_at(xs + x_dst[i] + kPlane, r.y);
      st_shared32_at(xs + x_dst[i] + 2 * kPlane, r.z);
      st_shared32_at(xs + x_dst[i] + 3 * kPlane, r.w);
    }
  };

  // The weights of the first P - 1 steps, before the PDL wait (no kernel that can launch this one
  // early writes weights: awq_gemv_packed.h), a commit group each; after it, their x in one group,
  // waited for at once, and the first step's planes.
#pragma unroll
  for (int d = 0; d < P - 1; ++d) {
    if (s0 + d < s1) issue_w(d);
    cp_async_commit();
  }
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int d = 0; d < P - 1; ++d) {
    if (s0 + d < s1) issue_x(d);
  }
  cp_async_commit();
  cp_async_wait<0>();
  if (s0 < s1) permute_x(0);
  fence_proxy_async_shared();

  // (scale, zero) of the lane's four columns for the current group: fetched a step ahead, or (SR)
  // read from the slot of the group's first step (`pairs_due`).
  [[maybe_unused]] const uint4* sz_lane = sz + static_cast<int64_t>(s0 / steps_per_group) * n4 + c4;
  [[maybe_unused]] uint4 sv_next = make_uint4(0, 0, 0, 0);
  const auto load_scales = [&]() {
    if (col_ok) sv_next = __ldg(sz_lane);
  };
  GroupConsts<T> gc;
  if constexpr (!SR) {
    if (s0 < s1) {
      load_scales();
      gc.set(sv_next);
    }
  }
  [[maybe_unused]] bool pairs_due = true;
  int group_left = steps_per_group - s0 % steps_per_group;

  float acc[2][NT / 2];
  zero_accumulators<NT>(acc);
  uint32_t af[2][2][2][4];  // [set][m-tile i][k-step h][register]

  // Step s from slot `slot` into A register set SET.
  const auto step = [&](int s, int slot, auto set_c) {
    constexpr int SET = decltype(set_c)::value;
    // Step s's planes are published (put there a step ago); both warpgroups are past step s - 3's
    // wgmmas (each waited for them before its step s - 1 dequantization). This lane's weights of
    // step s landed by the last step's wait.
    __syncthreads();
    if (s + P - 1 < s1) {  // into the slot step s - 1 used (its planes stay: only copies land)
      const int refill = slot == 0 ? P - 1 : slot - 1;
      issue_w(refill);
      issue_x(refill);
    }
    cp_async_commit();
    if constexpr (SR) {
      if (pairs_due) {  // copied with the step's weights, published by the barrier above
        gc.set(ld_shared128_at(slot_at(slot) + sz_at));
        pairs_due = false;
      }
    } else if (group_left == 1 && s + 1 < s1) {
      sz_lane += n4;
      load_scales();
    }
    const uint4 w = ld_shared128_at(slot_at(slot) + w_own);
    // Step s - 2's wgmmas are done (step s - 1's may still run): this step's register set is free.
    wgmma_wait<1>();
    dequant_step<T>(w, gc, af[SET]);
    issue_step<T, NT>(acc, af[SET], slot_at(slot));
    // Groups newer than the one of step s + 1 (issued at step s + 2 - P, or before the loop): P - 2.
    cp_async_wait<P - 2>();
    if (s + 1 < s1) {  // step s + 1's planes, in a slot last read by step s + 1 - P <= s - 3's wgmmas
      permute_x(slot == P - 1 ? 0 : slot + 1);
      fence_proxy_async_shared();
    }
    if (--group_left == 0) {
      group_left = steps_per_group;
      if constexpr (SR) {
        pairs_due = true;
      } else {
        gc.set(sv_next);
      }
    }
  };

  int slot = 0, s = s0;
  const auto next = [&](int p) { return p == P - 1 ? 0 : p + 1; };
#pragma unroll 1
  for (; s + 1 < s1; s += 2) {
    step(s, slot, std::integral_constant<int, 0>{});
    slot = next(slot);
    step(s + 1, slot, std::integral_constant<int, 1>{});
    slot = next(slot);
  }
  if (s < s1) step(s, slot, std::integral_constant<int, 0>{});
  wgmma_wait<0>();
  fence_accumulators<NT>(acc);
  cp_async_wait<0>();
  if constexpr (CR) {  // the host launches this instance in clusters of the K splits only
    cluster_reduce<T, NT, WG>(acc, reinterpret_cast<float*>(ring_smem), tok0, t, m, n, warp * 8 + g, bias, out);
    return;
  }

  // sums (awq_wgmma_packed_sums): every split adds into the caller's zeroed fp32 sums (ws), the first
  // with the bias, and the block ends there: no arrival, no conversion pass (the consumer rounds).
  const bool split = gridDim.z > 1 || sums;
  store_accumulators<T, NT>(acc, tok0, t, m, n, c4, col_ok, split, ws, out, bias,
                            sums && blockIdx.z == 0 ? bias : nullptr);
  if (!split || sums) return;

  // The last block of this (token tile, column tile) to arrive converts the sums and zeroes them
  // again (one fence a block).
  const auto store4 = [&](int64_t at, int c4o, const float (&v)[4]) { store4_out<T>(out, bias, at, c4o, v); };
  gemv::convert_when_last<false, kBlock>(ws, counters, is_last, tok0, NT, m, blockIdx.y * kC4, kC4, n, store4);
#endif
}

// --- The warp-specialized form (FASTAWQ_WGMMA_FORM=ws, an A/B switch; session 22, not yet run) ---
// Session 21's profile of the form above: one 8-warp block an SM, ~167 instructions a warp a step
// at 8.1 cycles between issues, against 512 tensor-core cycles a step at 128 tokens: each warp's
// own stream (the block barrier, its cp.async copies and waits, x's permutation, the dequantization)
// sets the step. Here two warpgroups (the consumers) only dequantize and issue wgmmas, and a third
// (the producer) does every copy and x's permutation; they meet through mbarriers, not a block
// barrier. setmaxnreg moves registers from the producer (kWsProducerRegs) to the consumers
// (kWsConsumerRegs): ptxas allots a 384-thread block 168 a thread, fewer than the 211 the 128-token
// accumulators and two A sets need.
//   full[slot] (128 arrivals, the producer's threads): the slot's weights (cp.async, 16 bytes for
//     each consumer thread) have landed and x's planes are written (st.shared, then
//     fence.proxy.async so the wgmmas' async-proxy reads see them); each producer thread's
//     wait_group and its arrive's release order both before the consumers' acquiring wait.
//   empty[slot] (8 arrivals, one a consumer warp): every wgmma that read the slot's planes is done
//     (the warp waited for its warpgroup's groups up to it).
// A consumer step: wait full, one 16-byte shared load of its weights, wgmma_wait<1> (the step two
// back is done: its register set is free and its slot is released), dequantize, 4 wgmmas, commit.
// The producer keeps D = P - 3 steps of copies in flight: it refills a slot once the step P before
// is released, which the consumers do two steps after consuming it, so a lead of D <= P - 3 cannot
// wait on itself. x comes through a private ring of D + 1 raw slots (cp.async, each thread's own
// 16-byte items, read back by the same thread: wait_group alone orders them) and is permuted into
// the planes as in the form above.
template <int NT>
constexpr int kWsSlotBytes = kXBytes<NT> + 256 * 16;  // the planes, then the consumers' weights
constexpr int kWsThreads = 384;
constexpr int kWsProducerRegs = 56, kWsConsumerRegs = 224;  // 128 x 56 + 256 x 224 <= 65,536
template <int NT, int P>
constexpr int kWsSmem = P * kWsSlotBytes<NT> + (P - 2) * kXBytes<NT>;

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
#endif
}
// Spin until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
template <int R>
__device__ __forceinline__ void set_max_regs_dec() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R>
__device__ __forceinline__ void set_max_regs_inc() {
#ifdef FASTAWQ_WGMMA_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

template <typename T, int NT, int P>
__global__ void __launch_bounds__(kWsThreads, 1) awq_wgmma_ws_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const uint4* __restrict__ sz, const T* __restrict__ bias,
    T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int m, int n, int k, int group_size,
    int steps_per_block, bool sums) {
#ifdef FASTAWQ_WGMMA_DEVICE
  static_assert(P >= 4, "the producer's lead is P - 3 steps");
  constexpr int D = P - 3;          // steps of copies in flight ahead of the step being published
  constexpr int R = D + 1;          // the producer's raw x slots
  constexpr int kPlane = NT * 16;   // bytes between the x planes (core matrices adjacent in K)
  constexpr int kC4 = 64;           // 4-column chunks of the block's tile (2 warpgroups x 128 columns)
  constexpr int kXItems = 4 * NT;   // 16-byte x items a step
  constexpr int kXq = (kXItems + 127) / 128;  // a producer thread's (at NT = 16 the first 64 threads')
  extern __shared__ __align__(128) uint8_t ring_smem[];
  __shared__ __align__(8) uint64_t full_bar[P], empty_bar[P];
  __shared__ int is_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n4 = n >> 2;
  const int tok0 = blockIdx.x * NT;
  const int s_total = k / kPackedBatchRows;
  const int s0 = blockIdx.z * steps_per_block;
  const int s1 = min(s0 + steps_per_block, s_total);
  const int nsteps = max(s1 - s0, 0);
  const uint32_t base = pinned(smem_addr(ring_smem));
  const auto slot_at = [&](int slot) { return base + slot * kWsSlotBytes<NT>; };
  const uint32_t full0 = smem_addr(&full_bar[0]), empty0 = smem_addr(&empty_bar[0]);
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      mbar_init(full0 + 8 * i, 128);
      mbar_init(empty0 + 8 * i, 8);
    }
  }
  __syncthreads();

  if (warp >= 8) {
    // ---- the producer warpgroup ----
    set_max_regs_dec<kWsProducerRegs>();
    const int pt = tid - 256;
    const int64_t w_step = 4 * static_cast<int64_t>(n4);
    // Weights: items pt and pt + 128 of the step's 256 (16 bytes each): item i is row 4 s + t of
    // wpacked (t = i / 64) at chunk c4_base + i % 64, for consumer thread 32 (c / 8) + 4 (c % 8) + t
    // (c = i % 64; the thread's c4 in the form above): a warp's 32 items are 512 contiguous bytes.
    const int c = pt & 63, t0 = pt >> 6;
    const int c4w = blockIdx.y * kC4 + c;
    const bool w_ok = c4w < n4;
    const uint4* w_src = wp + (static_cast<int64_t>(s0) * 4 + t0) * n4 + (w_ok ? c4w : 0);
    const int consumer = 32 * (c >> 3) + 4 * (c & 7) + t0;  // and consumer + 2 for row t0 + 2
    const uint32_t w_dst = kXBytes<NT> + w_slot_offset(consumer);
    const uint32_t w_dst2 = kXBytes<NT> + w_slot_offset(consumer + 2);
    const auto issue_w = [&](int slot, int i) {  // step s0 + i's weights into slot
      const uint4* src = w_src + static_cast<int64_t>(i) * w_step;
      cp_async16_at(slot_at(slot) + w_dst, src, w_ok);
      cp_async16_at(slot_at(slot) + w_dst2, src + 2 * static_cast<int64_t>(n4), w_ok);  // t0 + 2
    };
    // x: items pt + 128 q (q < kXq, below 4 NT) of the step's 4 NT: token j / 4 (clamped to row M - 1: it
    // feeds only outputs never stored), 16-byte chunk j % 4 of the step's 32 k; raw at 16 j of its
    // raw slot, in the planes at (token / 8) 128 + (token % 8) 16 + 4 (j % 4) (+ plane h for word h).
    const uint32_t raw0 = base + P * kWsSlotBytes<NT>;
    const T* x_row[kXq];
    uint32_t x_dst[kXq];
#pragma unroll
    for (int q = 0; q < kXq; ++q) {
      const int j = min(pt + 128 * q, kXItems - 1), tok = j >> 2, tc = j & 3;
      x_row[q] = x + static_cast<int64_t>(min(tok0 + tok, m - 1)) * k + 8 * tc +
                 static_cast<int64_t>(s0) * kPackedBatchRows;
      x_dst[q] = (tok >> 3) * 128 + (tok & 7) * 16 + 4 * tc;
    }
    const auto x_on = [&](int q) { return kXq * 128 == kXItems || pt + 128 * q < kXItems; };
    const auto issue_x = [&](int raw, int i) {
#pragma unroll
      for (int q = 0; q < kXq; ++q) {
        if (x_on(q))
          cp_async16_at(raw0 + raw * kXBytes<NT> + (pt + 128 * q) * 16, x_row[q] + i * kPackedBatchRows, true);
      }
    };
    const auto permute_x = [&](int raw, int slot) {
#pragma unroll
      for (int q = 0; q < kXq; ++q) {
        if (!x_on(q)) continue;
        const uint4 r = ld_shared128_at(raw0 + raw * kXBytes<NT> + (pt + 128 * q) * 16);
        const uint32_t at = slot_at(slot) + x_dst[q];
        st_shared32_at(at, r.x);
        st_shared32_at(at + kPlane, r.y);
        st_shared32_at(at + 2 * kPlane, r.z);
        st_shared32_at(at + 3 * kPlane, r.w);
      }
    };
    // The first D steps' weights before the PDL wait (no kernel that can launch this one early
    // writes weights: awq_gemv_packed.h), their x after it; all waited for at the first step.
    for (int i = 0; i < D && i < nsteps; ++i) issue_w(i, i);
    cp_async_commit();
    pdl_wait();
    pdl_launch_dependents();
    for (int i = 0; i < D && i < nsteps; ++i) issue_x(i, i);
    cp_async_commit();
    cp_async_wait<0>();
#pragma unroll 1
    for (int i = 0; i < nsteps; ++i) {
      const int ahead = i + D;  // the step whose copies go out now
      if (ahead < nsteps) {
        const int slot = ahead % P;
        if (ahead >= P) mbar_wait(empty0 + 8 * slot, ((ahead - P) / P) & 1);  // step ahead - P released
        issue_w(slot, ahead);
        issue_x(ahead % R, ahead);
      }
      cp_async_commit();
      cp_async_wait<D>();  // step i's copies (committed D groups ago, or in the prologue) landed
      permute_x(i % R, i % P);
      fence_proxy_async_shared();
      mbar_arrive(full0 + 8 * (i % P));
    }
    cp_async_wait<0>();
  } else {
    // ---- the consumers: two warpgroups on 128 columns each ----
    set_max_regs_inc<kWsConsumerRegs>();
    const int g = lane >> 2, t = lane & 3;
    const int c4 = static_cast<int>(pinned(blockIdx.y * kC4 + warp * 8 + g));
    const bool col_ok = c4 < n4;  // n % 8 == 0: whole 4-column chunks
    const uint32_t w_own = w_slot_offset(tid);  // the lane's weights in a slot's region
    const int steps_per_group = group_size / kPackedBatchRows;
    pdl_wait();
    pdl_launch_dependents();

    const uint4* sz_lane = sz + static_cast<int64_t>(s0 / steps_per_group) * n4 + c4;
    uint4 sv_next = make_uint4(0, 0, 0, 0);
    const auto load_scales = [&]() {
      if (col_ok) sv_next = __ldg(sz_lane);
    };
    GroupConsts<T> gc;
    if (nsteps > 0) {
      load_scales();
      gc.set(sv_next);
    }
    int group_left = steps_per_group - s0 % steps_per_group;

    float acc[2][NT / 2];
    zero_accumulators<NT>(acc);
    uint32_t af[2][2][2][4];  // [set][m-tile i][k-step h][register]

    const auto step = [&](int i, auto set_c) {
      constexpr int SET = decltype(set_c)::value;
      const int slot = i % P;
      mbar_wait(full0 + 8 * slot, (i / P) & 1);
      if (group_left == 1 && i + 1 < nsteps) {
        sz_lane += n4;
        load_scales();
      }
      const uint4 w = ld_shared128_at(slot_at(slot) + kXBytes<NT> + w_own);
      // Step i - 2's wgmmas are done (step i - 1's may still run): its register set is free and its
      // slot goes back to the producer.
      wgmma_wait<1>();
      if (i >= 2) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * ((i - 2) % P));
      }
      dequant_step<T>(w, gc, af[SET]);
      issue_step<T, NT>(acc, af[SET], slot_at(slot));
      if (--group_left == 0) {
        group_left = steps_per_group;
        gc.set(sv_next);
      }
    };

    int i = 0;
#pragma unroll 1
    for (; i + 1 < nsteps; i += 2) {
      step(i, std::integral_constant<int, 0>{});
      step(i + 1, std::integral_constant<int, 1>{});
    }
    if (i < nsteps) step(i, std::integral_constant<int, 0>{});
    wgmma_wait<0>();
    fence_accumulators<NT>(acc);
    // sums (awq_wgmma_packed_sums): every split adds into the caller's fp32 sums, the first with the
    // bias, as in the plain form.
    store_accumulators<T, NT>(acc, tok0, t, m, n, c4, col_ok, gridDim.z > 1 || sums, ws, out, bias,
                              sums && blockIdx.z == 0 ? bias : nullptr);
  }
  if (gridDim.z == 1 || sums) return;

  // The last block of this (token tile, column tile) to arrive converts the sums and zeroes them
  // again (one fence a block; the producer warpgroup joins its barriers and conversion).
  const auto store4 = [&](int64_t at, int c4o, const float (&v)[4]) { store4_out<T>(out, bias, at, c4o, v); };
  gemv::convert_when_last<false, kWsThreads>(ws, counters, is_last, tok0, NT, m, blockIdx.y * kC4, kC4, n, store4);
#endif
}

// The ring's depth: 6 slots by default (5 steps of weights and x in flight while one is consumed),
// 48 / 72 / 120 KB a block at NT = 32 / 64 / 128. FASTAWQ_WGMMA_DEPTH=4 or 8 (an A/B switch, read at
// each call, so a graph keeps the one it was captured with, and the plan's occupancy query sees the
// instance the launch runs) picks 4 (32 / 48 / 80 KB) or 8 (64 / 96 / 160 KB).
int ring_depth() {
  const char* v = std::getenv("FASTAWQ_WGMMA_DEPTH");
  if (v != nullptr && v[0] != '\0' && v[1] == '\0' && (v[0] == '4' || v[0] == '8')) return v[0] - '0';
  return 6;
}

// The plain form's (scale, zero) pairs through the ring (the default 6-slot ring only): they travel
// with the weights of each group's first step (one 16-byte cp.async a lane quad, 512 bytes a slot a
// warpgroup) and are read back after that step's barrier, instead of an __ldg a step ahead whose
// first use held 14 % of the 16-token tile's stall samples (s36n, H200). Fetching them a whole group
// ahead in registers lost (session 35: 1.80 / 1.58 / 1.31 against 1.82 / 1.63 / 1.27 at M = 9 / 16 /
// 32, the pairs' 4 registers live across the group in an 80-register instance); the ring holds them
// in shared memory and frees sv_next's registers. H100, session 36, same call: geomean x cuBLAS at
// M = 9 / 16 / 32 1.92 / 1.73 / 1.28 against 1.87 / 1.66 / 1.29, the Llama-3-8B-shape engine at
// batch 9 / 16 / 32 1.016x / 1.016x / 0.990x: the 16-token tile takes them (one warpgroup), the
// wider tiles keep the __ldg. FASTAWQ_WGMMA_SCALES (an A/B switch read at each call) forces: "ring"
// every tile, "0" none.
bool wgmma_scales_in_ring(int tokens, int warpgroups) {
  const char* v = std::getenv("FASTAWQ_WGMMA_SCALES");
  if (v != nullptr && std::strcmp(v, "ring") == 0) return true;
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  return tokens == 16 && warpgroups == 1;
}

// Six blocks an SM at the 16-token tile of one warpgroup (FASTAWQ_WGMMA_OCC, on unless "0"; read at
// each call, and the plan's occupancy query sees the instance the launch runs): ptxas keeps the
// kernel in 80 registers instead of 95, so the one-wave plan (gemm_steps_per_block) gives every
// shape more blocks of fewer steps, e.g. 4096 x 28672 3 K splits (672 blocks, 43 steps each) instead
// of 2 (448 of 64 steps, 3.4 an SM where 5 fit). Session 35 (H200, same run): geomean x cuBLAS at
// M = 9 / 16 1.29 / 1.20 against 1.27 / 1.19 (4096 x 28672: 1.34 / 1.19 against 1.17 / 1.11); the
// Llama-3-8B-shape engine at batch 9 / 16 / 32 1.005x / 1.004x / 1.002x.
bool wgmma_occupancy_six() {
  const char* v = std::getenv("FASTAWQ_WGMMA_OCC");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

template <typename T, int NT, int P, int WG, int MINB = kMinBlocks<NT, WG>, bool SR = false, bool CR = false>
void launch_p(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  constexpr auto kernel = awq_wgmma_packed_kernel<T, NT, P, WG, MINB, SR, CR>;
  constexpr int kSmem = P * kSlotBytes<NT, WG, SR>;
  opt_in_shared_memory<kernel>(kSmem);
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kThreads<WG>, kSmem);
    return;
  }
  launch_pdl_cluster3(kernel, dim3(a.token_tiles, a.col_tiles, a.splits), dim3(kThreads<WG>), kSmem, stream,
                      dim3(CR ? 1 : 0, 1, CR ? a.splits : 1), static_cast<const T*>(a.x),
                      reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz),
                      static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n,
                      a.k, a.group_size, a.steps_per_warp, a.sums);
}

// The default 6-slot ring's instance with the pairs through the ring (sr) or by __ldg, the K splits
// meeting in a cluster (a.cluster: 16- to 64-token tiles) or through the workspace.
template <typename T, int NT, int WG, int MINB>
void launch_p6(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident, bool sr) {
  if constexpr (NT <= 64) {
    if (a.cluster && resident == nullptr) {
      if (sr) return launch_p<T, NT, 6, WG, MINB, true, true>(a, stream, resident);
      return launch_p<T, NT, 6, WG, MINB, false, true>(a, stream, resident);
    }
  }
  if (sr) return launch_p<T, NT, 6, WG, MINB, true>(a, stream, resident);
  launch_p<T, NT, 6, WG, MINB>(a, stream, resident);
}

template <typename T, int NT, int WG>
void launch_wg(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  switch (ring_depth()) {
    case 4: return launch_p<T, NT, 4, WG>(a, stream, resident);
    case 8: return launch_p<T, NT, 8, WG>(a, stream, resident);
    default: {
      const bool sr = wgmma_scales_in_ring(NT, WG);
      if constexpr (NT == 16 && WG == 1) {
        if (wgmma_occupancy_six()) return launch_p6<T, NT, WG, 6>(a, stream, resident, sr);
      }
      return launch_p6<T, NT, WG, kMinBlocks<NT, WG>>(a, stream, resident, sr);
    }
  }
}

// The warp-specialized form's ring: 8 slots (a lead of 5 steps) on every tile. Session 22 gave the
// tiles up to 64 tokens 12 (a lead of 9: ~1.5 us of copy latency at an SM's share of the bandwidth
// needs ~37 KB in flight, a guess); session 38 (H100, gemm_table.py --kernels wgmma, geomean x cuBLAS
// fp16, same call) measured 8 ahead at M = 48 / 64: 1.02 / 0.96 against 0.97 / 0.93 (4096 x 4096:
// 0.83 / 0.76 against 0.78 / 0.73). FASTAWQ_WGMMA_WS_DEPTH=8 or 12 (an A/B switch, read at each call)
// forces either: 70 / 136 / 224 KB a block at 12 slots and NT = 16 / 64 / 128, 46 / 88 / 144 KB at 8.
int ws_ring_depth() {
  const char* v = std::getenv("FASTAWQ_WGMMA_WS_DEPTH");
  if (v != nullptr && std::strcmp(v, "12") == 0) return 12;
  return 8;
}

template <typename T, int NT, int P>
void launch_ws_p(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  constexpr auto kernel = awq_wgmma_ws_kernel<T, NT, P>;
  constexpr int kSmem = kWsSmem<NT, P>;
  opt_in_shared_memory<kernel>(kSmem);
  if (resident != nullptr) {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(resident, kernel, kWsThreads, kSmem);
    return;
  }
  launch_pdl(kernel, dim3(a.token_tiles, a.col_tiles, a.splits), dim3(kWsThreads), kSmem, stream,
             static_cast<const T*>(a.x), reinterpret_cast<const uint4*>(a.w), static_cast<const uint4*>(a.sz),
             static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n, a.k,
             a.group_size, a.steps_per_warp, a.sums);
}

template <typename T, int NT>
void launch_ws(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  if (ws_ring_depth() == 8) return launch_ws_p<T, NT, 8>(a, stream, resident);
  launch_ws_p<T, NT, 12>(a, stream, resident);
}

template <typename T, int NT>
void launch_nt(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  if (a.ws) return launch_ws<T, NT>(a, stream, resident);
  if (a.warpgroups == 1) return launch_wg<T, NT, 1>(a, stream, resident);
  launch_wg<T, NT, 2>(a, stream, resident);
}

template <typename T>
void launch_t(const WgmmaPackedArgs& a, cudaStream_t stream, int* resident) {
  switch (a.tokens) {
    case 16: return launch_nt<T, 16>(a, stream, resident);
    case 32: return launch_nt<T, 32>(a, stream, resident);
    case 64: return launch_nt<T, 64>(a, stream, resident);
    default: return launch_nt<T, 128>(a, stream, resident);
  }
}

}  // namespace

void launch_awq_wgmma_packed(const WgmmaPackedArgs& a, cudaStream_t stream) {
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, stream, nullptr); });
}

int wgmma_packed_resident_blocks(const WgmmaPackedArgs& a) {
  int blocks = 0;
  gemv::by_dtype(a.dtype, [&](auto t) { launch_t<decltype(t)>(a, nullptr, &blocks); });
  return blocks > 0 ? blocks : 1;
}

}  // namespace fastawq
