// Host entries of fastawq::moe_gemv_w4 (the CUDA-core kernels of moe_gemv.cu) and moe_mma_w4 (the
// tensor-core ones of moe_mma.cu): one validation, whose messages name every shape involved, and
// each family's grids. Which one runs for how many tokens is python/fastawq/backend.py's rule; the
// shape rules are moe_gemv_w4_declines, here, for both.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/launch.h"
#include "common/workspace.h"
#include "gemv/awq_gemv_packed.h"
#include "ops.h"

namespace fastawq {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 30;

int act_code(const std::string& act) {
  if (act == "silu") return 0;
  if (act == "gelu") return 1;
  if (act == "gelu_tanh") return 2;
  return -1;
}

std::string weights_str(const at::Tensor& q13, const at::Tensor& s13, const at::Tensor& z13, const at::Tensor& q2,
                        const at::Tensor& s2, const at::Tensor& z2) {
  return cat("w13_qweight ", shape_str(q13), ", w13_scales ", shape_str(s13), ", w13_qzeros ", shape_str(z13),
             ", w2_qweight ", shape_str(q2), ", w2_scales ", shape_str(s2), ", w2_qzeros ", shape_str(z2));
}

}  // namespace

std::string moe_gemv_w4_declines(int64_t num_experts, int64_t hidden, int64_t inter, int64_t group_size) {
  if (num_experts <= 0 || hidden <= 0 || inter <= 0) return "E, H and I must be positive";
  if (hidden > kMaxDim || inter > kMaxDim) return "H or I above 2^30";
  const int64_t g13 = group_size == -1 ? hidden : group_size, g2 = group_size == -1 ? inter : group_size;
  if (g13 <= 0 || g2 <= 0) return "group_size must be positive or -1";
  if (hidden % 32 || inter % 32) return cat("the MoE GEMV needs H and I multiples of 32, got H=", hidden, ", I=", inter);
  if (g13 % 32 || g2 % 32 || hidden % g13 || inter % g2)
    return cat("the MoE GEMV needs group_size a multiple of 32 dividing H=", hidden, " and I=", inter, ", got ",
               group_size);
  return "";
}

