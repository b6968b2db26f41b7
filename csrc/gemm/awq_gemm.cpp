// Host entry of fastawq::awq_gemm: validation, the named kernel, its grid. Which kernel wins at
// which M is measured in benchmarks/RESULTS.md; python/fastawq/backend.py owns the GEMV threshold,
// this file only the one between the tensor-core kernel and dequantize + cuBLAS ("auto").
#include <algorithm>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/launch.h"
#include "common/workspace.h"
#include "ops.h"

namespace fastawq {
namespace {

// Largest M that "auto" gives the tensor-core kernel; above it dequantize + cuBLAS wins on the
// H200 (benchmarks/RESULTS.md, benchmarks/CUDA_NOTES.md).
constexpr int64_t kMmaAutoMaxM = 32;
// K or N above which the kernels' int32 indices could overflow.
constexpr int64_t kMaxDim = int64_t{1} << 30;

enum class Kernel { kGemv, kGemvStaged, kMma, kDequantCublas };

bool parse_kernel(const std::string& name, Kernel& out) {
  static constexpr std::pair<const char*, Kernel> kNames[] = {
      {"gemv", Kernel::kGemv}, {"gemv_staged", Kernel::kGemvStaged}, {"mma", Kernel::kMma},
      {"dequant_cublas", Kernel::kDequantCublas}};
  for (const auto& [n, kn] : kNames) {
    if (name == n) {
      out = kn;
      return true;
    }
  }
  return false;
}

bool mma_compiled() {
#ifdef FASTAWQ_NO_AWQ_GEMM_MMA_SM80
  return false;
#else
  return true;
#endif
}

// The fit rules of each kernel, shapes only ("" = it takes the problem).
std::string declines(Kernel kernel, int64_t m, int64_t n, int64_t k, int64_t g) {
  if (m < 0 || n < 0 || k < 0 || g <= 0) return "sizes must be non-negative and group_size positive";
  if (k % g != 0) return "K is not a multiple of group_size";
  if (n % 8 != 0) return "N is not a multiple of 8 (one packed int32 word holds 8 columns)";
  switch (kernel) {
    case Kernel::kGemv:
    case Kernel::kGemvStaged:
      if (m > kGemvMaxM) return cat("the GEMV kernels take M <= ", kGemvMaxM);
      if (k % 32 != 0 || g % 32 != 0) return "the GEMV kernels need K and group_size multiples of 32";
      if ((n / 8) % kGemvWordsPerLane != 0)
        return cat("the GEMV kernels need N/8 a multiple of ", kGemvWordsPerLane, " (N % ", 8 * kGemvWordsPerLane,
                   " == 0)");
      if (k > kMaxDim || n > kMaxDim) return "K or N above 2^30";
      return "";
    case Kernel::kMma: {
      if (!mma_compiled()) return "the tensor-core kernel was not compiled (no CUDA arch >= 8.0 in the build)";
      if (n % 32 != 0) return "the tensor-core kernel needs N % 32 == 0";
      if (k % kMmaBlockK != 0 || g % kMmaBlockK != 0)
        return cat("the tensor-core kernel needs K and group_size multiples of ", kMmaBlockK);
      if (k > kMaxDim || n > kMaxDim) return "K or N above 2^30";
      // The device is asked last: the shape rules above hold without a GPU.
      if (at::cuda::is_available() && at::cuda::getCurrentDeviceProperties()->major < 8)
        return "the tensor-core kernel needs sm_80 or newer";
      return "";
    }
    case Kernel::kDequantCublas:
      return "";
  }
  return "unknown kernel";
}

// The operands every kernel's argument struct carries.
template <typename Args>
void bind_operands(Args& a, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& qzeros, const at::Tensor* bias, at::Tensor& out) {
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr();
  a.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int>());
  a.scales = scales.data_ptr();
  a.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int>());
  a.bias = bias != nullptr ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
}

