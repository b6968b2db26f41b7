// Host entries of the kernels on the repacked layout (csrc/gemv/awq_gemv_packed.h):
// fastawq::awq_gemv_packed (CUDA cores, M <= 8), fastawq::awq_mma_packed (tensor cores, batch as
// the mma's N, M <= 32) and fastawq::awq_gemm_packed (tensor cores, batch as the mma's M, any M).
// One validation (messages name the op, m, n, k, group_size) and one way to size grids: one wave.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/workspace.h"
#include "gemv/awq_gemv_packed.h"
#include "ops.h"

namespace fastawq {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 30;
// Resident warps per SM the warp-count plan (plan_split) aimed at before the one-wave plan, from
// ptxas's registers per M at sm_90a then (56 at M = 1, 95 at 2..3, ~128 at 4..5, ~165 at 6..7,
// ~190 at 8; 4-warp blocks); FASTAWQ_SPLIT_PLAN=warps still takes it.
constexpr int64_t kWarpsPerSm[kPackedMaxM + 1] = {32, 32, 20, 20, 16, 16, 12, 12, 8};
// The GEMV's many-wave target where one wave fills too few slots (plan_auto).
constexpr int64_t kFallbackWarpsPerSm = 32;

// The tensor-core kernel's tile when the caller leaves it to the kernel: 2 chunks. Session 5's sweep
// had 4 chunks ahead up to M = 4; with the one-wave grid 2 lead at every M (H200, RESULTS.md session
// 12, geomean x cuBLAS fp16 at M = 3 / 4: 1.78 / 1.74 against 1.67 / 1.62; 4 chunks still win on
// 4096 x 6144 alone, 10.4 against 11.1 us at M = 4, a shape-aware choice left open). The grid aims
// at the warps that fit on the SMs at once (the occupancy query), 8 per SM for 2 mma tiles.
int default_chunks(int64_t) { return 2; }
int64_t default_warps_per_sm(int tiles) { return tiles == 2 ? 8 : 0; }

// How awq_mma_packed stages its weights: in registers for one batch tile (M <= 8), through the
// shared-memory cp.async ring for two or more (H200, RESULTS.md session 10: 1.76 / 1.67 / 1.61 /
// 1.43x cuBLAS against 1.34 / 1.32 / 1.30 / 1.27x at M = 1 / 2 / 4 / 8; 0.95 against 1.03x at
// M = 16, where the registers of two tiles' accumulators leave too few warps). FASTAWQ_MMA_RING
// = regs or smem forces one, read once, for same-run A/B measurements.
bool mma_register_ring(int tiles) {
  static const int forced = [] {
    const char* v = std::getenv("FASTAWQ_MMA_RING");
    if (v == nullptr || *v == '\0') return -1;
    const std::string s = v;
    FASTAWQ_CHECK(s == "regs" || s == "smem", "FASTAWQ_MMA_RING must be regs or smem, got '", s, "'");
    return s == "regs" ? 1 : 0;
  }();
  return forced >= 0 ? forced == 1 : tiles == 1;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The checks of the weights, bias and problem for an input of m x k in `dtype` on `device`, the
// input's own layout checked by the caller; returns the bias pointer (nullptr without one).
const at::Tensor* check_weights(const char* op, int64_t m, int64_t k, at::ScalarType dtype, const at::Device& device,
                                const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n, int64_t g,
                                const std::optional<at::Tensor>& bias, int64_t max_m) {
  const auto problem = [&] { return cat("(m=", m, ", n=", n, ", k=", k, ", group_size=", g, ")"); };
  FASTAWQ_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": x must be fp16 or bf16, got ", dtype, " ",
                problem());
  FASTAWQ_CHECK(m >= 0 && m <= max_m, op, ": takes 1 <= M <= ", max_m, ", got ", problem());
  FASTAWQ_CHECK(n > 0 && n % 8 == 0 && n <= kMaxDim, op, ": n must be a positive multiple of 8 ", problem());
  FASTAWQ_CHECK(g > 0 && g % 32 == 0 && k % g == 0 && k % 32 == 0 && k <= kMaxDim, op,
                ": needs group_size a multiple of 32 and K a multiple of group_size ", problem());
  FASTAWQ_CHECK(wpacked.dim() == 2 && wpacked.scalar_type() == at::kInt && wpacked.size(0) * 8 == k &&
                    wpacked.size(1) == n,
                op, ": wpacked must be int32 [K/8=", k / 8, ", N=", n, "] from awq_gemv_repack, got ",
                wpacked.scalar_type(), " ", shape_str(wpacked), " ", problem());
  FASTAWQ_CHECK(szpacked.dim() == 2 && szpacked.scalar_type() == dtype && szpacked.size(0) == k / g &&
                    szpacked.size(1) == 2 * n,
                op, ": szpacked must be ", dtype, " [K/G=", k / g, ", 2N=", 2 * n, "] from awq_gemv_repack, got ",
                szpacked.scalar_type(), " ", shape_str(szpacked), " ", problem());
  FASTAWQ_CHECK(device.is_cuda() && wpacked.device() == device && szpacked.device() == device, op,
                ": x, wpacked and szpacked must be on one CUDA device, got ", device, ", ", wpacked.device(), ", ",
                szpacked.device());
  FASTAWQ_CHECK(wpacked.is_contiguous() && szpacked.is_contiguous() && aligned16(wpacked) && aligned16(szpacked), op,
                ": wpacked and szpacked must be contiguous and 16-byte aligned ", problem());
  if (!bias.has_value()) return nullptr;
  const at::Tensor* b = &bias.value();
  FASTAWQ_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == dtype && b->device() == device &&
                    b->is_contiguous(),
                op, ": bias must be a contiguous [N=", n, "] ", dtype, " tensor on ", device, ", got ", shape_str(*b),
                " ", b->scalar_type(), " on ", b->device());
  return b;
}

