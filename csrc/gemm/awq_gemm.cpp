// Host entry of fastawq::awq_gemm: validation, then the path by M (crossovers in
// benchmarks/CUDA_NOTES.md): the tensor-core kernel while weight bytes dominate, dequantize +
// cuBLAS once the product is compute-bound.
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/launch.h"
#include "ops.h"

namespace fastawq {
namespace {

// Largest M served by the CUDA-core GEMV: H200, 2026-11-30 (benchmarks/RESULTS.md), geomean vs
// cuBLAS over the Llama-3-8B shapes at M = 1/2/4/8: GEMV 1.82/1.13/0.80/0.48, tensor-core kernel
// with 128-row stages (path 5) 0.99/0.96/0.92/0.85.
constexpr int64_t kGemvAutoMaxM = 2;
// Which GEMV serves each M (same run, commit fc0adda): at M=1 the register kernel (path 6, 1.81x)
// beats the cp.async-staged one (path 8, 1.63x) on all four shapes; at M=2 the staged one wins
// (1.40x vs 1.28x), its accumulators no longer competing with in-flight loads for registers.
inline int64_t gemv_auto_path(int64_t m) { return m == 1 ? 6 : 8; }
// Largest M served by the tensor-core kernel (path 5); above it dequantize + cuBLAS wins on the
// H200 (CUDA_NOTES.md: at M=64 the kernel's best was 0.31x cuBLAS against 0.40x). Paths 1-5
// passed tests/test_cuda_ops.py on the H200 at commit 4325f6f.
constexpr int64_t kMmaMaxM = 32;
// Warps side by side in N (4: 128-column tiles, 8: 256-column tiles).
constexpr int kMmaWarpsN = 4;

bool mma_fits(int64_t k, int64_t n, int64_t g) {
#ifdef FASTAWQ_NO_AWQ_GEMM_MMA_SM80
  return false;
#else
  const auto* props = at::cuda::getCurrentDeviceProperties();
  return props->major >= 8 && n % 32 == 0 && k % kMmaBlockK == 0 && g % kMmaBlockK == 0;
#endif
}

// Zeroed buffers per device (split-K tile counters, the GEMV's fp32 sums), grown on demand; the
// kernels leave what they use zeroed again. Outgrown buffers are kept alive: a captured CUDA graph
// still points at the one it saw. Concurrent split-K launches on different streams of one device
// must not share them: see notes.
at::Tensor& zeroed_buffer(std::vector<at::Tensor>* per_device, const at::Device& device, int64_t needed,
                          int64_t minimum, at::ScalarType dtype) {
  auto& bufs = per_device[device.index()];
  if (bufs.empty() || bufs.back().numel() < needed) {
    bufs.push_back(at::zeros({std::max(needed, minimum)}, at::TensorOptions().dtype(dtype).device(device)));
  }
  return bufs.back();
}

int* tile_counters(const at::Device& device, int64_t needed) {
  static std::vector<at::Tensor> buffers[64];
  return zeroed_buffer(buffers, device, needed, 4096, at::kInt).data_ptr<int>();
}

float* zeroed_workspace(const at::Device& device, int64_t needed) {
  static std::vector<at::Tensor> buffers[64];
  return zeroed_buffer(buffers, device, needed, int64_t{1} << 16, at::kFloat).data_ptr<float>();
}

bool gemv_fits(int64_t m, int64_t k, int64_t n, int64_t g) {
  return m >= 1 && m <= kGemvMaxM && k % 32 == 0 && g % 32 == 0 && (n / 8) % gemv_words_per_lane(static_cast<int>(m)) == 0 &&
         k <= (int64_t{1} << 30) && n <= (int64_t{1} << 30);
}

// Grid of the GEMV: enough warp items (chunk_rows rows x one column tile) to fill the SMs at the
// kernel's occupancy (M=1: 127 registers, 16 warps per SM; M >= 2: ~230, 8), 4 warps per block,
// and K split over blocks until the grid is about one wave. The H200 sweep of 2026-11-30 (forced
// splits 1..32, CUDA_NOTES.md) put the best split within 10 % of this choice on every Llama shape.
void run_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
              int64_t g, const at::Tensor* bias, at::Tensor& out, int64_t split_k, bool pipelined, int stages) {
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n = static_cast<int>(out.size(1));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int tile_cols = gemv_tile_cols(m);
  const int col_tiles = (n + tile_cols - 1) / tile_cols;
  const int warps_per_sm = m == 1 ? 16 : 8;
  const int64_t want_warps = int64_t(sms) * warps_per_sm;
  int chunk_rows = 128;
  while (chunk_rows > 32 && int64_t(col_tiles) * ((k + chunk_rows - 1) / chunk_rows) < want_warps) chunk_rows /= 2;
  const int total = (k + chunk_rows - 1) / chunk_rows;
  int cpb;
  if (split_k > 0) {
    cpb = static_cast<int>((total + split_k - 1) / split_k);
  } else {
    const int64_t items = int64_t(col_tiles) * total;
    const int64_t blocks = want_warps / 4;
    cpb = static_cast<int>((items + blocks - 1) / blocks);
    cpb = std::max(4, (cpb + 3) / 4 * 4);
  }
  cpb = std::max(1, std::min(cpb, total));
  const int splits = (total + cpb - 1) / cpb;

  GemvArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr();
  a.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int>());
  a.scales = scales.data_ptr();
  a.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int>());
  a.bias = bias != nullptr ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  if (splits > 1) {
    a.workspace = zeroed_workspace(x.device(), int64_t(m) * n);
    a.counters = tile_counters(x.device(), col_tiles);
  }
  a.m = m, a.n = n, a.k = k, a.group_size = static_cast<int>(g);
  a.col_tiles = col_tiles, a.splits = splits, a.chunk_rows = chunk_rows, a.chunks_per_block = cpb;
  a.pipelined = pipelined;
  a.stages = stages;
  launch_awq_gemv(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_mma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
             int64_t g, const at::Tensor* bias, at::Tensor& out, int64_t split_k, int warps_n, bool tiled,
             int ksub) {
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n = static_cast<int>(out.size(1));
  const int kt_total = k / kMmaBlockK;
  const int block_n = warps_n * 32;
  const int col_blocks = (n + block_n - 1) / block_n;
  const int bm = mma_block_m(m);
  const int m_blocks = (m + bm - 1) / bm;
  int splits = static_cast<int>(split_k);
  if (splits <= 0) {
    // Measured on the H200 (CUDA_NOTES.md, bench of 2026-11-30): 16 splits were best or within
    // noise of best at M <= 16 for all four Llama-3-8B shapes, 4-16 at M = 32; at least 4 K tiles
    // (128 rows) per split. A per-block latency chain, not bandwidth, limits the kernel, so more
    // concurrent blocks help until the split-K reduction and the pipeline fill dominate.
    splits = std::min(m <= 16 ? 16 : 8, std::max(1, kt_total / 4));
    // Small problems (few column blocks) still want ~4 blocks per SM.
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    while (splits * 2 <= kt_total / 4 && col_blocks * m_blocks * splits < sms * 2) splits *= 2;
  }
  splits = std::max(1, std::min(splits, kt_total));
  const int tiles_per_split = (kt_total + splits - 1) / splits;
  splits = (kt_total + tiles_per_split - 1) / tiles_per_split;  // no empty split

  MmaArgs a{};
  at::Tensor ws;
  if (splits > 1) {
    ws = at::empty({splits, m, n}, x.options().dtype(at::kFloat));
    a.workspace = ws.data_ptr<float>();
    a.counters = tile_counters(x.device(), int64_t(col_blocks) * m_blocks);
  }
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr();
  a.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int>());
  a.scales = scales.data_ptr();
  a.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int>());
  a.bias = bias != nullptr ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.m = m, a.n = n, a.k = k, a.group_size = static_cast<int>(g);
  a.splits = splits, a.tiles_per_split = tiles_per_split;
  a.warps_n = warps_n;
  a.tiled = tiled;
  a.ksub = ksub;
  launch_awq_gemm_mma(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor gemm_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                     int64_t path, int64_t split_k, bool tiled = false) {
  int64_t k, n, g;
  check_awq_weight("awq_gemm", qweight, scales, qzeros, group_size, k, n, g);
  FASTAWQ_CHECK(x.dim() == 2 && x.size(1) == k, "awq_gemm: x must be [M, K=", k, "] to match qweight ",
              shape_str(qweight), ", got x ", shape_str(x));
  const int64_t m = x.size(0);
  FASTAWQ_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "awq_gemm: x must be fp16 or bf16, got ", x.scalar_type(), " (x ", shape_str(x), ")");
  FASTAWQ_CHECK(scales.scalar_type() == x.scalar_type(), "awq_gemm: scales must have x's dtype ", x.scalar_type(),
              ", got ", scales.scalar_type(), " (problem m=", m, ", n=", n, ", k=", k, ")");
  FASTAWQ_CHECK(x.device() == qweight.device(), "awq_gemm: x is on ", x.device(), " but qweight is on ",
              qweight.device());
  FASTAWQ_CHECK(x.is_contiguous(), "awq_gemm: x ", shape_str(x), " must be contiguous");
  // The tensor-core kernel reads every operand with 16-byte cp.async.
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(scales.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(qzeros.data_ptr()) % 16 == 0;
  const at::Tensor* b = nullptr;
  if (bias.has_value()) {
    b = &bias.value();
    FASTAWQ_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == x.scalar_type() &&
                    b->device() == x.device() && b->is_contiguous(),
                "awq_gemm: bias must be a contiguous [N=", n, "] ", x.scalar_type(), " tensor on ", x.device(),
                ", got ", shape_str(*b), " ", b->scalar_type(), " on ", b->device());
  }
  FASTAWQ_CHECK(path >= 0 && path <= 9, "awq_gemm_config: path must be 0 (auto), 1 (tensor-core kernel), ",
                "2 (dequantize + cuBLAS), 3 (tensor-core kernel, 4 warps), 4 (tensor-core kernel, 8 warps), ",
                "5 (tensor-core kernel, 4 warps, 128-row stages), 6 (CUDA-core GEMV, M <= 8), ",
                "7 (CUDA-core GEMV with prefetch), 8 or 9 (CUDA-core GEMV through 3 or 4 cp.async stages, M <= 2)");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  const bool gemv_ok = !tiled && gemv_fits(m, k, n, g) && aligned;
  if (path == 0 && gemv_ok && m <= kGemvAutoMaxM) path = gemv_auto_path(m);
  if (path == 8 || path == 9) {
    FASTAWQ_CHECK(gemv_ok && m <= 2 && (n / 8) % 4 == 0, "awq_gemm: the staged GEMV kernel needs 1 <= M <= 2, K % 32, ",
                  "group_size % 32 == 0, N % 32 == 0 and 16-byte aligned operands (problem m=", m, ", n=", n, ", k=", k,
                  ", group_size=", g, ")");
    run_gemv(x, qweight, scales, qzeros, g, b, out, split_k, false, path == 8 ? 3 : 4);
    return out;
  }
  if (path == 6 || path == 7) {
    FASTAWQ_CHECK(gemv_ok, "awq_gemm: the GEMV kernel needs 1 <= M <= ", kGemvMaxM, ", K % 32, group_size % 32 == 0, ",
                  "N/8 a multiple of ", gemv_words_per_lane(static_cast<int>(std::min<int64_t>(std::max<int64_t>(m, 1), kGemvMaxM))),
                  " and 16-byte aligned operands (problem m=", m, ", n=", n, ", k=", k, ", group_size=", g, ")");
    run_gemv(x, qweight, scales, qzeros, g, b, out, split_k, path == 7, 0);
    return out;
  }
  const bool fits = mma_fits(k, n, g) && aligned;
  if (path == 0) path = (fits && m <= kMmaMaxM) ? 5 : 2;
  FASTAWQ_CHECK(path == 2 || fits, "awq_gemm: the tensor-core kernel needs sm_80+, N % 32, K % 32, group_size % 32 "
              "== 0 and 16-byte aligned operands (problem m=", m, ", n=", n, ", k=", k, ", group_size=", g, ")");
  if (path != 2) {
    const int warps_n = (tiled || path == 3 || path == 5) ? 4 : (path == 4 ? 8 : kMmaWarpsN);
    run_mma(x, qweight, scales, qzeros, g, b, out, split_k, warps_n, tiled, path == 5 ? 4 : 1);
    return out;
  }
  at::Tensor w = at::empty({k, n}, x.options());
  awq_dequantize_into(qweight, scales, qzeros, g, w);
  if (b != nullptr) return at::addmm_out(out, *b, x, w);
  return at::mm_out(out, x, w);
}

}  // namespace

