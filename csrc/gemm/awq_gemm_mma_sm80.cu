// W4A16 GEMM on the tensor cores (mma.sync m16n8k16), reading the AWQ "GEMM" layout directly.
//
// y[M, N] = x[M, K] @ ((q - z) * s) with fp32 accumulation. No repack: the mma's internal k and n
// orders are free labels, so they are chosen to match the packed words.
//   n: mma column c of an 8-column tile is nibble c of a packed word (real column AWQ_ORDER[c]),
//      so every lane extracts one fixed nibble position from every word it reads;
//   k: mma k index {2t, 2t+1, 2t+8, 2t+9} of lane (g, t) is physical row 4t..4t+3, so a lane's A
//      fragment is one 8-byte load and its B fragment comes from 4 consecutive rows.
// One 16-byte shared load gives a lane the words of 4 neighbouring 8-column tiles for one row.
// The result of lane (g, t) lands in real columns AWQ_ORDER[2t], AWQ_ORDER[2t+1]: the epilogue
// scatters accordingly.
// Stages of 4 x 32 rows (one cp.async group and one barrier per 128 rows) with each thread's load
// addresses computed once: the per-stage cost dominated with 32-row stages (CUDA_NOTES.md).
#include "common/dtype.cuh"
#include "common/launch.h"
#include "common/ptx.cuh"