// The checks the ops on x [M, K] share; returns the bias pointer (nullptr without one).
const at::Tensor* check_packed(const char* op, const at::Tensor& x, const at::Tensor& wpacked,
                               const at::Tensor& szpacked, int64_t n, int64_t g, const std::optional<at::Tensor>& bias,
                               int64_t max_m) {
  FASTAWQ_CHECK(x.dim() == 2, op, ": x must be [M, K], got ", shape_str(x));
  const at::Tensor* b = check_weights(op, x.size(0), x.size(1), x.scalar_type(), x.device(), wpacked, szpacked, n, g,
                                      bias, max_m);
  FASTAWQ_CHECK(x.is_contiguous() && aligned16(x), op, ": x ", shape_str(x), " must be contiguous and 16-byte aligned");
  return b;
}

// The grid of both kernels: one column tile per blockIdx.x; K cut into contiguous warp ranges of at
// least two 32-row steps (so the next step's loads overlap the current one), 4 warps (ranges) per
// block, blockIdx.y over the remaining ranges.
struct SplitPlan {
  int col_tiles, splits, steps_per_warp;
};

// Ranges cut until the grid holds about want_warps warps (an explicit warps_per_sm, or the old plan).
SplitPlan plan_split(int64_t n, int64_t k, int64_t tile_cols, int64_t want_warps) {
  const int64_t col_tiles = (n + tile_cols - 1) / tile_cols;
  const int64_t steps = k / kPackedBatchRows;
  int64_t spw = (steps * col_tiles + want_warps - 1) / want_warps;
  spw = std::max<int64_t>(2, std::min(spw, steps));
  const int64_t ranges = (steps + spw - 1) / spw;
  return {static_cast<int>(col_tiles), static_cast<int>((ranges + 3) / 4), static_cast<int>(spw)};
}

// One wave: the shortest ranges (>= 2 steps) whose grid fits on the SMs at once (capacity blocks,
// from the occupancy query). The warp-count plan above rounds ranges up to whole blocks per column
// tile and ignores what fits, so a large layer's grid spilled into a second, mostly empty wave that
// ran at latency rather than bandwidth (4096 x 28672 at M = 1: 1,120 blocks for 792 slots).
SplitPlan plan_one_wave(int64_t n, int64_t k, int64_t tile_cols, int64_t capacity) {
  const int64_t col_tiles = (n + tile_cols - 1) / tile_cols;
  const int64_t steps = k / kPackedBatchRows;
  const int64_t max_splits = std::max<int64_t>(1, capacity / col_tiles);
  int64_t spw = (steps + 4 * max_splits - 1) / (4 * max_splits);
  spw = std::max<int64_t>(2, std::min(spw, steps));
  const int64_t ranges = (steps + spw - 1) / spw;
  return {static_cast<int>(col_tiles), static_cast<int>((ranges + 3) / 4), static_cast<int>(spw)};
}

// Which automatic plan: FASTAWQ_SPLIT_PLAN = wave (default) or warps (the plan before session 12,
// kept for same-run A/B measurements), read once.
bool one_wave_plan() {
  static const bool wave = [] {
    const char* v = std::getenv("FASTAWQ_SPLIT_PLAN");
    if (v == nullptr || *v == '\0') return true;
    const std::string s = v;
    FASTAWQ_CHECK(s == "wave" || s == "warps", "FASTAWQ_SPLIT_PLAN must be wave or warps, got '", s, "'");
    return s == "wave";
  }();
  return wave;
}

// The automatic plan for a kernel whose instance fits `resident` blocks on each of `sms` SMs.
// fallback_warps_per_sm > 0: where one wave would leave more than a quarter of the slots empty
// (few column tiles, so splits come in coarse steps) and ranges could still be cut shorter, take
// the warp-count plan at that target instead, several waves of short ranges (the GEMV at M = 2 on
// 4096 x 28672: 448 blocks for 660 slots read at 1,726 GB/s, 1,120 blocks at 2,082; H200,
// RESULTS.md session 12).
SplitPlan plan_auto(int64_t n, int64_t k, int64_t tile_cols, int sms, int resident, int64_t old_warps_per_sm,
                    int64_t fallback_warps_per_sm = 0) {
  if (!one_wave_plan()) return plan_split(n, k, tile_cols, sms * old_warps_per_sm);
  const int64_t capacity = int64_t(sms) * resident;
  const SplitPlan wave = plan_one_wave(n, k, tile_cols, capacity);
  const int64_t blocks = int64_t(wave.col_tiles) * wave.splits;
  if (fallback_warps_per_sm > 0 && wave.steps_per_warp > 2 && 4 * blocks < 3 * capacity) {
    return plan_split(n, k, tile_cols, sms * fallback_warps_per_sm);
  }
  return wave;
}