// x [M, K] · qweight [K, N/8] int32 · scales [K/G, N] · qzeros [K/G, N/8] int32 · bias [N] -> [M, N]
at::Tensor awq_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  return gemm_impl(x, qweight, scales, qzeros, group_size, bias, 0, 0);
}

// qweight [K, N/8] int32 -> [N/128, K/32, 32, 16] int32: every (128-column, 32-row) tile of the
// tensor-core kernel becomes one contiguous 2 KB block. A pure permutation, so it is exact.
at::Tensor awq_repack_tiled(const at::Tensor& qweight) {
  FASTAWQ_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kInt, "awq_repack_tiled: qweight must be 2-D int32 ",
                "[K, N/8], got ", shape_str(qweight), " ", qweight.scalar_type());
  const int64_t k = qweight.size(0), n8 = qweight.size(1);
  FASTAWQ_CHECK(k % kMmaBlockK == 0 && n8 % 16 == 0, "awq_repack_tiled: needs K % 32 == 0 and N % 128 == 0, got K=", k,
                ", N=", n8 * 8, " (qweight ", shape_str(qweight), ")");
  // clone, not contiguous(): with N = 128 the permuted view is already contiguous, and the result
  // must never alias the input (opcheck caught it).
  return qweight.reshape({k / kMmaBlockK, kMmaBlockK, n8 / 16, 16}).permute({2, 0, 1, 3}).clone(at::MemoryFormat::Contiguous);
}

