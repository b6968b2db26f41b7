// How fast can a decode kernel read its weights, by access pattern? A standalone probe (no torch):
// every pattern reads the same bytes and only XORs them, so the result is the memory ceiling of
// that pattern, not of any kernel's arithmetic.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/probe_bandwidth benchmarks/probe_bandwidth.cu && /tmp/probe_bandwidth
//
// Patterns (a warp's 16-byte loads; L lanes side by side on one row, 32 / L rows a load):
//   rows512  L = 32: 512 contiguous bytes a row, rows `row_bytes` apart (the packed GEMV's loads)
//   rows128  L = 8:  4 rows x 128 bytes a load (the AWQ-layout GEMV and moe_gemv's w2 tile)
//   rows64   L = 4:  8 rows x 64 bytes a load (moe_gemv's w13: 64 gate bytes, 64 up bytes)
//   contig   each warp's range of rows stored contiguously (a tile-major layout)
//   bulk     each block's range contiguous, streamed by one thread's cp.async.bulk into a
//            shared-memory ring of 4 stages (the Hopper copy engine path)
// Each warp takes one item (a column block and a range of rows), as the GEMVs split their grid;
// U loads are in flight per lane. Timing as ../shared/TARGETS.md: 16 launches on 16 buffers
// captured in one CUDA graph, replay time / 16, median of 10 replays.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);     \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

struct Geometry {
  const uint4* base;
  int64_t row16;        // 16-byte units a row
  int lanes;            // L
  int rows_per_item;    // rows of one warp item
  int col_blocks;       // row16 / L
  int items;
  int contig;           // 1: item i stored contiguously at i * rows_per_item * L
};

template <int U>
__global__ void __launch_bounds__(128) read_rows(Geometry g, uint32_t* sink) {
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (item >= g.items) return;
  const int rpl = 32 / g.lanes;  // rows a load
  const int cb = item % g.col_blocks, rc = item / g.col_blocks;
  const int64_t r0 = static_cast<int64_t>(rc) * g.rows_per_item;
  const uint4* p;
  int64_t step;
  if (g.contig) {
    p = g.base + static_cast<int64_t>(item) * g.rows_per_item * g.lanes + lane;
    step = 32;
  } else {
    p = g.base + (r0 + lane / g.lanes) * g.row16 + cb * g.lanes + lane % g.lanes;
    step = rpl * g.row16;
  }
  uint32_t acc = 0;
  const int loads = g.rows_per_item / rpl;
  int i = 0;
  for (; i + U <= loads; i += U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(p + (i + u) * step);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < loads; ++i) {
    const uint4 v = ld_stream(p + i * step);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // never true for the fill below; keeps the loads
}

constexpr int kStages = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int SB>
__global__ void __launch_bounds__(128) read_bulk(const uint8_t* base, int64_t block_bytes, uint32_t* sink) {
  __shared__ alignas(128) uint8_t buf[kStages][SB];
  __shared__ alignas(8) uint64_t bar[kStages];
  const int tid = threadIdx.x;
  const uint8_t* src = base + blockIdx.x * block_bytes;
  const int total = static_cast<int>(block_bytes / SB);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
  }
  __syncthreads();
  const auto issue = [&](int s, int it) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(&bar[s])), "r"(SB));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_addr(buf[s])),
        "l"(src + static_cast<int64_t>(it) * SB), "r"(SB), "r"(smem_addr(&bar[s]))
        : "memory");
  };
  if (tid == 0) {
    for (int s = 0; s < kStages && s < total; ++s) issue(s, s);
  }
  uint32_t acc = 0;
  for (int it = 0; it < total; ++it) {
    const int s = it % kStages;
    const uint32_t parity = (it / kStages) & 1;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_addr(&bar[s])), "r"(parity)
          : "memory");
    }
    const uint4* b4 = reinterpret_cast<const uint4*>(buf[s]);