namespace fastawq {
namespace {

constexpr int kWarpsN = kMmaBlockN / 32;  // warps side by side in N, 32 columns each
constexpr int kKsub = 4;                  // 32-row tiles per pipeline stage

// Real column (0..7) held by nibble c.
__device__ __forceinline__ int awq_order(int c) { return (c & 3) * 2 + (c >> 2); }

// WN warps side by side in N, each on 32 columns (4 packed words): a tile row is WN * 16 bytes.
template <int MT, int WN>
struct Smem {
  static constexpr int kBM = 16 * MT;
  static constexpr int kWords = WN * 4;       // packed words per tile row
  uint32_t w[kMmaBlockK * kWords];            // 32 rows; 16-byte chunk j of row r at j ^ ((r >> 2) & 3)
  uint32_t z[kWords];                         // the tile's zero words (one group per stage)
  uint16_t s[kWords * 8];                     // the tile's scales
  uint16_t x[kBM * kMmaBlockK];               // BM rows x 64 B; 32-byte half h of row r at h ^ ((r >> 1) & 1)
};

template <typename T, int MT, int STAGES>
__global__ void __launch_bounds__(kWarpsN * 32) awq_gemm_mma_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int m, int n, int k, int group_size, int tiles_per_split) {
  using Tr = HalfTraits<T>;
  using T2 = typename Tr::T2;
  constexpr int WN = kWarpsN;
  constexpr int KSUB = kKsub;
  constexpr int kBM = 16 * MT;
  constexpr int kThreads = WN * 32;
  constexpr int kWords = WN * 4;
  constexpr int kBlockN = kWords * 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* smem = reinterpret_cast<Smem<MT, WN>*>(smem_raw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n8 = n >> 3;
  const int word0 = blockIdx.x * kWords;  // first packed word column of this block
  const int m0 = blockIdx.z * kBM;
  const int splits = gridDim.y;
  const int kt_total = k / kMmaBlockK;
  const int kt_begin = blockIdx.y * tiles_per_split;
  const int kt_end = min(kt_begin + tiles_per_split, kt_total);
  const int ntiles = max(kt_end - kt_begin, 0);
  const uint64_t policy = evict_first_policy();

  // Each thread's sources and destinations are computed once here and offset per tile (per-tile
  // address arithmetic was half of the main loop's PTX).
  constexpr int kXPer = (kBM * 4 + kThreads - 1) / kThreads;  // activation chunks per thread
  static_assert(WN + kBlockN / 8 <= 32, "the loader issues zeros and scales from warp 0");
  const int w_row = tid / WN, w_chunk = tid % WN;
  const bool w_ok = word0 + w_chunk * 4 < n8;
  const uint32_t* w_src0 = qweight + static_cast<int64_t>(kt_begin * kMmaBlockK + w_row) * n8 +
                           (w_ok ? word0 + w_chunk * 4 : 0);
  const int w_dst = w_row * kWords + ((w_chunk ^ ((w_row >> 2) & 3)) * 4);
  const T* x_src0[kXPer];
  int x_dst[kXPer];
  bool x_ok[kXPer], x_on[kXPer];
#pragma unroll
  for (int j = 0; j < kXPer; ++j) {
    const int i = tid + j * kThreads;
    const int row = i >> 2, chunk = i & 3;
    x_on[j] = i < kBM * 4;
    x_ok[j] = x_on[j] && m0 + row < m;
    x_src0[j] = x + static_cast<int64_t>(x_ok[j] ? m0 + row : 0) * k + chunk * 8;
    x_dst[j] = row * kMmaBlockK + ((chunk >> 1) ^ ((row >> 1) & 1)) * 16 + (chunk & 1) * 8;
  }

  auto load_stage = [&](int slot, int kt) {
    Smem<MT, WN>& st = smem[slot];
    const int k0 = kt * kMmaBlockK;
    cp_async16_stream(&st.w[w_dst], w_src0 + static_cast<int64_t>(kt - kt_begin) * (kMmaBlockK * n8), w_ok,
                      policy);
#pragma unroll
    for (int j = 0; j < kXPer; ++j) {
      if (x_on[j]) cp_async16(&st.x[x_dst[j]], x_src0[j] + k0, x_ok[j]);
    }
    if (warp == 0 && lane < WN + kBlockN / 8) {  // zeros (WN chunks) and scales of the tile's group
      const int grp = k0 / group_size;
      if (lane < WN) {
        const int word = word0 + lane * 4;
        const bool ok = word < n8;
        cp_async16(&st.z[lane * 4], qzeros + static_cast<int64_t>(grp) * n8 + (ok ? word : 0), ok);
      } else {
        const int col = word0 * 8 + (lane - WN) * 8;
        const bool ok = col < n;
        cp_async16(&st.s[(lane - WN) * 8], scales + static_cast<int64_t>(grp) * n + (ok ? col : 0), ok);
      }
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  // Lane g reads nibble g of every word: byte g/2 of two words side by side, then a 0/4-bit shift.
  const uint32_t sel = static_cast<uint32_t>((g >> 1) | ((4 + (g >> 1)) << 8));
  const int nib_shift = (g & 1) * 4;
  const uint32_t magic16 = Tr::kMagic2 & 0xFFFFu;

  // Tiles [s * KSUB, s * KSUB + KSUB) of this split form pipeline stage s, in slots
  // (s % STAGES) * KSUB + sub.
  const int nstages = (ntiles + KSUB - 1) / KSUB;
  auto load_group = [&](int s) {
#pragma unroll
    for (int sub = 0; sub < KSUB; ++sub) {
      const int i = s * KSUB + sub;
      if (i < ntiles) load_stage((s % STAGES) * KSUB + sub, kt_begin + i);
    }
  };

  auto compute_tile = [&](const Smem<MT, WN>& st) {
    // Per-tile zero point and scale of this lane's column in each of the warp's 4 tiles.
    uint32_t zz[4], ss[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int wcol = warp * 4 + j;
      const uint32_t zq = magic16 | ((st.z[wcol] >> (4 * g)) & 0xFu);
      zz[j] = zq | (zq << 16);
      const uint32_t sv = st.s[wcol * 8 + awq_order(g)];
      ss[j] = sv | (sv << 16);
    }

#pragma unroll
    for (int ks = 0; ks < kMmaBlockK / 16; ++ks) {
      uint4 q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = ks * 16 + 4 * t + i;
        q[i] = *reinterpret_cast<const uint4*>(&st.w[row * kWords + ((warp ^ t) * 4)]);
      }
      uint32_t b[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w0 = reinterpret_cast<const uint32_t*>(&q[0])[j];
        const uint32_t w1 = reinterpret_cast<const uint32_t*>(&q[1])[j];
        const uint32_t w2 = reinterpret_cast<const uint32_t*>(&q[2])[j];
        const uint32_t w3 = reinterpret_cast<const uint32_t*>(&q[3])[j];
        uint32_t lo = and_or(__byte_perm(w0, w1, sel) >> nib_shift, 0x000F000Fu, Tr::kMagic2);
        uint32_t hi = and_or(__byte_perm(w2, w3, sel) >> nib_shift, 0x000F000Fu, Tr::kMagic2);
        // (magic + q) - (magic + z) is exact; one rounding in the multiply by s, as in the reference.
        T2 vlo = __hmul2(__hsub2(*reinterpret_cast<T2*>(&lo), *reinterpret_cast<T2*>(&zz[j])),
                         *reinterpret_cast<T2*>(&ss[j]));
        T2 vhi = __hmul2(__hsub2(*reinterpret_cast<T2*>(&hi), *reinterpret_cast<T2*>(&zz[j])),
                         *reinterpret_cast<T2*>(&ss[j]));
        b[j][0] = *reinterpret_cast<uint32_t*>(&vlo);
        b[j][1] = *reinterpret_cast<uint32_t*>(&vhi);
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const int r0 = mi * 16 + g;
        const int off = (ks * 16 + 4 * t) ^ (((r0 >> 1) & 1) << 4);  // in halfs; row r0+8 has the same swizzle
        const uint2 lo_row = *reinterpret_cast<const uint2*>(&st.x[r0 * kMmaBlockK + off]);
        const uint2 hi_row = *reinterpret_cast<const uint2*>(&st.x[(r0 + 8) * kMmaBlockK + off]);
        const uint32_t a[4] = {lo_row.x, hi_row.x, lo_row.y, hi_row.y};
#pragma unroll
        for (int j = 0; j < 4; ++j) Mma<T>::run(acc[mi][j], a, b[j][0], b[j][1]);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nstages) load_group(s);
    cp_async_commit();
  }

  for (int s = 0; s < nstages; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (s + STAGES - 1 < nstages) load_group(s + STAGES - 1);
    cp_async_commit();
#pragma unroll
    for (int sub = 0; sub < KSUB; ++sub) {
      if (s * KSUB + sub < ntiles) compute_tile(smem[(s % STAGES) * KSUB + sub]);
    }
  }
  cp_async_wait<0>();

  // Epilogue. Lane (g, t) holds rows g, g+8 and mma columns 2t, 2t+1 = real columns below.
  const int c_lo = awq_order(2 * t), c_hi = awq_order(2 * t + 1);
  // fn(offset of the element in [M, N], its column, its fp32 sum) for each in-range result.
  auto for_each_result = [&](auto&& fn) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = m0 + mi * 16 + g + (r >> 1) * 8;
          const int col = (word0 + warp * 4 + j) * 8 + ((r & 1) ? c_hi : c_lo);
          if (row < m && col < n) fn(static_cast<int64_t>(row) * n + col, col, acc[mi][j][r]);
        }
  };
  if (splits == 1) {
    for_each_result([&](int64_t idx, int col, float v) {
      if (bias != nullptr) v += Tr::to_float(bias[col]);
      out[idx] = Tr::from_float(v);
    });
    return;
  }

  // Split-K: each split writes fp32 partials; the last block of a tile to finish sums them.
  float* part = ws + static_cast<int64_t>(blockIdx.y) * m * n;
  for_each_result([&](int64_t idx, int, float v) { __stcg(part + idx, v); });
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  int* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
  if (tid == 0) {
    const int prev = atomicAdd(counter, 1);
    is_last = prev == splits - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int rows = min(kBM, m - m0);
  const int col0 = word0 * 8;
  for (int i = tid; i < rows * kBlockN; i += kThreads) {
    const int row = m0 + i / kBlockN, col = col0 + i % kBlockN;
    if (col >= n) continue;
    const int64_t idx = static_cast<int64_t>(row) * n + col;
    float v = bias != nullptr ? Tr::to_float(bias[col]) : 0.f;
    for (int sp = 0; sp < splits; ++sp) v += __ldcg(ws + static_cast<int64_t>(sp) * m * n + idx);
    out[idx] = Tr::from_float(v);
  }
  if (tid == 0) *counter = 0;  // ready for the next launch (and for CUDA-graph replays)
}

template <typename T, int MT, int STAGES>
void launch(const MmaArgs& a, cudaStream_t stream) {
  const size_t smem = sizeof(Smem<MT, kWarpsN>) * STAGES * kKsub;
  auto kernel = awq_gemm_mma_kernel<T, MT, STAGES>;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid((a.n + kMmaBlockN - 1) / kMmaBlockN, a.splits, (a.m + 16 * MT - 1) / (16 * MT));
  kernel<<<grid, kWarpsN * 32, smem, stream>>>(
      static_cast<const T*>(a.x), a.qweight, static_cast<const T*>(a.scales), a.qzeros,
      static_cast<const T*>(a.bias), static_cast<T*>(a.out), a.workspace, a.counters, a.m, a.n, a.k, a.group_size,
      a.tiles_per_split);
}

template <typename T>
void launch_for_m(const MmaArgs& a, cudaStream_t stream) {
  // Instances must match mma_block_m() in launch.h; 3 stages of 128 rows each.
  if (a.m <= 16) {
    launch<T, 1, 3>(a, stream);
  } else if (a.m <= 32) {
    launch<T, 2, 3>(a, stream);
  } else {
    launch<T, 4, 3>(a, stream);
  }
}

}  // namespace

void launch_awq_gemm_mma(const MmaArgs& args, cudaStream_t stream) {
  args.dtype == HalfType::kHalf ? launch_for_m<__half>(args, stream) : launch_for_m<__nv_bfloat16>(args, stream);
}

}  // namespace fastawq