// x [M, K] · qweight_tiled [N/128, K/32, 32, 16] (awq_repack_tiled) · scales [K/G, N] · qzeros [K/G, N/8] -> [M, N]
at::Tensor awq_gemm_tiled(const at::Tensor& x, const at::Tensor& qweight_tiled, const at::Tensor& scales,
                          const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                          int64_t split_k) {
  const at::Tensor& qt = qweight_tiled;
  FASTAWQ_CHECK(qt.dim() == 4 && qt.size(2) == kMmaBlockK && qt.size(3) == 16 && qt.scalar_type() == at::kInt &&
                    qt.is_contiguous(),
                "awq_gemm_tiled: qweight_tiled must be a contiguous int32 [N/128, K/32, 32, 16] from awq_repack_tiled, "
                "got ", shape_str(qt), " ", qt.scalar_type());
  // The logical [K, N/8] view only carries the sizes into the shared checks.
  const at::Tensor logical = qt.view({qt.size(1) * kMmaBlockK, qt.size(0) * 16});
  return gemm_impl(x, logical, scales, qzeros, group_size, bias, 1, split_k, /*tiled=*/true);
}

at::Tensor awq_gemm_config(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                           int64_t path, int64_t split_k) {
  return gemm_impl(x, qweight, scales, qzeros, group_size, bias, path, split_k);
}

}  // namespace fastawq