namespace {

// A validated call: the shared kernel arguments filled, out and h allocated (n == 0: out zeroed).
struct MoeCall {
  at::Tensor out, hbuf;
  int64_t t, h, i, e, n;
};

// packed: the experts in the packed layout (gemv/awq_gemv_packed.h): w13_qweight is w13_wpacked
// [E, H/8, 2I], w13_scales w13_szpacked [E, H/G, 4I], w2 likewise ([E, I/8, H], [E, I/G, 2H]), and
// both qzeros are undefined.
MoeCall prepare(const char* op, MoeArgs& a, const at::Tensor& x, const at::Tensor& topk_ids,
                const at::Tensor& topk_weights, const at::Tensor& w13_qweight, const at::Tensor& w13_scales,
                const at::Tensor& w13_qzeros, const at::Tensor& w2_qweight, const at::Tensor& w2_scales,
                const at::Tensor& w2_qzeros, int64_t group_size, const std::string& act, bool packed = false) {
  const auto shapes = [&] {
    return cat("x ", shape_str(x), ", topk_ids ", shape_str(topk_ids), ", ",
               packed ? cat("w13_wpacked ", shape_str(w13_qweight), ", w13_szpacked ", shape_str(w13_scales),
                            ", w2_wpacked ", shape_str(w2_qweight), ", w2_szpacked ", shape_str(w2_scales))
                      : weights_str(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros));
  };
  FASTAWQ_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, H] with unit column stride; ", shapes());
  FASTAWQ_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
                ": x must be fp16 or bf16, got ", x.scalar_type());
  const at::Tensor* weights[] = {&w13_qweight, &w13_scales, &w13_qzeros, &w2_qweight, &w2_scales, &w2_qzeros};
  for (const at::Tensor* w : weights) {
    if (packed && (w == &w13_qzeros || w == &w2_qzeros)) continue;
    FASTAWQ_CHECK(w->dim() == 3 && w->is_contiguous() && w->device() == x.device(), op,
                  ": stacked expert weights must be contiguous 3-D tensors on ", x.device(), "; ", shapes());
  }
  FASTAWQ_CHECK(w13_qweight.scalar_type() == at::kInt && w2_qweight.scalar_type() == at::kInt &&
                    (packed || (w13_qzeros.scalar_type() == at::kInt && w2_qzeros.scalar_type() == at::kInt)),
                op, packed ? ": wpacked must be int32; " : ": qweight and qzeros must be int32; ", shapes());
  FASTAWQ_CHECK(w13_scales.scalar_type() == x.scalar_type() && w2_scales.scalar_type() == x.scalar_type(), op,
                ": scales must have x's dtype ", x.scalar_type(), ", got ", w13_scales.scalar_type(), " and ",
                w2_scales.scalar_type());
  const int64_t e = w13_qweight.size(0), h = x.size(1), t = x.size(0);
  const int64_t i = packed ? w2_qweight.size(1) * 8 : w2_qweight.size(1);
  const std::string why = moe_gemv_w4_declines(e, h, i, group_size);
  FASTAWQ_CHECK(why.empty(), op, ": ", why, "; ", shapes());
  const int64_t g13 = group_size == -1 ? h : group_size, g2 = group_size == -1 ? i : group_size;
  const bool consistent =
      packed ? w13_qweight.sizes() == c10::IntArrayRef{e, h / 8, 2 * i} &&
                   w13_scales.sizes() == c10::IntArrayRef{e, h / g13, 4 * i} &&
                   w2_qweight.sizes() == c10::IntArrayRef{e, i / 8, h} && w2_scales.sizes() == c10::IntArrayRef{e, i / g2, 2 * h}
             : w13_qweight.sizes() == c10::IntArrayRef{e, h, 2 * i / 8} &&
                   w13_scales.sizes() == c10::IntArrayRef{e, h / g13, 2 * i} &&
                   w13_qzeros.sizes() == c10::IntArrayRef{e, h / g13, 2 * i / 8} &&
                   w2_qweight.sizes() == c10::IntArrayRef{e, i, h / 8} && w2_scales.sizes() == c10::IntArrayRef{e, i / g2, h} &&
                   w2_qzeros.sizes() == c10::IntArrayRef{e, i / g2, h / 8};
  FASTAWQ_CHECK(consistent, op, ": inconsistent MoE weights for E=", e, ", H=", h, ", I=", i,
                ", group_size=", group_size, "; ", shapes());
  FASTAWQ_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == t && topk_ids.is_contiguous() &&
                    (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong) &&
                    topk_ids.device() == x.device(),
                op, ": topk_ids must be contiguous int32/int64 [T=", t, ", k] on ", x.device(), ", got ",
                topk_ids.scalar_type(), " ", shape_str(topk_ids));
  FASTAWQ_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                    topk_weights.is_contiguous() && topk_weights.device() == x.device(),
                op, ": topk_weights must be contiguous fp32 shaped like topk_ids ", shape_str(topk_ids), ", got ",
                topk_weights.scalar_type(), " ", shape_str(topk_weights));
  for (const at::Tensor* w : {&w13_qweight, &w13_scales, &w2_qweight, &w2_scales}) {
    FASTAWQ_CHECK(reinterpret_cast<uintptr_t>(w->data_ptr()) % 16 == 0, op,
                  ": qweight and scales must be 16-byte aligned (a view at an odd offset?); ", shapes());
  }
  const int code = act_code(act);
  FASTAWQ_CHECK(code >= 0, op, ": act must be silu, gelu or gelu_tanh, got ", act);
  const int64_t topk = topk_ids.size(1), n = t * topk;
  FASTAWQ_CHECK(n < 65536, op, ": T * k = ", n, " assignments exceed the grid (65535); ", shapes());

  MoeCall call{at::empty({t, h}, x.options()), at::Tensor(), t, h, i, e, n};
  if (n == 0) {
    call.out.zero_();
    return call;
  }
  call.hbuf = at::empty({n, i}, x.options());
  a.dtype = x.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x = x.data_ptr(), a.x_stride = x.stride(0);
  a.ids = topk_ids.data_ptr(), a.ids_int64 = topk_ids.scalar_type() == at::kLong;
  a.topk_weights = topk_weights.data_ptr<float>();
  a.w13_qweight = reinterpret_cast<const uint32_t*>(w13_qweight.data_ptr<int>());
  a.w13_scales = w13_scales.data_ptr();
  a.w13_qzeros = packed ? nullptr : reinterpret_cast<const uint32_t*>(w13_qzeros.data_ptr<int>());
  a.w2_qweight = reinterpret_cast<const uint32_t*>(w2_qweight.data_ptr<int>());
  a.w2_scales = w2_scales.data_ptr();
  a.w2_qzeros = packed ? nullptr : reinterpret_cast<const uint32_t*>(w2_qzeros.data_ptr<int>());
  a.h = call.hbuf.data_ptr(), a.out = call.out.data_ptr();
  a.n_assign = static_cast<int>(n), a.topk = static_cast<int>(topk), a.num_experts = static_cast<int>(e);
  a.hidden = static_cast<int>(h), a.inter = static_cast<int>(i);
  a.group13 = static_cast<int>(g13), a.group2 = static_cast<int>(g2), a.act = code;
  return call;
}