// GEMV grid: gemv_split (launch.h) at the register kernel's occupancy.
void run_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
              int64_t g, const at::Tensor* bias, at::Tensor& out, bool staged) {
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n = static_cast<int>(out.size(1));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int col_tiles = (n + kGemvTileCols - 1) / kGemvTileCols;
  // Resident warps per SM at the register kernel's occupancy (M=1: 127 registers, M=2: ~230).
  const auto [chunk_rows, cpb, splits] = gemv_split(col_tiles, k, sms, m == 1 ? 16 : 8);

  GemvArgs a{};
  bind_operands(a, x, qweight, scales, qzeros, bias, out);
  if (splits > 1) {
    a.workspace = zeroed_sums(Workspace::kGemvSums, x.device(), int64_t(m) * n);
    a.counters = zeroed_counters(Workspace::kGemmTileCounters, x.device(), col_tiles);
  }
  a.m = m, a.n = n, a.k = k, a.group_size = static_cast<int>(g);
  a.col_tiles = col_tiles, a.splits = splits, a.chunk_rows = chunk_rows, a.chunks_per_block = cpb;
  a.staged = staged;
  launch_awq_gemv(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_mma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
             int64_t g, const at::Tensor* bias, at::Tensor& out) {
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1)), n = static_cast<int>(out.size(1));
  const int kt_total = k / kMmaBlockK;
  const int col_blocks = (n + kMmaBlockN - 1) / kMmaBlockN;
  const int bm = mma_block_m(m);
  const int m_blocks = (m + bm - 1) / bm;
  // More concurrent blocks hide the kernel's per-block latency chain until the split-K reduction
  // and pipeline fill dominate: 16 splits at M <= 16, 8 above, at least 4 K tiles each, doubled
  // while the grid has fewer than 2 blocks per SM (benchmarks/CUDA_NOTES.md, split sweep).
  int splits = std::min(m <= 16 ? 16 : 8, std::max(1, kt_total / 4));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  while (splits * 2 <= kt_total / 4 && col_blocks * m_blocks * splits < sms * 2) splits *= 2;
  splits = std::max(1, std::min(splits, kt_total));
  const int tiles_per_split = (kt_total + splits - 1) / splits;
  splits = (kt_total + tiles_per_split - 1) / tiles_per_split;  // no empty split

  MmaArgs a{};
  at::Tensor ws;
  if (splits > 1) {
    ws = at::empty({splits, m, n}, x.options().dtype(at::kFloat));
    a.workspace = ws.data_ptr<float>();
    a.counters = zeroed_counters(Workspace::kGemmTileCounters, x.device(), int64_t(col_blocks) * m_blocks);
  }
  bind_operands(a, x, qweight, scales, qzeros, bias, out);
  a.m = m, a.n = n, a.k = k, a.group_size = static_cast<int>(g);
  a.splits = splits, a.tiles_per_split = tiles_per_split;
  launch_awq_gemm_mma(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

std::string awq_gemm_declines(const std::string& kernel, int64_t m, int64_t n, int64_t k, int64_t group_size) {
  if (kernel == "auto") return "";  // auto always has dequantize + cuBLAS to fall back on
  Kernel kn;
  if (!parse_kernel(kernel, kn)) return cat("unknown kernel '", kernel, "' (auto, gemv, gemv_staged, mma, dequant_cublas)");
  return declines(kn, m, n, k, group_size);
}

at::Tensor awq_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                    const std::string& kernel) {
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
  const at::Tensor* b = nullptr;
  if (bias.has_value()) {
    b = &bias.value();
    FASTAWQ_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == x.scalar_type() &&
                      b->device() == x.device() && b->is_contiguous(),
                  "awq_gemm: bias must be a contiguous [N=", n, "] ", x.scalar_type(), " tensor on ", x.device(),
                  ", got ", shape_str(*b), " ", b->scalar_type(), " on ", b->device());
  }
  const auto problem = [&] { return cat("(m=", m, ", n=", n, ", k=", k, ", group_size=", g, ")"); };
  const bool is_auto = kernel == "auto";
  Kernel kn = Kernel::kDequantCublas;
  FASTAWQ_CHECK(is_auto || parse_kernel(kernel, kn), "awq_gemm: unknown kernel '", kernel, "' ", problem(),
                "; expected auto, gemv, gemv_staged, mma or dequant_cublas");
  const c10::cuda::CUDAGuard guard(x.device());
  // The GEMV and tensor-core kernels read every operand with 16-byte loads.
  const bool aligned = aligned16(x) && aligned16(qweight) && aligned16(scales) && aligned16(qzeros);
  if (is_auto) {
    kn = (m <= kMmaAutoMaxM && aligned && declines(Kernel::kMma, m, n, k, g).empty()) ? Kernel::kMma
                                                                                       : Kernel::kDequantCublas;
  } else {
    const std::string why = declines(kn, m, n, k, g);
    FASTAWQ_CHECK(why.empty(), "awq_gemm: kernel '", kernel, "' declines the problem ", problem(), ": ", why);
    FASTAWQ_CHECK(kn == Kernel::kDequantCublas || aligned, "awq_gemm: kernel '", kernel, "' declines the problem ",
                  problem(), ": x, qweight, scales and qzeros must be 16-byte aligned");
  }

  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();
  switch (kn) {
    case Kernel::kGemv:
    case Kernel::kGemvStaged:
      run_gemv(x, qweight, scales, qzeros, g, b, out, kn == Kernel::kGemvStaged);
      return out;
    case Kernel::kMma:
      run_mma(x, qweight, scales, qzeros, g, b, out);
      return out;
    case Kernel::kDequantCublas:
      break;
  }
  at::Tensor w = at::empty({k, n}, x.options());
  awq_dequantize_into(qweight, scales, qzeros, g, w);
  if (b != nullptr) return at::addmm_out(out, *b, x, w);
  return at::mm_out(out, x, w);
}

}  // namespace fastawq