// The fields the kernels share, for the call's tensors and grid (the workspace when K is split,
// with a counter per column tile, or per `counter_tiles` tiles where M is cut into blocks too).
void fill_args(PackedArgs& a, const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked,
               const at::Tensor* b, at::Tensor& out, int64_t group_size, const SplitPlan& plan,
               int64_t counter_tiles = 0) {
  const int64_t m = x.size(0), n = out.size(1);
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr();
  a.w = reinterpret_cast<const uint32_t*>(wpacked.data_ptr<int>());
  a.sz = szpacked.data_ptr();
  a.bias = b != nullptr ? b->data_ptr() : nullptr;
  a.out = out.data_ptr();
  if (plan.splits > 1) {
    a.workspace = zeroed_sums(Workspace::kGemvSums, x.device(), m * n);
    a.counters = zeroed_counters(Workspace::kGemmTileCounters, x.device(),
                                 counter_tiles > 0 ? counter_tiles : plan.col_tiles);
  }
  a.m = static_cast<int>(m), a.n = static_cast<int>(n), a.k = static_cast<int>(x.size(1));
  a.group_size = static_cast<int>(group_size);
  a.col_tiles = plan.col_tiles, a.splits = plan.splits, a.steps_per_warp = plan.steps_per_warp;
  a.early_loads = early_weight_loads();  // read at each call (a graph: at capture)
  a.prefetch_batches = gemv_prefetch_batches(wpacked.numel() * 4);
}

// Steps a block of the tensor-core GEMMs takes (awq_gemm_packed, awq_wgmma_packed): a forced split
// count as given, else one wave: `slices` (column tile, row block) pairs times as many K splits as
// `resident` blocks an SM fit at once, each of at least min_steps steps; at most all of K.
int64_t gemm_steps_per_block(int64_t splits, int64_t steps, int64_t slices, int resident, int64_t min_steps) {
  int64_t want = splits;
  if (want == 0) {
    const int64_t capacity = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * resident;
    want = std::max<int64_t>(1, capacity / slices);
  }
  int64_t spb = (steps + want - 1) / want;
  if (splits == 0) spb = std::max<int64_t>(min_steps, spb);
  return std::min(spb, steps);
}

// The grid of a staged form (awq_gemv_packed_act / _norm: a.m and the form set, so the occupancy
// query sees its instance), checked to fit: each block stages M rows of its K range in shared memory.
SplitPlan staged_plan(const char* op, const GemvPackedArgs& a, int64_t n, int64_t k, const char* unfused) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const SplitPlan plan = plan_auto(n, k, kPackedTileCols, props->multiProcessorCount, gemv_packed_resident_blocks(a),
                                   kWarpsPerSm[a.m], kFallbackWarpsPerSm);
  const int64_t smem = a.m * std::min<int64_t>(4 * int64_t(plan.steps_per_warp) * kPackedBatchRows, k) * 2;
  FASTAWQ_CHECK(smem + 4096 <= props->sharedMemPerBlockOptin, op, ": the staged input (", smem, " bytes for m=", a.m,
                ", k=", k, ") does not fit a block's shared memory; use ", unfused, " and awq_gemv_packed");
  return plan;
}

}  // namespace

