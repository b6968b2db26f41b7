// l2_prefetch: bring parts of some tensors into L2 while the GPU's DRAM would sit idle (sm_90).
//
// A batch-1 decode step spends ~560 of its ~2,400 us (Llama-3-8B shape, H100, session 33) in
// kernels that move almost no bytes (add + RMSNorm, the decode attention, argmax): DRAM idles
// there. Launched after the QKV projection, this kernel asks L2 for a fraction of the MLP's weights
// (one `cp.async.bulk.prefetch.L2` per 64 KB: a few hundred instructions), so that the gate/up and
// down GEMVs read that fraction from L2 while the rest streams from DRAM. The weights' own loads
// carry an evict-first policy (awq_gemv_packed.cu), so the stream that passes through L2 before
// them leaves normal-priority lines alone.
//
// Which rows: a tensor is rows of its first dimension (the packed layout's row is 8 k-rows of every
// column, 4 N bytes), row r is brought in when r % period < hot, so every warp's K range of the GEMV
// finds the same share of its rows in L2 (a prefix would warm only the blocks of the first K split).
//
// Ordering (PDL): the kernel lets the next kernel launch at once, then waits for the previous one to
// complete before it issues anything: its prefetches do not compete with that kernel's reads, and
// the next kernel's own wait (which waits for this grid) still orders it after the previous one.
// The prefetches are hints: the grid completes once they are issued, and nothing reads their result.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/ptx.cuh"
#include "ops.h"

namespace fastawq {
namespace {

constexpr int kMaxTensors = 8;
constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 * 1024;  // bytes a prefetch instruction

struct PrefetchList {
  const char* base[kMaxTensors];
  int64_t row_bytes[kMaxTensors];
  int64_t rows[kMaxTensors];
  int hot[kMaxTensors];
  int period[kMaxTensors];
  int count;
};

__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// One grid of a few blocks: work item i of tensor j is (row, chunk) with the row among the hot ones.
__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const PrefetchList list) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (int j = 0; j < list.count; ++j) {
    const int64_t row_bytes = list.row_bytes[j];
    const int64_t chunks = (row_bytes + kChunk - 1) / kChunk;
    const int hot = list.hot[j], period = list.period[j];
    // Hot rows in order: hot of every period (the last period may be short).
    const int64_t full = list.rows[j] / period, rest = list.rows[j] % period;
    const int64_t hot_rows = full * hot + (rest < hot ? rest : hot);
    const int64_t items = hot_rows * chunks;
    for (int64_t i = first; i < items; i += stride) {
      const int64_t h = i / chunks, c = i % chunks;
      const int64_t row = (h / hot) * period + h % hot;
      const int64_t off = c * kChunk;
      const uint32_t bytes = static_cast<uint32_t>(row_bytes - off < kChunk ? row_bytes - off : kChunk);
      prefetch_l2_bulk(list.base[j] + row * row_bytes + off, bytes);
    }
  }
}

}  // namespace

void l2_prefetch(const std::vector<at::Tensor>& tensors, c10::IntArrayRef hot, c10::IntArrayRef period) {
  const char* op = "l2_prefetch";
  FASTAWQ_CHECK(hot.size() == tensors.size() && period.size() == tensors.size(), op,
                ": hot and period need one entry a tensor, got ", hot.size(), " and ", period.size(), " for ",
                tensors.size(), " tensors");
  FASTAWQ_CHECK(tensors.size() <= kMaxTensors, op, ": at most ", kMaxTensors, " tensors a call, got ",
                tensors.size());
  if (tensors.empty()) return;
  PrefetchList list{};
  const c10::Device device = tensors[0].device();
  for (size_t j = 0; j < tensors.size(); ++j) {
    const at::Tensor& t = tensors[j];
    FASTAWQ_CHECK(t.is_cuda() && t.device() == device, op, ": tensor ", j, " is on ", t.device(), ", expected ",
                  device);
    FASTAWQ_CHECK(t.is_contiguous() && t.dim() >= 1, op, ": tensor ", j, " must be contiguous with a row dimension, got ",
                  t.sizes(), " strides ", t.strides());
    FASTAWQ_CHECK(period[j] >= 1 && hot[j] >= 0 && hot[j] <= period[j], op, ": tensor ", j,
                  " needs 0 <= hot <= period and period >= 1, got hot ", hot[j], ", period ", period[j]);
    const int64_t rows = t.size(0);
    const int64_t row_bytes = rows > 0 ? t.numel() / rows * t.element_size() : 0;
    FASTAWQ_CHECK(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": tensor ", j,
                  " needs 16-byte rows at a 16-byte aligned address (a bulk prefetch's unit), got rows of ",
                  row_bytes, " bytes");
    list.base[list.count] = static_cast<const char*>(t.data_ptr());
    list.row_bytes[list.count] = row_bytes;
    list.rows[list.count] = rows;
    list.hot[list.count] = static_cast<int>(hot[j]);
    list.period[list.count] = static_cast<int>(period[j]);
    if (rows > 0 && row_bytes > 0 && hot[j] > 0) ++list.count;
  }
  const c10::cuda::CUDAGuard guard(device);
  // The bulk prefetch is sm_90's; elsewhere (and with nothing to fetch) the call does nothing.
  if (list.count == 0 || at::cuda::getCurrentDeviceProperties()->major < 9) return;
  launch_pdl(l2_prefetch_kernel, dim3(4), dim3(kThreads), 0, at::cuda::getCurrentCUDAStream(), list);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fastawq