// One fp32 buffer and one counter buffer, carved per call (the kernels leave them zeroed): ws13
// [n, 2I] when w13 splits K, ws2 [T, H]; counters13 (n13 of them), then counters2 [T, tiles2], then
// `extra` more (returned).
int* carve_workspace(MoeArgs& a, const MoeCall& c, const c10::Device& device, bool split13, int64_t n13,
                     int64_t tiles2, int64_t extra = 0) {
  const int64_t sums13 = split13 ? c.n * 2 * c.i : 0;
  float* sums = zeroed_sums(Workspace::kMoeSums, device, sums13 + c.t * c.h);
  a.ws13 = sums, a.ws2 = sums + sums13;
  int* counters = zeroed_counters(Workspace::kMoeCounters, device, n13 + c.t * tiles2 + extra);
  a.counters13 = counters, a.counters2 = counters + n13;
  return counters + n13 + c.t * tiles2;
}

// Work items of moe_mma's persistent form at most: the blocks of both grids over all block rows.
int64_t persistent_items(const MoeMmaArgs& a) {
  return int64_t(a.rows) * (int64_t(a.tiles13) * a.splits13 + int64_t(a.tiles2) * a.splits2);
}

// K splits and 32-row steps per warp for `blocks` block rows of tiles over k rows: about as many
// blocks as fit on every SM (per_sm, moe_mma_blocks_per_sm), at least two steps per warp.
void mma_split(int64_t blocks, int64_t k, int sms, int per_sm, int& splits, int& steps) {
  const int64_t total = k / 32;
  int64_t sp = (int64_t(sms) * per_sm + blocks - 1) / blocks;
  sp = std::max<int64_t>(1, std::min(sp, total / 8));
  steps = static_cast<int>((total + sp * 4 - 1) / (sp * 4));
  splits = static_cast<int>((total + int64_t(steps) * 4 - 1) / (int64_t(steps) * 4));
}