namespace {

// awq_wgmma_packed's warpgroups a block: FASTAWQ_WGMMA_WARPGROUPS = 1 or 2 (read at each call) forces
// one; unset, blocks of one warpgroup on 128 columns (several an SM) at the 32-token tile and two
// sharing x on 256 columns above. H100, RESULTS.md session 21 (geomean x cuBLAS fp16, same call):
// one warpgroup 1.25 / 0.86 / 0.35 / 0.41 against two 1.13 / 0.84 / 0.37 / 0.48 at M = 32 / 64 /
// 256 / 4096; at 64 tokens the two are within noise and two keep x's copy shared (unless the plan
// would leave the cluster with short K ranges: wgmma_call, session 40).
// The forced count, or 0 where unset (or anything but "1" / "2"): then wgmma_call chooses.
int wgmma_warpgroups_forced() {
  const char* v = std::getenv("FASTAWQ_WGMMA_WARPGROUPS");
  return v != nullptr && v[0] != '\0' && v[1] == '\0' && (v[0] == '1' || v[0] == '2') ? v[0] - '0' : 0;
}

// The K range below which a two-warpgroup plan of the 64-token tile that falls out of the cluster
// takes one warpgroup instead (wgmma_call): 16 steps (512 rows of K).
constexpr int64_t kWgmmaShortRange = 16;

// The most K splits a cluster of awq_wgmma_packed takes (the portable size). Session 39 (H100,
// gemm_table.py --ms 9,16,32, same call) measured sm_90's non-portable 16 for plans up to 24 splits:
// 1.58 / 1.58 / 1.18x cuBLAS against 1.88 / 1.76 / 1.47 at 8 (14336 x 4096 at M = 16 27.9 us against
// 20.2 through the workspace).
constexpr int64_t kWgmmaMaxCluster = 8;

// The largest automatic or forced split count the cluster reduction serves (capping it to 8): 12, or
// FASTAWQ_WGMMA_CLUSTER_PLAN = 2..64 (an A/B switch read at each call).
int64_t wgmma_cluster_max_plan() { return env_int("FASTAWQ_WGMMA_CLUSTER_PLAN", 2, 64, 12); }

// The fewest K steps a block of the automatic plan takes (FASTAWQ_WGMMA_MIN_STEPS, an A/B switch read
// at each call: 1 to 64, every form). Unset: 4 (the ring's depth less its two steps of lead), and 8 in
// the plain op's 16- and 32-token tiles. The one-wave plan cuts small layers into many short ranges
// (Qwen3-30B-A3B's QKV, 2048 x 5120 at 16 tokens: 40 column tiles x 16 splits of 4 steps), each adding
// a 16 x 128 fp32 tile into the workspace: as many bytes of reductions as the weights'. At 8 steps
// QKV's 8 splits meet in a cluster instead and o_proj's (4096 x 2048) 32 become 16 (session 43, H100,
// gemm_table.py, same call: those shapes 1.31 / 1.09 / 0.87 -> 1.48 / 1.42 / 1.03x cuBLAS fp16 at M =
// 9 / 16 / 32; of the Llama-3-8B shapes only 4096 x 4096 at M <= 16 changes, not yet measured under
// it: RESULTS.md session 43). The engine's sums form keeps 4: at 8
// Qwen3's batch 16 decoded 1.006x, at 16 0.981x (session 43), the Llama shape's 1.009x / 0.949x
// (session 38).
int64_t wgmma_min_steps(bool plain_small) {
  return env_int("FASTAWQ_WGMMA_MIN_STEPS", 1, 64, plain_small ? 8 : 4);
}

// FASTAWQ_WGMMA_FORM=ws, which the sums form takes only when forced (wgmma_call).
bool wgmma_ws_forced() {
  const char* v = std::getenv("FASTAWQ_WGMMA_FORM");
  return v != nullptr && std::strcmp(v, "ws") == 0;
}

// awq_wgmma_packed's form (read at each call): FASTAWQ_WGMMA_FORM=ws forces the warp-specialized one
// (awq_wgmma_packed_sm90.cu, session 22), any other value the plain one of session 21; unset, the
// warp-specialized form on the 128-token tile and the plain one below. H100, RESULTS.md session 27
// (geomean x cuBLAS fp16, same call): plain 1.55 / 1.20 / 0.84 / 0.38 / 0.48 against ws 1.29 / 1.10 /
// 0.87 / 0.41 / 0.52 at M = 16 / 32 / 64 / 256 / 4096. Session 39 (H100, gemm_table.py --kernels
// wgmma, same call): with its K splits meeting in a cluster the plain form takes the 64-token tile,
// 1.07 / 1.00 against ws 1.02 / 0.96 at M = 48 / 64 (plain through the workspace 1.02 / 0.90).
bool wgmma_ws_form(int64_t tokens) {
  const char* v = std::getenv("FASTAWQ_WGMMA_FORM");  // no allocation: it runs at every call
  return v == nullptr || v[0] == '\0' ? tokens >= 128 : std::strcmp(v, "ws") == 0;
}

// The sums tensor of awq_gemv_packed_sums / _act_sums: fp32 [M, N] on x's device, contiguous.
void check_sums(const char* op, const at::Tensor& sums, int64_t m, int64_t n, const c10::Device& device) {
  FASTAWQ_CHECK(sums.dim() == 2 && sums.size(0) == m && sums.size(1) == n && sums.scalar_type() == at::kFloat &&
                    sums.is_contiguous() && sums.device() == device,
                op, ": sums must be a contiguous fp32 [M=", m, ", N=", n, "] tensor on ", device, ", got ",
                sums.scalar_type(), " ", shape_str(sums), " on ", sums.device());
}

}  // namespace

at::Tensor awq_gemv_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, int64_t warps_per_sm) {
  const at::Tensor* b = check_packed("awq_gemv_packed", x, wpacked, szpacked, n, group_size, bias, kPackedMaxM);
  const int64_t m = x.size(0), k = x.size(1);
  FASTAWQ_CHECK(warps_per_sm >= 0 && warps_per_sm <= 64,
                "awq_gemv_packed: warps_per_sm must be in 1..64 (0: one wave of what fits), got ", warps_per_sm);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  GemvPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.m = static_cast<int>(m);
  const SplitPlan plan = warps_per_sm > 0
                             ? plan_split(n, k, kPackedTileCols, sms * warps_per_sm)
                             : plan_auto(n, k, kPackedTileCols, sms, gemv_packed_resident_blocks(a), kWarpsPerSm[m],
                                         kFallbackWarpsPerSm);
  fill_args(a, x, wpacked, szpacked, b, out, group_size, plan);
  launch_awq_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> awq_gemv_packed_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                         const at::Tensor& norm_weight, double eps, double offset,
                                                         const at::Tensor& wpacked, const at::Tensor& szpacked,
                                                         int64_t n, int64_t group_size,
                                                         const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "awq_gemv_packed_norm";
  const at::Tensor* b = check_packed(op, x, wpacked, szpacked, n, group_size, bias, kPackedActMaxM);
  const int64_t m = x.size(0), k = x.size(1);
  if (residual) {
    FASTAWQ_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                      residual->device() == x.device() && residual->is_contiguous() && aligned16(*residual),
                  op, ": residual must be a contiguous, aligned ", shape_str(x), " ", x.scalar_type(),
                  " tensor like x, got ", shape_str(*residual), " ", residual->scalar_type());
  }
  FASTAWQ_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.scalar_type() == x.scalar_type() &&
                    norm_weight.device() == x.device() && norm_weight.is_contiguous() && aligned16(norm_weight),
                op, ": norm_weight must be a contiguous, aligned [K=", k, "] ", x.scalar_type(), " tensor, got ",
                shape_str(norm_weight), " ", norm_weight.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor res_out = residual ? at::empty_like(x) : at::empty({0}, x.options());
  if (m == 0) return {out, res_out};
  FASTAWQ_CHECK(k > 0, op, ": K must be positive");
  GemvPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.m = static_cast<int>(m);
  a.norm_weight = norm_weight.data_ptr();
  const SplitPlan plan = staged_plan(op, a, n, k, "add_rms_norm");
  fill_args(a, x, wpacked, szpacked, b, out, group_size, plan);
  a.residual = residual ? residual->data_ptr() : nullptr;
  a.res_out = residual ? res_out.data_ptr() : nullptr;
  a.eps = static_cast<float>(eps);
  a.offset = static_cast<float>(offset);
  launch_awq_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, res_out};
}

