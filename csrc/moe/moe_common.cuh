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

// The calling block's share of sums[0 .. total) set to zero: the blocks of the whole 3-D grid split
// it evenly, kThreads threads a block (the one-token kernels' fp32 out_sums, zeroed by w13 after its
// PDL wait for w2 to add into).
template <int kThreads>
__device__ __forceinline__ void zero_share(float* sums, int64_t total) {
  const int64_t blocks = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t b = (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t per = (total + blocks - 1) / blocks, end = min(total, (b + 1) * per);
  for (int64_t i = b * per + threadIdx.x; i < end; i += kThreads) sums[i] = 0.f;
}

}  // namespace moe
}  // namespace fastawq