// The wide w2 (MoeMmaArgs::w2_wide): one warp a tile over a split's whole K range, so `blocks`
// blocks of 4 warps; splits of K only while whole waves of them stay at most one (a second, part-full
// wave would leave most of the GPU idle at its end), each at least 8 steps. (Rounded to the nearest
// count instead, 2 splits at Qwen3-30B-A3B batch 16: 0.995x the tile form's decode, H100, session 32.)
void wide_split(int64_t blocks, int64_t k, int sms, int per_sm, int& splits, int& steps) {
  const int64_t total = k / 32, b = std::max<int64_t>(blocks, 1), slots = int64_t(sms) * per_sm;
  const int64_t sp = std::max<int64_t>(1, std::min(total / 8, slots / b));
  steps = static_cast<int>((total + sp - 1) / sp);
  splits = static_cast<int>((total + steps - 1) / steps);
}

// The distinct experts n uniformly routed assignments reach on average, E (1 - (1 - 1/E)^n), rounded
// up: the block rows that do work (the grid has min(E, n) + 1; the rest exit at once).
int64_t expected_experts(int64_t e, int64_t n) {
  const double de = static_cast<double>(e);
  const double d = de * (1.0 - std::pow(1.0 - 1.0 / de, static_cast<double>(n)));
  return std::min<int64_t>(std::min(e, n), static_cast<int64_t>(std::ceil(d - 1e-9)));
}

}  // namespace

namespace {

// The CUDA-core kernels' fp32 buffers: a.h_part [splits13, T * k, 2I] when `part` (w13's split sums
// for w2), a.out_sums [T, H] when `sums` (undefined tensors otherwise). The caller holds them until
// the launches are enqueued (freed earlier, the allocator could hand their memory to the next one).
struct SumsBuffers {
  at::Tensor h_part, out_sums;
};
SumsBuffers sums_buffers(MoeGemvArgs& a, const MoeCall& c, const at::Tensor& x, bool part, bool sums) {
  SumsBuffers b;
  if (part) b.h_part = at::empty({a.splits13, c.n, 2 * c.i}, x.options().dtype(at::kFloat));
  if (sums) b.out_sums = at::empty({c.t, c.h}, x.options().dtype(at::kFloat));
  a.h_part = part ? b.h_part.data_ptr<float>() : nullptr;
  a.out_sums = sums ? b.out_sums.data_ptr<float>() : nullptr;
  return b;
}

// moe_gemv_w4 and moe_gemv_w4_sums: `sums` asks for the fp32 weighted sum [T, H] (the ring form
// writes it; any other form's converted output is widened).
at::Tensor moe_gemv_call(const char* op, bool sums, const at::Tensor& x, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, const at::Tensor& w13_qweight, const at::Tensor& w13_scales,
                         const at::Tensor& w13_qzeros, const at::Tensor& w2_qweight, const at::Tensor& w2_scales,
                         const at::Tensor& w2_qzeros, int64_t group_size, const std::string& act) {
  MoeGemvArgs a{};
  const c10::cuda::CUDAGuard guard(x.device());
  MoeCall c = prepare(op, a, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight,
                      w2_scales, w2_qzeros, group_size, act);
  if (c.n == 0) return sums ? c.out.to(at::kFloat) : c.out;
  const int64_t n = c.n, h = c.h, i = c.i;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // w13 tiles: 128 gate + 128 up columns; w2 tiles: 256 columns. The grid of each fills the SMs
  // over all assignments' tiles together (M = 1 occupancy, as the dense GEMV).
  a.tiles13 = static_cast<int>((i / 8 + 4 * kGemvWordsPerLane - 1) / (4 * kGemvWordsPerLane));
  a.tiles2 = static_cast<int>((h + kGemvTileCols - 1) / kGemvTileCols);
  const GemvSplit s13 = gemv_split(int64_t(a.tiles13) * n, static_cast<int>(h), sms, 16);
  const GemvSplit s2 = gemv_split(int64_t(a.tiles2) * n, static_cast<int>(i), sms, 16);
  a.chunk13 = s13.chunk_rows, a.cpb13 = s13.chunks_per_block, a.splits13 = s13.splits;
  a.chunk2 = s2.chunk_rows, a.cpb2 = s2.chunks_per_block, a.splits2 = s2.splits;
  a.early_loads = early_weight_loads();  // read at each call (a graph: at capture)
  // FASTAWQ_MOE_H_PARTIALS (on unless "0", read at each call): at one token a split w13 hands its
  // split sums to w2 (moe_gemv.cu). H100, session 22: Qwen3-30B-A3B decode 427.8 -> 449.1 tok/s at
  // batch 1 (RESULTS.md). The ring form, which one token takes, reads them; the others
  // keep the zeroed workspace, carved either way.
  const bool part =
      c.t == 1 && a.splits13 > 1 && moe_h_part_fits(a) && env_switch("FASTAWQ_MOE_H_PARTIALS") != 0;
  const SumsBuffers bufs = sums_buffers(a, c, x, part, sums);
  carve_workspace(a, c, x.device(), a.splits13 > 1, n * a.tiles13, a.tiles2);
  const bool wrote_sums = launch_moe_gemv(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!sums) return c.out;
  return wrote_sums ? bufs.out_sums : c.out.to(at::kFloat);
}

}  // namespace