namespace {

// awq_gemv_packed_act / _act_sums: gate_up [M, 2K] and act checked against the weights.
struct ActCall {
  int64_t m, k;
  int code;
  const at::Tensor* bias;
};
// f32_ok (_act_sums): gate_up may be fp32 sums, the activation dtype then szpacked's.
ActCall check_act_call(const char* op, const at::Tensor& gate_up, const at::Tensor& wpacked, const at::Tensor& szpacked,
                       int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias, const std::string& act,
                       bool f32_ok = false) {
  FASTAWQ_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": gate_up must be [M, 2K], got ",
                shape_str(gate_up));
  const int64_t m = gate_up.size(0), k = gate_up.size(1) / 2;
  const int code = act == "silu" ? 1 : act == "gelu_pytorch_tanh" ? 2 : act == "gelu" ? 3 : 0;
  FASTAWQ_CHECK(code > 0, op, ": act must be silu, gelu_pytorch_tanh or gelu, got '", act, "'");
  const bool f32 = f32_ok && gate_up.scalar_type() == at::kFloat;
  const at::Tensor* b = check_weights(op, m, k, f32 ? szpacked.scalar_type() : gate_up.scalar_type(),
                                      gate_up.device(), wpacked, szpacked, n, group_size, bias, kPackedActMaxM);
  FASTAWQ_CHECK(gate_up.is_contiguous() && aligned16(gate_up), op, ": gate_up ", shape_str(gate_up),
                " must be contiguous and 16-byte aligned");
  return {m, k, code, b};
}

