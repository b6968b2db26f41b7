// Thin wrappers over the PTX the kernels use (cp.async, mma.sync). sm_80 and newer.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastawq {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1, to a shared address (smem_addr); src_bytes = 0
// writes zeros (out-of-range rows). Loops that step a ring keep the converted address: converting
// a generic pointer each time costs an S2R and address arithmetic per copy.
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// The same copy through L1 (cp.async.ca): for data the block's other warps read too.
__device__ __forceinline__ void cp_async16_ca_at(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// Weights are read once per call: evict them first so activations and partials keep L2.
__device__ __forceinline__ void cp_async16_stream_at(uint32_t dst, const void* src, bool valid, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0), "l"(policy));
}
// The same two copies to a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16_at(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async16_stream(void* dst, const void* src, bool valid, uint64_t policy) {
  cp_async16_stream_at(smem_addr(dst), src, valid, policy);
}

// One 16-byte shared load (a plain uint4 read compiles to four 4-byte ones, each a 4-way bank
// conflict when lanes are 16 bytes apart).
__device__ __forceinline__ uint4 ld_shared128_at(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared128(const void* p) { return ld_shared128_at(smem_addr(p)); }
__device__ __forceinline__ void st_shared32_at(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared128_at(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// p[0..3] += v (p 16-byte aligned, in global memory): one 16-byte reduction on sm_90
// (red.global.add.v4.f32), four 4-byte atomics before.
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(p, v.x);
  atomicAdd(p + 1, v.y);
  atomicAdd(p + 2, v.z);
  atomicAdd(p + 3, v.w);
#endif
}

// v, in a register the compiler keeps: ptxas otherwise re-derives values such as a lane's shared
// address from %tid inside a hot loop (an S2R and a few integer ops per use) to save a register.
__device__ __forceinline__ uint32_t pinned(uint32_t v) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
  return v;
}

// (a & mask) | bits in one instruction. Written in C++ with both constants as immediates, it
// compiles to two LOP3s (a LOP3 takes one immediate); through the asm both sit in registers that
// the compiler hoists out of the loop. 0xEA is the truth table of (A & B) | C.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// The default priority as an explicit policy (for A/B switches against evict_first).
__device__ __forceinline__ uint64_t evict_normal_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Programmatic dependent launch (sm_90; no-ops on older GPUs and when a kernel was launched
// without it, common/pdl.cuh). pdl_wait: block until the grids this one depends on have completed
// and their writes are visible; nothing a previous kernel writes may be read (or anything written)
// before it. pdl_launch_dependents: let the next kernel in the stream launch now, so its blocks
// start (and run their own pre-wait part) while this one finishes.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A flag between blocks of one grid (sm_70 and newer): the writer's block meets at a barrier, then
// one thread adds with release semantics at GPU scope, which publishes every store of the block
// that happened before the barrier; the reader's one thread spins with acquire loads, then its
// block meets, so its other threads' reads (through L2: cp.async.cg, __ldcg) come after.
__device__ __forceinline__ void red_release_gpu(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Bring a line of read-only data (weights) into L2 without holding a register for it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// D[16x8] += A[16x16] (row) * B[16x8] (col), fp32 accumulators. The fp16 and bf16 instructions
// differ only in the PTX type of A and B (AB), which must be spliced into the asm string literal.
#define FASTAWQ_MMA_M16N8K16(AB)                                                                          \
  __device__ __forceinline__ static void run(float(&d)[4], const uint32_t(&a)[4], uint32_t b0,            \
                                             uint32_t b1) {                                               \
    asm volatile(                                                                                         \
        "mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
        "{%0,%1,%2,%3};\n"                                                                                \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                 \
  }

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  FASTAWQ_MMA_M16N8K16("f16")
};

template <>
struct Mma<__nv_bfloat16> {
  FASTAWQ_MMA_M16N8K16("bf16")
};

#undef FASTAWQ_MMA_M16N8K16

}  // namespace fastawq
