// Kernel launches that allow programmatic dependent launch (PDL, sm_90): the kernel may start
// while the previous one in the stream finishes, and must call pdl_wait() (common/ptx.cuh) before
// it touches anything that kernel wrote. FASTAWQ_PDL=0 turns it off (common/pdl.cpp); on GPUs
// before sm_90 the launch is a plain one. CUDA graphs keep the programmatic edge.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

namespace fastawq {

// FASTAWQ_PDL is not "0"/"off"/"false" and the current device is sm_90 or newer.
bool pdl_enabled();
// The A/B switch `name` (read at each call, so a CUDA graph keeps the setting it was captured with):
// 1 when set to exactly "1", 0 when "0", -1 otherwise (unset: the caller's default). The one reader
// of the compiled kernels' on/off switches.
int env_switch(const char* name);
// Whether `name` is set to exactly "1" (switches that are off by default).
bool env_flag_on(const char* name);
// The integer A/B setting `name` (read at each call): its value when it is a whole decimal number in
// lo..hi, `fallback` otherwise (unset, empty, malformed or out of range).
int env_int(const char* name, int lo, int hi, int fallback);
// FASTAWQ_GEMV_EARLY_LOADS (on unless "0"; read at each call): the decode GEMVs load their first
// weights into registers before the PDL wait, not only into L2 (awq_gemv_packed.h says when safe).
// H200, session 18: Llama-3-8B shape decode 473.2 -> 475.7 tokens/s at batch 1, Qwen3-30B-A3B
// 466.5 -> 469.4 (RESULTS.md).
bool early_weight_loads();
// FASTAWQ_GEMV_PREFETCH=N (an A/B switch, read at each call): the decode GEMV brings the first N
// 32-row batches of each warp's range into L2 before the PDL wait (default 2; a one-wave grid gives
// a warp ~3-4 batches at batch 1, so a large N prefetches the whole range while the previous kernel,
// e.g. the decode attention before o_proj, finishes). Layers of more than 24 MB of packed weights
// keep the default (their whole range would not stay in L2). A value that is not a count reads as
// the default.
int gemv_prefetch_batches(int64_t weight_bytes);

// launch_pdl for a kernel whose blocks run in clusters of `cluster` blocks (sm_90; each of the grid's
// dimensions a multiple of the cluster's); cluster.x = 0: no cluster.
template <typename... Params, typename... Args>
void launch_pdl_cluster3(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  // An error stays the runtime's last error, which the host entry checks after the launch.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// launch_pdl for a kernel whose blocks run in clusters of cluster_x blocks along x (the grid's x a
// multiple of cluster_x); cluster_x = 0: no cluster.
template <typename... Params, typename... Args>
void launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        int cluster_x, Args&&... args) {
  launch_pdl_cluster3(kernel, grid, block, smem, stream, dim3(cluster_x > 0 ? cluster_x : 0, 1, 1),
                      std::forward<Args>(args)...);
}

// Above 48 KB of dynamic shared memory a kernel must opt in, up to `bytes`: once per kernel (the
// template argument) and device.
template <auto kKernel>
void opt_in_shared_memory(int bytes) {
  static std::atomic<uint64_t> opted{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((opted.load(std::memory_order_relaxed) & bit) == 0) {
    cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    opted.fetch_or(bit, std::memory_order_relaxed);
  }
}

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, stream, 0, std::forward<Args>(args)...);
}

}  // namespace fastawq