// The act GEMV of a checked call (m, k > 0) into out, or (sums non-null) added into sums, for which
// out only gives N. The activation dtype is szpacked's (gate_up's, or fp32 sums with _act_sums).
void launch_act_call(const char* op, const ActCall& c, const at::Tensor& gate_up, const at::Tensor& wpacked,
                     const at::Tensor& szpacked, int64_t group_size, at::Tensor& out, float* sums) {
  const c10::cuda::CUDAGuard guard(gate_up.device());
  GemvPackedArgs a{};
  const HalfType dtype = szpacked.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.dtype = dtype;
  a.m = static_cast<int>(c.m);
  a.act = c.code;
  a.sums = sums;  // before the plan: its occupancy query sees the instance the launch runs
  const SplitPlan plan = staged_plan(op, a, out.size(1), c.k, "act_mul");
  fill_args(a, gate_up, wpacked, szpacked, c.bias, out, group_size, plan);
  a.dtype = dtype;  // fill_args reads it off gate_up, which may be fp32 sums
  a.x_f32 = gate_up.scalar_type() == at::kFloat;
  a.k = static_cast<int>(c.k);  // gate_up's rows are 2K wide; the GEMV's K is its half
  launch_awq_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor awq_gemv_packed_act(const at::Tensor& gate_up, const at::Tensor& wpacked, const at::Tensor& szpacked,
                               int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias,
                               const std::string& act) {
  constexpr const char* op = "awq_gemv_packed_act";
  const ActCall c = check_act_call(op, gate_up, wpacked, szpacked, n, group_size, bias, act);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out = at::empty({c.m, n}, gate_up.options());
  if (c.m == 0) return out;
  if (c.k == 0) return c.bias != nullptr ? out.copy_(c.bias->expand({c.m, n})) : out.zero_();
  launch_act_call(op, c, gate_up, wpacked, szpacked, group_size, out, nullptr);
  return out;
}

void awq_gemv_packed_sums(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                          int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& sums,
                          const std::optional<at::Tensor>& zero) {
  constexpr const char* op = "awq_gemv_packed_sums";
  const at::Tensor* b = check_packed(op, x, wpacked, szpacked, n, group_size, bias, kPackedActMaxM);
  const int64_t m = x.size(0), k = x.size(1);
  check_sums(op, sums, m, n, x.device());
  FASTAWQ_CHECK(k > 0, op, ": K must be positive");
  if (zero) {
    FASTAWQ_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->numel() % 4 == 0 &&
                      aligned16(*zero) && zero->device() == x.device(),
                  op, ": zero must be a contiguous, 16-byte aligned fp32 tensor of a multiple of 4 elements on ",
                  x.device(), ", got ", zero->scalar_type(), " ", shape_str(*zero), " on ", zero->device());
    // The launch zeroes it while it reads x and adds into sums: it may share memory with neither.
    const auto apart = [&](const at::Tensor& t) {
      const auto* z0 = static_cast<const char*>(zero->data_ptr());
      const auto* t0 = static_cast<const char*>(t.data_ptr());
      return z0 + zero->nbytes() <= t0 || t0 + t.nbytes() <= z0;
    };
    FASTAWQ_CHECK(apart(sums) && apart(x), op, ": zero ", shape_str(*zero), " overlaps sums ", shape_str(sums),
                  " or x ", shape_str(x));
  }
  if (m == 0) {
    if (zero) zero->zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  GemvPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.m = static_cast<int>(m);
  a.sums = sums.data_ptr<float>();  // before the plan: its occupancy query sees the sums instance
  const SplitPlan plan =
      plan_auto(n, k, kPackedTileCols, sms, gemv_packed_resident_blocks(a), kWarpsPerSm[m], kFallbackWarpsPerSm);
  fill_args(a, x, wpacked, szpacked, b, sums, group_size, plan);  // N from sums (its pointer as out: unused)
  if (zero) a.zero = zero->data_ptr<float>(), a.zero_len4 = zero->numel() / 4;
  launch_awq_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void awq_gemv_packed_act_sums(const at::Tensor& gate_up, const at::Tensor& wpacked, const at::Tensor& szpacked,
                              int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias,
                              const std::string& act, at::Tensor& sums) {
  constexpr const char* op = "awq_gemv_packed_act_sums";
  const ActCall c = check_act_call(op, gate_up, wpacked, szpacked, n, group_size, bias, act, /*f32_ok=*/true);
  check_sums(op, sums, c.m, n, gate_up.device());
  FASTAWQ_CHECK(c.k > 0, op, ": K must be positive");
  if (c.m == 0) return;
  launch_act_call(op, c, gate_up, wpacked, szpacked, group_size, sums, sums.data_ptr<float>());
}

at::Tensor awq_mma_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                          int64_t group_size, const std::optional<at::Tensor>& bias, int64_t chunks,
                          int64_t warps_per_sm) {
  const at::Tensor* b = check_packed("awq_mma_packed", x, wpacked, szpacked, n, group_size, bias, kMmaPackedMaxM);
  const int64_t m = x.size(0), k = x.size(1);
  const int rows = static_cast<int>(std::max<int64_t>(m, 1));  // the tile M = 0 would get
  if (chunks == 0) chunks = default_chunks(m);
  if (warps_per_sm == 0) warps_per_sm = default_warps_per_sm(mma_packed_tiles(rows));
  FASTAWQ_CHECK(mma_packed_chunks_ok(rows, static_cast<int>(chunks)),
                "awq_mma_packed: chunks must be 1, 2 or 4 (1 or 2 above M = 16), got ", chunks, " at m=", m);
  FASTAWQ_CHECK(warps_per_sm >= 0 && warps_per_sm <= 64,
                "awq_mma_packed: warps_per_sm must be in 1..64 (0: what fits), got ", warps_per_sm);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  MmaPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.m = static_cast<int>(m), a.chunks = static_cast<int>(chunks);
  a.register_ring = mma_register_ring(mma_packed_tiles(rows));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int resident = mma_packed_resident_blocks(a);
  const SplitPlan plan = warps_per_sm > 0 ? plan_split(n, k, 32 * chunks, sms * warps_per_sm)
                                          : plan_auto(n, k, 32 * chunks, sms, resident, 4 * resident);
  fill_args(a, x, wpacked, szpacked, b, out, group_size, plan);
  launch_awq_mma_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor awq_gemm_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, int64_t m_tiles, int64_t chunks,
                           int64_t splits) {
  const at::Tensor* b = check_packed("awq_gemm_packed", x, wpacked, szpacked, n, group_size, bias, kMaxDim);
  const int64_t m = x.size(0), k = x.size(1);
  // The kernel holds a lane's x row offsets (row * K) in 32 bits.
  FASTAWQ_CHECK(m * k < (int64_t{1} << 31), "awq_gemm_packed: needs M * K < 2^31, got (m=", m, ", n=", n, ", k=", k,
                ", group_size=", group_size, ")");
  if (m_tiles == 0) m_tiles = gemm_packed_m_tiles(m);
  if (chunks == 0) chunks = 1;
  FASTAWQ_CHECK(gemm_packed_tile_ok(static_cast<int>(m_tiles), static_cast<int>(chunks)),
                "awq_gemm_packed: m_tiles must be 1, 2 or 4 and chunks 1 or 2 (1 with 4 m-tiles), got m_tiles=",
                m_tiles, ", chunks=", chunks);
  FASTAWQ_CHECK(splits >= 0 && splits <= std::max<int64_t>(1, k / kPackedBatchRows),
                "awq_gemm_packed: splits must be in 1..K/32 (0: one wave), got ", splits, " at k=", k);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  GemmPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.m_tiles = static_cast<int>(m_tiles), a.chunks = static_cast<int>(chunks);
  const int64_t m_blocks = (m + 16 * m_tiles - 1) / (16 * m_tiles);
  a.m_blocks = static_cast<int>(m_blocks);
  // FASTAWQ_GEMM_STAGE_X=1: a block stages x for its whole K range, at most stage_steps steps, so
  // the automatic plan cuts K at least that fine (more than one wave where the column tiles alone
  // nearly fill the GPU); a forced split whose ranges are longer runs the ring form instead.
  const int64_t stage_steps = gemm_packed_stage_steps(a);
  a.stage_x = stage_steps > 0;
  // One wave: (column tile, M block) slices times K splits of >= 2 steps, as many as fit at once.
  const int64_t tile_cols = kPackedTileCols * chunks;
  const int64_t col_tiles = (n + tile_cols - 1) / tile_cols, steps = k / kPackedBatchRows;
  int64_t spb = gemm_steps_per_block(splits, steps, col_tiles * m_blocks,
                                     splits == 0 ? gemm_packed_resident_blocks(a) : 0, 2);
  if (a.stage_x && splits == 0) spb = std::min(spb, stage_steps);
  a.stage_x = a.stage_x && spb <= stage_steps;
  fill_args(a, x, wpacked, szpacked, b, out, group_size,
            {static_cast<int>(col_tiles), static_cast<int>((steps + spb - 1) / spb), static_cast<int>(spb)},
            col_tiles * m_blocks);
  launch_awq_gemm_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

#ifdef FASTAWQ_NO_AWQ_WGMMA_PACKED_SM90
// No listed arch reaches sm_90: CMake left the kernel's file out (awq_wgmma_packed_declines says so).
void launch_awq_wgmma_packed(const WgmmaPackedArgs&, cudaStream_t) {}
int wgmma_packed_resident_blocks(const WgmmaPackedArgs&) { return 1; }
#endif

std::string awq_wgmma_packed_declines() {
#if defined(FASTAWQ_HAVE_SM90A) && !defined(FASTAWQ_NO_AWQ_WGMMA_PACKED_SM90)
  constexpr bool built = true;
#else
  constexpr bool built = false;
#endif
  if (!built) {
    return "fastawq._C was not compiled for sm_90a (FASTAWQ_CUDA_ARCHS lacks 9.0a), which wgmma needs";
  }
  if (!at::cuda::is_available()) return "no CUDA device";
  const auto* props = at::cuda::getCurrentDeviceProperties();
  if (props->major != 9 || props->minor != 0) {
    return cat("awq_wgmma_packed runs on sm_90 (Hopper) only; this device is sm_", props->major, props->minor);
  }
  return "";
}

namespace {

// awq_wgmma_packed, or with `sums` (awq_wgmma_packed_sums) adding into those fp32
// sums: the output tensor (empty for sums).
at::Tensor wgmma_call(const char* op, const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked,
                      int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias, int64_t tokens,
                      int64_t splits, at::Tensor* sums) {
  const at::Tensor* b = check_packed(op, x, wpacked, szpacked, n, group_size, bias, kMaxDim);
  const int64_t m = x.size(0), k = x.size(1);
  if (sums != nullptr) {
    check_sums(op, *sums, m, n, x.device());
    FASTAWQ_CHECK(k > 0, op, ": K must be positive");
  }
  if (tokens == 0) tokens = wgmma_packed_tokens(m);
  FASTAWQ_CHECK(wgmma_packed_tokens_ok(tokens), op, ": tokens must be 16, 32, 64 or 128 (0: by M), got ", tokens);
  const int64_t steps = k / kPackedBatchRows;
  FASTAWQ_CHECK(splits >= 0 && splits <= std::max<int64_t>(1, steps), op,
                ": splits must be in 1..K/32 (0: one wave), got ", splits, " at k=", k);
  const c10::cuda::CUDAGuard guard(x.device());
  const std::string declines = awq_wgmma_packed_declines();
  FASTAWQ_CHECK(declines.empty(), op, ": ", declines);
  at::Tensor out = sums != nullptr ? at::Tensor() : at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (k == 0) return b != nullptr ? out.copy_(b->expand({m, n})) : out.zero_();

  WgmmaPackedArgs a{};
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.tokens = static_cast<int>(tokens);
  a.sums = sums != nullptr;
  // The sums form runs the plain kernel unless FASTAWQ_WGMMA_FORM=ws forces the warp-specialized one
  // (session 38, H100, Llama-3-8B shape, every projection adding into sums: decode at batch 48 / 64
  // 0.882x / 0.918x with ws against plain, bench_ab.py --compare env:FASTAWQ_WGMMA_FORM=plain,ws).
  a.ws = a.sums ? wgmma_ws_forced() : wgmma_ws_form(tokens);
  const int forced_wg = wgmma_warpgroups_forced();
  const int64_t token_tiles = (m + tokens - 1) / tokens;
  a.token_tiles = static_cast<int>(token_tiles);
  // One wave: (token tile, column tile) slices times K splits of >= 4 steps (the ring's depth less
  // its two steps of lead), as many as fit at once; planned: the splits that gives.
  int64_t col_tiles = 0, spb = 0, planned = 0;
  auto plan_for = [&](int warpgroups) {
    a.warpgroups = warpgroups;
    const int64_t tile_cols = wgmma_packed_tile_cols(warpgroups);
    col_tiles = (n + tile_cols - 1) / tile_cols;
    spb = gemm_steps_per_block(splits, steps, col_tiles * token_tiles,
                               splits == 0 ? wgmma_packed_resident_blocks(a) : 0,
                               wgmma_min_steps(!a.sums && tokens <= 32));
    planned = (steps + spb - 1) / spb;
  };
  plan_for(a.ws ? 2 : forced_wg != 0 ? forced_wg : tokens <= 32 ? 1 : 2);
  // The cluster reduction (FASTAWQ_WGMMA_CLUSTER, on unless "0"; read at each call): the plain op's
  // 16- to 64-token tiles meet their K splits in a cluster (at most 8) instead of the workspace, whose
  // fence and last block's conversion held ~25 % of the 16-token tile's stall samples at 4096 x 4096
  // (s45, H100). Session 38 (H100, every split count capped at 8): 14336 x 4096 at M = 16 19.9 -> 30.5
  // us (24 splits cut to 8: fewer blocks than the SMs hold), so it serves plans of at most
  // wgmma_cluster_max_plan() splits. Session 39 (H100, gemm_table.py --kernels wgmma, same call):
  // geomean x cuBLAS fp16 1.88 / 1.76 / 1.47 against 1.88 / 1.71 / 1.27 at M = 9 / 16 / 32 (4096 x
  // 28672 at 32: 41.8 against 61.4 us). The sums form (the engine's decode) keeps its adds: meeting in
  // clusters of 8 it decoded 0.951x / 0.945x at batch 16 / 32 (bench_ab.py, session 39). At 64 tokens
  // (the plain form since session 39) 1.07 / 1.00 against 1.02 / 0.90 at M = 48 / 64; the ws form's
  // splits in a cluster lost (0.74x against its workspace's 1.02 / 0.96; H100, session 39).
  const bool cluster_on = env_switch("FASTAWQ_WGMMA_CLUSTER") != 0;
  const int64_t max_plan = wgmma_cluster_max_plan();
  // The 64-token tile's two warpgroups (256 columns a block) leave few column tiles on narrow layers,
  // so the one-wave plan cuts K into many short ranges: 4096 x 4096 gives 16 tiles x 16 splits of 8
  // steps, past the cluster's 12, summed through the workspace. One warpgroup (128 columns) doubles
  // the tiles and halves the splits, which then meet in a cluster. So where the two-warpgroup plan
  // (automatic, the plain op, the cluster on) would exceed the cluster's plans with ranges shorter
  // than kWgmmaShortRange steps, the block takes one warpgroup. H100, session 40
  // (sweep_wgmma_splits.py, M = 48 / 64, us): 4096 x 4096 one warpgroup 17.5 / 17.6 against two's
  // 19.3 / 22.9; the shapes it leaves (4096 x 6144: 11 splits of 12 steps, in a cluster; 14336 x
  // 4096: 16 of 28; 4096 x 28672: 2 of 64) ran 22.6 / 22.5, 32.0 / 35.9, 63.0 / 64.8 with two against
  // 27.7 / 27.3, 42.9 / 44.4, 75.2 / 76.6 with one; the table's M = 48 / 56 / 64 1.08 / 1.03 / 1.00 ->
  // 1.09 / 1.07 / 1.07x cuBLAS fp16. The engine's sums form (no cluster) keeps two warpgroups: one on
  // every layer decoded 0.89x at batch 48 / 64, and the rule alone there (only o_proj's 4096 x 4096
  // qualifies) 0.996x / 1.001x / 1.004x at batch 40 / 48 / 64 (session 41). FASTAWQ_WGMMA_ONE_WG=0 (read
  // at each call) keeps two; FASTAWQ_WGMMA_WARPGROUPS forces a count.
  const bool one_wg = env_int("FASTAWQ_WGMMA_ONE_WG", 0, 1, 1) == 1;
  if (!a.ws && !a.sums && a.warpgroups == 2 && splits == 0 && planned > max_plan && spb < kWgmmaShortRange &&
      forced_wg == 0 && one_wg && cluster_on) {
    plan_for(1);
  }
  if (!a.sums && !a.ws && tokens <= 64 && planned > 1 && planned <= max_plan && cluster_on) {
    // Capped to 8: still 2 or more splits (planned > 1 needs steps >= 2, and 8 ranges of >= 1 step).
    spb = std::max<int64_t>(spb, (steps + kWgmmaMaxCluster - 1) / kWgmmaMaxCluster);
    a.cluster = true;
  }
  const SplitPlan plan{static_cast<int>(col_tiles), static_cast<int>((steps + spb - 1) / spb), static_cast<int>(spb)};
  if (a.sums) {
    // No workspace or counters of ours: the blocks add into the caller's sums and end.
    fill_args(a, x, wpacked, szpacked, b, *sums, group_size, SplitPlan{plan.col_tiles, 1, plan.steps_per_warp});
    a.splits = plan.splits;
    a.workspace = sums->data_ptr<float>();
    a.out = nullptr;
  } else {
    fill_args(a, x, wpacked, szpacked, b, out, group_size, plan, col_tiles * token_tiles);
  }
  launch_awq_wgmma_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

at::Tensor awq_wgmma_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                            int64_t group_size, const std::optional<at::Tensor>& bias, int64_t tokens, int64_t splits) {
  return wgmma_call("awq_wgmma_packed", x, wpacked, szpacked, n, group_size, bias, tokens, splits, nullptr);
}

void awq_wgmma_packed_sums(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& sums, int64_t tokens,
                           int64_t splits) {
  wgmma_call("awq_wgmma_packed_sums", x, wpacked, szpacked, n, group_size, bias, tokens, splits, &sums);
}

}  // namespace fastawq