#pragma unroll 4
    for (int j = tid; j < SB / 16; j += 128) {
      const uint4 v = b4[j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncthreads();
    if (tid == 0 && it + kStages < total) issue(s, it + kStages);
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

struct Shape {
  const char* name;
  int64_t k, n;  // a W4 matrix [K, N]
};

template <typename Launch>
double time_graph(Launch&& launch_on) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int b = 0; b < 16; ++b) launch_on(b, st);  // warm
  CK(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int b = 0; b < 16; ++b) launch_on(b, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < 13; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return 1e3 * ms[ms.size() / 2] / 16.0;  // µs a launch
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Shape shapes[] = {{"4096x6144", 4096, 6144},
                          {"4096x4096", 4096, 4096},
                          {"4096x28672", 4096, 28672},
                          {"14336x4096", 14336, 4096},
                          {"mixtral_w2_2exp", 2 * 14336, 4096},
                          {"big_1GiB", 65536, 32768}};
  // Matrices up to the largest layer get 16 buffers (none served from L2); bigger ones read one.
  const int64_t copy_bytes = int64_t(4096) * 28672 / 2, single_bytes = int64_t(65536) * 32768 / 2;
  uint8_t* pool;
  const int64_t pool_bytes = std::max<int64_t>(16 * copy_bytes, single_bytes) + (1 << 20);
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMemset(pool, 0x5A, pool_bytes));
  uint32_t* sink;
  CK(cudaMalloc(&sink, 64));
  std::printf("SMs %d\n", sms);
  std::printf("%-16s %-9s %3s %5s %9s %9s\n", "shape", "pattern", "U", "wpsm", "us", "GB/s");
  for (const Shape& sh : shapes) {
    const int64_t bytes = sh.k * sh.n / 2;
    const int copies = bytes > copy_bytes ? 1 : 16;
    const int64_t stride = (bytes + 4095) / 4096 * 4096;
    struct Pat {
      const char* name;
      int lanes;
      int contig;
      bool awq;  // AWQ layout rows: [K, N/8] words; else packed [K/8, N] words
    };
    const Pat pats[] = {{"rows512", 32, 0, false}, {"rows128", 8, 0, true}, {"rows64", 4, 0, true},
                        {"contig", 32, 1, false}};
    for (const Pat& pt : pats) {
      for (int U : {4, 8}) {
        for (int wpsm : {16, 32}) {
          Geometry g{};
          const int64_t rows = pt.awq ? sh.k : sh.k / 8;
          g.row16 = (pt.awq ? sh.n / 2 : sh.n * 4) / 16;
          g.lanes = pt.lanes;
          g.col_blocks = static_cast<int>(g.row16 / g.lanes);
          g.contig = pt.contig;
          // rows per item: enough items for wpsm warps on every SM, a multiple of U loads
          const int rpl = 32 / g.lanes;
          const int64_t want = int64_t(sms) * wpsm;
          int64_t rpi = std::max<int64_t>(rpl * U, rows * g.col_blocks / want);
          rpi = (rpi + rpl * U - 1) / (rpl * U) * (rpl * U);
          while (rows % rpi) rpi -= rpl;  // exact cover
          g.rows_per_item = static_cast<int>(rpi);
          g.items = static_cast<int>(g.col_blocks * (rows / rpi));
          const int blocks = (g.items + 3) / 4;
          const double us = time_graph([&](int b, cudaStream_t st) {
            Geometry gb = g;
            gb.base = reinterpret_cast<const uint4*>(pool + (b % copies) * stride);
            if (U == 4) read_rows<4><<<blocks, 128, 0, st>>>(gb, sink);
            else read_rows<8><<<blocks, 128, 0, st>>>(gb, sink);
          });
          std::printf("%-16s %-9s %3d %5d %9.2f %9.1f\n", sh.name, pt.name, U, wpsm, us, bytes / us / 1e3);
        }
      }
    }
    for (int blocks_per_sm : {1, 2, 4}) {
      constexpr int SB = 8192;
      const int64_t nblk = int64_t(sms) * blocks_per_sm;
      const int64_t block_bytes = (bytes / nblk + SB - 1) / SB * SB;
      const int64_t grid = bytes / block_bytes;  // reads grid * block_bytes <= bytes
      const double us = time_graph([&](int b, cudaStream_t st) {
        read_bulk<SB><<<static_cast<unsigned>(grid), 128, 0, st>>>(pool + (b % copies) * stride, block_bytes, sink);
      });
      std::printf("%-16s %-9s %3d %5d %9.2f %9.1f\n", sh.name, "bulk8k", kStages, blocks_per_sm, us,
                  grid * block_bytes / us / 1e3);
    }
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
