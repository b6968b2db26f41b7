// Graph-safe zeroed device buffers for kernels that reset what they use (split-K tile counters,
// the GEMV's fp32 sums, decode attention's arrival counters), so no memset precedes a launch.
#pragma once

#include <cstdint>

#include <c10/core/Device.h>

namespace fastawq {

// One buffer per (use, device): launches that share a use on one device must not overlap on two
// streams, since they would share counters.
enum class Workspace : int {
  kGemmTileCounters = 0,
  kGemvSums = 1,
  kAttentionCounters = 2,
  kMoeSums = 3,
  kMoeCounters = 4,
  kRouteCounters = 5,
  kCount = 6
};

// A zeroed buffer of at least `numel` int32 (counters) or fp32 (sums) elements on `device`,
// grown on demand. Outgrown buffers stay alive for the process: a captured CUDA graph keeps
// pointing at the one it saw. Created inside a capture, the zeroing is a memset node of the graph
// (it re-zeroes memory the kernels leave zeroed anyway).
void* zeroed_workspace(Workspace use, const c10::Device& device, int64_t numel);

inline int* zeroed_counters(Workspace use, const c10::Device& device, int64_t numel) {
  return static_cast<int*>(zeroed_workspace(use, device, numel));
}
inline float* zeroed_sums(Workspace use, const c10::Device& device, int64_t numel) {
  return static_cast<float*>(zeroed_workspace(use, device, numel));
}

}  // namespace fastawq
