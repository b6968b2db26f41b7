// What the two MoE kernel families of this folder share (moe_gemv.cu on the CUDA cores, moe_mma.cuh
// on the tensor cores): the activation of act(gate) * up and the arrival counter through which the
// last block to add into a zeroed fp32 workspace knows it may convert it.
#pragma once

#include <cstdint>

namespace fastawq {
namespace moe {

template <int ACT>
__device__ __forceinline__ float act_fn(float g) {
  if constexpr (ACT == 0) return g / (1.f + __expf(-g));                          // silu
  if constexpr (ACT == 1) return 0.5f * g * (1.f + erff(g * 0.7071067811865476f));  // gelu
  const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);              // gelu (tanh)
  return g / (1.f + __expf(-2.f * u));
}

// After every thread's atomics into the workspace: is this block the last of `expected` to
// arrive at `counter`? The last one resets the counter (graph-safe: no memset before a launch).
// `flag` is a shared int of the block.
__device__ __forceinline__ bool arrive_last(int* counter, int expected, int& flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    flag = prev == expected - 1;
    if (flag) *counter = 0;
  }
  __syncthreads();
  if (flag) __threadfence();
  return flag;
}

}  // namespace moe
}  // namespace fastawq