at::Tensor moe_gemv_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                       const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                       int64_t group_size, const std::string& act) {
  return moe_gemv_call("moe_gemv_w4", false, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros,
                       w2_qweight, w2_scales, w2_qzeros, group_size, act);
}

at::Tensor moe_gemv_w4_sums(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                            const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                            int64_t group_size, const std::string& act) {
  return moe_gemv_call("moe_gemv_w4_sums", true, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros,
                       w2_qweight, w2_scales, w2_qzeros, group_size, act);
}

namespace {

// 32-row batches of K a warp for `base` blocks (column tiles x assignments) over k rows: K split so
// that about sms * kMoePackedBlocksPerSm blocks run, a warp at least two batches (unless K is
// short) and at most kMoePackedMaxBatches.
// H100, session 29 (RESULTS.md), us at T = 1 / 2 with 2 / 4 / 8 / 16 blocks an SM: Qwen3-30B-A3B
// 17.6 / 16.9 / 18.6 / 18.4 and 23.9 / 22.2 / 24.2 / 24.9, Mixtral-8x7B 80.7 / 77.8 / 83.8 / 79.7
// and 147.5 / 130.8 / 138.5 / 141.1. FASTAWQ_MOE_PACKED_BPS=n (read at each call; a measuring
// knob): n blocks an SM instead.
constexpr int kMoePackedBlocksPerSm = 4;
void packed_split(int64_t base, int64_t k, int sms, int& splits, int& bpw) {
  const int64_t total = k / 32;
  const char* bps_env = std::getenv("FASTAWQ_MOE_PACKED_BPS");
  const int bps = bps_env != nullptr && std::atoi(bps_env) > 0 ? std::atoi(bps_env) : kMoePackedBlocksPerSm;
  const int64_t sp = std::max<int64_t>(1, std::min<int64_t>((int64_t(sms) * bps + base - 1) / base, total / 8));
  int64_t per = (total + sp * 4 - 1) / (sp * 4);
  per = std::min<int64_t>(per, kMoePackedMaxBatches);
  bpw = static_cast<int>(per);
  splits = static_cast<int>((total + per * 4 - 1) / (per * 4));
}

// moe_gemv_packed_w4 and moe_gemv_packed_w4_sums (sums: the fp32 weighted sum [T, H]).
at::Tensor moe_gemv_packed_call(const char* op, bool sums, const at::Tensor& x, const at::Tensor& topk_ids,
                                const at::Tensor& topk_weights, const at::Tensor& w13_wpacked,
                                const at::Tensor& w13_szpacked, const at::Tensor& w2_wpacked,
                                const at::Tensor& w2_szpacked, int64_t group_size, const std::string& act) {
  MoeGemvArgs a{};
  const c10::cuda::CUDAGuard guard(x.device());
  MoeCall c = prepare(op, a, x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, at::Tensor(), w2_wpacked,
                      w2_szpacked, at::Tensor(), group_size, act, true);
  // The kernels read x (and h) in 16-byte pieces.
  FASTAWQ_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, op,
                ": x must be 16-byte aligned with a row stride a multiple of 8, got x ", shape_str(x),
                " with strides (", x.stride(0), ", ", x.stride(1), ")");
  if (c.n == 0) return sums ? c.out.to(at::kFloat) : c.out;
  const int64_t n = c.n, h = c.h, i = c.i;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.tiles13 = static_cast<int>((i + kPackedTileCols / 2 - 1) / (kPackedTileCols / 2));
  a.tiles2 = static_cast<int>((h + kPackedTileCols - 1) / kPackedTileCols);
  packed_split(int64_t(a.tiles13) * n, h, sms, a.splits13, a.bpw13);
  // (Session 30's FASTAWQ_MOE_PACKED_W2_ONE, w2 in one batch a warp, lost once w2 loaded its first
  // scales before its PDL wait: RESULTS.md session 31. Removed.)
  packed_split(int64_t(a.tiles2) * n, i, sms, a.splits2, a.bpw2);
  a.packed_fp32 = env_switch("FASTAWQ_MOE_PACKED_H2") == 0;
  const SumsBuffers bufs = sums_buffers(a, c, x, a.splits13 > 1, sums);
  carve_workspace(a, c, x.device(), false, 0, a.tiles2);
  launch_moe_gemv_packed(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sums ? bufs.out_sums : c.out;
}

}  // namespace

