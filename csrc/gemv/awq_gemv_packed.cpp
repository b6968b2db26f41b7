// Host entry of fastawq::awq_gemv_packed: validation (messages name m, n, k, group_size) and the
// grid of the decode kernel on the repacked layout (csrc/gemv/awq_gemv_packed.h).
#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/workspace.h"
#include "gemv/awq_gemv_packed.h"
#include "ops.h"

namespace fastawq {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 30;
// Resident warps per SM the grid aims at, from ptxas's registers per M at sm_90a (56 at M = 1,
// 95 at 2..3, ~128 at 4..5, ~165 at 6..7, ~190 at 8; 4-warp blocks).
constexpr int64_t kWarpsPerSm[kPackedMaxM + 1] = {32, 32, 20, 20, 16, 16, 12, 12, 8};

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

at::Tensor awq_gemv_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias) {
  FASTAWQ_CHECK(x.dim() == 2, "awq_gemv_packed: x must be [M, K], got ", shape_str(x));
  const int64_t m = x.size(0), k = x.size(1), g = group_size;
  const auto problem = [&] { return cat("(m=", m, ", n=", n, ", k=", k, ", group_size=", g, ")"); };
  FASTAWQ_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
                "awq_gemv_packed: x must be fp16 or bf16, got ", x.scalar_type(), " ", problem());
  FASTAWQ_CHECK(m >= 0 && m <= kPackedMaxM, "awq_gemv_packed: takes 1 <= M <= ", kPackedMaxM, ", got ", problem());
  FASTAWQ_CHECK(n > 0 && n % 8 == 0 && n <= kMaxDim, "awq_gemv_packed: n must be a positive multiple of 8 ", problem());
  FASTAWQ_CHECK(g > 0 && g % 32 == 0 && k % g == 0 && k % 32 == 0 && k <= kMaxDim,
                "awq_gemv_packed: needs group_size a multiple of 32 and K a multiple of group_size ", problem());
  FASTAWQ_CHECK(wpacked.dim() == 2 && wpacked.scalar_type() == at::kInt && wpacked.size(0) * 8 == k &&
                    wpacked.size(1) == n,
                "awq_gemv_packed: wpacked must be int32 [K/8=", k / 8, ", N=", n, "] from awq_gemv_repack, got ",
                wpacked.scalar_type(), " ", shape_str(wpacked), " ", problem());
  FASTAWQ_CHECK(szpacked.dim() == 2 && szpacked.scalar_type() == x.scalar_type() && szpacked.size(0) == k / g &&
                    szpacked.size(1) == 2 * n,
                "awq_gemv_packed: szpacked must be ", x.scalar_type(), " [K/G=", k / g, ", 2N=", 2 * n,
                "] from awq_gemv_repack, got ", szpacked.scalar_type(), " ", shape_str(szpacked), " ", problem());
  FASTAWQ_CHECK(x.is_cuda() && wpacked.device() == x.device() && szpacked.device() == x.device(),
                "awq_gemv_packed: x, wpacked and szpacked must be on one CUDA device, got ", x.device(), ", ",
                wpacked.device(), ", ", szpacked.device());
  FASTAWQ_CHECK(x.is_contiguous() && wpacked.is_contiguous() && szpacked.is_contiguous(),
                "awq_gemv_packed: x ", shape_str(x), ", wpacked and szpacked must be contiguous ", problem());
  FASTAWQ_CHECK(aligned16(x) && aligned16(wpacked) && aligned16(szpacked),
                "awq_gemv_packed: x, wpacked and szpacked must be 16-byte aligned ", problem());
  const at::Tensor* b = nullptr;
  if (bias.has_value()) {
    b = &bias.value();
    FASTAWQ_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == x.scalar_type() &&
                      b->device() == x.device() && b->is_contiguous(),
                  "awq_gemv_packed: bias must be a contiguous [N=", n, "] ", x.scalar_type(), " tensor on ",
                  x.device(), ", got ", shape_str(*b), " ", b->scalar_type(), " on ", b->device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  // Grid: one 128-column tile per blockIdx.x; K cut into contiguous warp ranges of at least two
  // 32-row batches (so the next batch's loads overlap the current one) until the grid is about one wave.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int col_tiles = static_cast<int>((n + kPackedTileCols - 1) / kPackedTileCols);
  const int64_t batches = k / kPackedBatchRows;
  const int64_t want_warps = sms * kWarpsPerSm[m];
  int64_t bpw = (batches * col_tiles + want_warps - 1) / want_warps;
  bpw = std::max<int64_t>(2, std::min(bpw, batches));
  const int64_t ranges = (batches + bpw - 1) / bpw;
  const int splits = static_cast<int>((ranges + 3) / 4);

  GemvPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr();
  a.w = reinterpret_cast<const uint32_t*>(wpacked.data_ptr<int>());
  a.sz = szpacked.data_ptr();
  a.bias = b != nullptr ? b->data_ptr() : nullptr;
  a.out = out.data_ptr();
  if (splits > 1) {
    a.workspace = zeroed_sums(Workspace::kGemvSums, x.device(), m * n);
    a.counters = zeroed_counters(Workspace::kGemmTileCounters, x.device(), col_tiles);
  }
  a.m = static_cast<int>(m), a.n = static_cast<int>(n), a.k = static_cast<int>(k), a.group_size = static_cast<int>(g);
  a.col_tiles = col_tiles, a.splits = splits, a.batches_per_warp = static_cast<int>(bpw);
  launch_awq_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace fastawq