at::Tensor moe_gemv_packed_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                              const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                              const std::string& act) {
  return moe_gemv_packed_call("moe_gemv_packed_w4", false, x, topk_ids, topk_weights, w13_wpacked, w13_szpacked,
                              w2_wpacked, w2_szpacked, group_size, act);
}

at::Tensor moe_gemv_packed_w4_sums(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                   const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                                   const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                                   const std::string& act) {
  return moe_gemv_packed_call("moe_gemv_packed_w4_sums", true, x, topk_ids, topk_weights, w13_wpacked, w13_szpacked,
                              w2_wpacked, w2_szpacked, group_size, act);
}

namespace {

// moe_mma_w4 and moe_mma_packed_w4 (packed: the experts in the packed layout; prepare says how).
at::Tensor moe_mma_call(const char* op, bool packed, const at::Tensor& x, const at::Tensor& topk_ids,
                        const at::Tensor& topk_weights, const at::Tensor& w13_qweight, const at::Tensor& w13_scales,
                        const at::Tensor& w13_qzeros, const at::Tensor& w2_qweight, const at::Tensor& w2_scales,
                        const at::Tensor& w2_qzeros, int64_t group_size, const std::string& act, int64_t pass_rows) {
  FASTAWQ_CHECK(pass_rows == 8 || pass_rows == 16 || (pass_rows == 24 && !packed), op, ": pass_rows must be 8",
                packed ? " or 16" : ", 16 or 24", ", got ", pass_rows);
  // FASTAWQ_MOE_MMA_PASS=24 (an A/B switch, read at each call): the AWQ layout's passes of 16 tokens
  // become passes of 24 (three n-tiles; moe_mma.cuh). Qwen3-30B-A3B at T = 256: an expert's ~16 +- 4
  // tokens take 1.02 passes of 24 on average against 1.43 of 16, each pass a stream of its weights.
  if (pass_rows == 16 && !packed && env_int("FASTAWQ_MOE_MMA_PASS", 8, 24, 16) == 24) pass_rows = 24;
  MoeMmaArgs a{};
  const c10::cuda::CUDAGuard guard(x.device());
  MoeCall c = prepare(op, a, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales,
                      w2_qzeros, group_size, act, packed);
  FASTAWQ_CHECK(c.n <= kMoeMmaMaxAssign, op, ": T * k = ", c.n, " assignments (x ", shape_str(x), ", topk_ids ",
                shape_str(topk_ids), ") exceed the kernel's ", kMoeMmaMaxAssign);
  // The kernel reads x in 16-byte pieces.
  FASTAWQ_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, op,
                ": x must be 16-byte aligned with a row stride a multiple of 8, got x ", shape_str(x),
                " with strides (", x.stride(0), ", ", x.stride(1), ")");
  FASTAWQ_CHECK(c.e <= kMoeMmaMaxExperts, op, ": ", c.e, " experts exceed the kernel's ", kMoeMmaMaxExperts,
                " (", packed ? "w13_wpacked " : "w13_qweight ", shape_str(w13_qweight), ")");
  if (c.n == 0) return c.out;
  const int64_t n = c.n, h = c.h, i = c.i, e = c.e;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Block rows: the experts the call can reach at most (min(E, T * k)), plus one for bad ids;
  // rows past the experts it does reach exit at once.
  const int64_t hit = std::min(e, n);
  a.rows = static_cast<int>(hit + 1);
  a.pass_rows = static_cast<int>(pass_rows);
  // The weights' L2 priority: normal on the AWQ layout, evict-first on the packed one;
  // FASTAWQ_MOE_MMA_EVICT=first / normal (an A/B switch, read at each call) forces one. On the AWQ
  // layout a block's tile is a 32-byte stripe of each row, and the other three stripes of the
  // 128-byte line belong to neighbouring blocks: evict-first drops the line before they read it.
  // The packed layout's tiles read whole lines. H100, session 36 (bench_moe.py, us, first ->
  // normal), AWQ layout: Qwen3-30B-A3B T = 16 / 64 / 256 107.3 / 172.0 / 289.1 -> 109.0 / 172.8 /
  // 278.4, Mixtral-8x7B 412.2 / 651.2 / 2206.5 -> 362.2 / 581.5 / 1820.6; packed layout: Qwen3
  // 96.2 / 162.8 / 291.7 -> 103.0 / 175.4 / 313.1, Mixtral 291.1 / 559.9 / 1662.1 -> 295.0 /
  // 600.4 / 1808.5.
  const char* evict_env = std::getenv("FASTAWQ_MOE_MMA_EVICT");
  const std::string_view evict = evict_env != nullptr ? evict_env : "";
  a.evict_normal = evict == "normal" || (evict != "first" && !packed);
  a.tiles13 = static_cast<int>((i + kMoeMmaTile13 - 1) / kMoeMmaTile13);
  a.tiles2 = static_cast<int>((h + kMoeMmaTile2 - 1) / kMoeMmaTile2);
  const int per_sm = moe_mma_blocks_per_sm(static_cast<int>(pass_rows));
  mma_split(hit * a.tiles13, h, sms, per_sm, a.splits13, a.steps13);
  mma_split(hit * a.tiles2, i, sms, per_sm, a.splits2, a.steps2);
  // FASTAWQ_MOE_MMA_PERSISTENT=1 (an A/B switch, read at each call; a graph: at capture): w13 and
  // w2 in one launch of as many blocks as fit, taking the blocks of both grids as work items in
  // order (moe_mma.cuh). FASTAWQ_MOE_MMA_GRID=n caps its blocks (tests: a few blocks take many items);
  // FASTAWQ_MOE_MMA_AHEAD=1 has each block claim its next item early (launch.h).
  a.persistent_blocks = 0;
  a.claim_ahead = false;
  a.one_round = n <= kMoeMmaOneRoundAssign && env_switch("FASTAWQ_MOE_MMA_ONE_ROUND") != 0;
  a.early_w2 = env_switch("FASTAWQ_MOE_MMA_EARLY_W2") != 0;
  a.packed = packed;
  const char* chunks = packed ? std::getenv("FASTAWQ_MOE_PACKED_CHUNKS") : nullptr;  // (the packed kernel's only)
  a.packed_chunks = chunks != nullptr && std::strcmp(chunks, "2") == 0 ? 2 : 4;
  // w2's wide form (MoeMmaArgs::w2_wide) where its grid of the experts the call is expected to reach
  // fills at least 3/4 of a wave of blocks: a part-full wave leaves SMs idle for a warp's whole K
  // range. H100, session 31, decode tok/s tile -> wide form: Mixtral-8x7B batch 2 / 4 / 16 +2.8 /
  // +4.0 / +6.4 % (its grid fills 0.97 of a wave), Qwen3-30B-A3B batch 8 +2.0 % (0.77) but batch 16
  // -2.3 % (0.61: the rule keeps the tile form there). FASTAWQ_MOE_PACKED_W2_WIDE (read at each call)
  // overrides: 0 the tile form, 1 the wide form; unset or anything else, the rule.
  a.prefetch_steps = packed ? env_int("FASTAWQ_MOE_PACKED_PREFETCH", 0, 64, 0) : 0;  // (launch.h)
  const bool can_wide = packed && a.packed_chunks == 4;
  const char* wide_env = can_wide ? std::getenv("FASTAWQ_MOE_PACKED_W2_WIDE") : nullptr;
  const int wide = wide_env == nullptr                 ? -1
                   : std::strcmp(wide_env, "0") == 0 ? 0
                   : std::strcmp(wide_env, "1") == 0 ? 1
                                                     : -1;  // (anything else: the rule)
  if (can_wide && wide != 0) {
    const int tiles = static_cast<int>((h + 4 * kMoeMmaTile2 - 1) / (4 * kMoeMmaTile2));
    const int64_t blocks = expected_experts(e, n) * tiles;
    int splits = 1, steps = 1;
    wide_split(blocks, i, sms, per_sm, splits, steps);
    if (wide > 0 || 4 * blocks * splits >= 3 * int64_t(sms) * per_sm) {
      a.w2_wide = true;
      a.tiles2 = tiles, a.splits2 = splits, a.steps2 = steps;
    }
  }
  // (The persistent form reads the AWQ layout, in passes of 8 or 16.)
  if (!packed && pass_rows != 24 && env_switch("FASTAWQ_MOE_MMA_PERSISTENT") == 1) {
    a.claim_ahead = env_switch("FASTAWQ_MOE_MMA_AHEAD") == 1;
    const int64_t items = persistent_items(a);
    int64_t blocks = int64_t(sms) * per_sm;
    if (const char* cap = std::getenv("FASTAWQ_MOE_MMA_GRID"); cap != nullptr && std::atoi(cap) > 0) {
      blocks = std::min<int64_t>(blocks, std::atoi(cap));
    }
    a.persistent_blocks = static_cast<int>(std::min(blocks, items));
  }
  int* sched = carve_workspace(a, c, x.device(), a.splits13 > 1, e * a.tiles13, a.tiles2,
                               a.persistent_blocks > 0 ? 2 + a.rows : 0);
  a.sched = a.persistent_blocks > 0 ? sched : nullptr;
  launch_moe_mma(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c.out;
}

}  // namespace

at::Tensor moe_mma_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                      const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                      int64_t group_size, const std::string& act, int64_t pass_rows) {
  return moe_mma_call("moe_mma_w4", false, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_qzeros, w2_qweight,
                      w2_scales, w2_qzeros, group_size, act, pass_rows);
}

at::Tensor moe_mma_packed_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                             const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                             const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                             const std::string& act, int64_t pass_rows) {
  return moe_mma_call("moe_mma_packed_w4", true, x, topk_ids, topk_weights, w13_wpacked, w13_szpacked, at::Tensor(),
                      w2_wpacked, w2_szpacked, at::Tensor(), group_size, act, pass_rows);
}

}  // namespace fastawq
