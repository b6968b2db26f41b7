// Host entry of fastawq::moe_route (csrc/moe/route.cu): validation, whose messages name the shapes
// and dtypes at fault, and the grid. Which calls it serves is python/fastawq/backend.py's rule;
// the width, expert and top-k bounds are moe_route_declines, here.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "common/launch.h"
#include "common/workspace.h"
#include "ops.h"

namespace fastawq {

std::string moe_route_declines(int64_t num_experts, int64_t hidden, int64_t k) {
  if (hidden < 1 || hidden > kRouteMaxHidden)
    return cat("the compiled router takes H from 1 to ", kRouteMaxHidden, ", got H=", hidden);
  if (num_experts < 1 || num_experts > kRouteMaxExperts)
    return cat("the compiled router takes 1 to ", kRouteMaxExperts, " experts, got ", num_experts);
  if (k < 1 || k > num_experts || k > kRouteMaxTopk)
    return cat("the compiled router takes top-k from 1 to min(E, ", kRouteMaxTopk, "), got k=", k, " of ",
               num_experts);
  return "";
}

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// FASTAWQ_ROUTE_CLUSTER=0: the part kernel everywhere (an A/B switch, read once).
bool cluster_allowed() {
  static const bool on = [] {
    const char* v = std::getenv("FASTAWQ_ROUTE_CLUSTER");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

// FASTAWQ_ROUTE_LATE_TRIGGER=1: the cluster kernel lets the next kernel launch only as its blocks
// exit (RouteArgs::late_trigger; an A/B switch, read at each call so that one process can A/B it).
// H200, RESULTS.md session 15: it undoes the Mixtral loss of session 14 (cluster route against
// Triton's 0.907x early, 1.000x late: the loss was the experts' early launch) but costs Qwen3-30B-A3B
// 1.4 % (0.986x), and even late it does not beat Triton on Mixtral: off, and E < 16 keeps Triton.
bool late_trigger() {
  const char* v = std::getenv("FASTAWQ_ROUTE_LATE_TRIGGER");
  return v != nullptr && v[0] == '1' && v[1] == '\0';  // no allocation: it runs at every call
}

// Experts a block for the cluster kernel (route.cu), or 0 where it does not apply: sm_90, 16-byte
// rows, H <= kRouteClusterMaxHidden, E <= 8 * 16, and the block's router rows (+ the norm weight)
// in kRouteClusterSmem bytes of shared memory.
int cluster_experts(const at::Tensor& x, bool vec, int64_t h, int64_t e, bool norm) {
  if (!vec || !cluster_allowed() || h > kRouteClusterMaxHidden) return 0;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(x.device().index());
  if (prop->major < 9) return 0;
  int64_t eb = 1;  // experts a block: the power of 2 that keeps the cluster within 8 blocks
  while (eb * kRouteClusterMaxBlocks < e) eb *= 2;
  if (eb > kRouteClusterMaxBlockExperts) return 0;
  const int64_t bytes = (eb + (norm ? 1 : 0)) * h * 2;
  const int64_t room = std::min<int64_t>(kRouteClusterSmem, static_cast<int64_t>(prop->sharedMemPerBlockOptin) - 16 * 1024);
  return bytes <= room ? static_cast<int>(eb) : 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
    double eps, double offset, const at::Tensor& router_weight, int64_t k, bool renormalize, const std::string& scoring,
    const std::optional<at::Tensor>& correction_bias, double scale) {
  const auto shapes = [&] {
    std::string s = cat("x ", shape_str(x), " ", x.scalar_type(), ", router_weight ", shape_str(router_weight), " ",
                        router_weight.scalar_type());
    if (residual) s += cat(", residual ", shape_str(*residual));
    if (norm_weight) s += cat(", norm_weight ", shape_str(*norm_weight), " ", norm_weight->scalar_type());
    return s;
  };
  FASTAWQ_CHECK(x.dim() == 2 && x.stride(1) == 1 && router_weight.dim() == 2 && router_weight.size(1) == x.size(1),
                "moe_route: needs x [T, H] with unit column stride and router_weight [E, H]; got ", shapes());
  FASTAWQ_CHECK(x.is_cuda() && router_weight.device() == x.device(), "moe_route: x and router_weight must be on one "
                "CUDA device, got ", x.device(), " and ", router_weight.device());
  // x may be fp32 sums with the norm (FASTAWQ_MOE_O_SUMS, the cluster form only): the activation
  // dtype is then the residual's.
  const bool x_f32 = x.scalar_type() == at::kFloat && residual.has_value();
  const at::ScalarType dt = x_f32 ? residual->scalar_type() : x.scalar_type();
  FASTAWQ_CHECK((dt == at::kHalf || dt == at::kBFloat16) && router_weight.scalar_type() == dt &&
                    router_weight.is_contiguous(),
                "moe_route: x must be fp16 or bf16 (or fp32 sums beside an fp16 / bf16 residual) and router_weight "
                "contiguous in that dtype; got ", shapes());
  FASTAWQ_CHECK(residual.has_value() == norm_weight.has_value(),
                "moe_route: residual and norm_weight come together (the norm) or not at all; got ", shapes());
  const int64_t t = x.size(0), h = x.size(1), e = router_weight.size(0);
  const std::string why = moe_route_declines(e, h, k);
  FASTAWQ_CHECK(why.empty(), "moe_route: ", why, "; ", shapes());
  FASTAWQ_CHECK(scoring == "softmax" || scoring == "sigmoid", "moe_route: scoring must be softmax or sigmoid, got ",
                scoring);
  FASTAWQ_CHECK(t < 65536, "moe_route: T=", t, " tokens exceed the grid (65535); ", shapes());
  if (residual) {
    FASTAWQ_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == dt &&
                      residual->device() == x.device(),
                  "moe_route: residual must be contiguous, shaped like x and in its dtype (fp16 / bf16); got ",
                  shapes());
    FASTAWQ_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == h && norm_weight->is_contiguous() &&
                      norm_weight->scalar_type() == dt && norm_weight->device() == x.device(),
                  "moe_route: norm_weight must be a contiguous [H] in x's dtype; got ", shapes());
  }
  at::Tensor bias;
  if (correction_bias) {
    FASTAWQ_CHECK(correction_bias->dim() == 1 && correction_bias->size(0) == e &&
                      correction_bias->is_floating_point() && correction_bias->device() == x.device(),
                  "moe_route: correction_bias must be a float [E=", e, "] on ", x.device(), ", got ",
                  shape_str(*correction_bias));
    bias = correction_bias->to(at::kFloat).contiguous();
  }

  const c10::cuda::CUDAGuard guard(x.device());
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor weights = at::empty({t, k}, f32), ids = at::empty({t, k}, x.options().dtype(at::kLong));
  const auto act = x.options().dtype(dt);
  at::Tensor hout = residual ? at::empty({t, h}, act) : at::empty({0}, act);
  at::Tensor rout = residual ? at::empty({t, h}, act) : at::empty({0}, act);
  if (t == 0) return {weights, ids, hout, rout};

  RouteArgs a{};
  a.dtype = dt == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;
  a.x_f32 = x_f32;
  a.x = x.data_ptr(), a.x_stride = x.stride(0);
  a.router = router_weight.data_ptr();
  a.bias = correction_bias ? bias.data_ptr<float>() : nullptr;
  a.weights = weights.data_ptr<float>(), a.ids = ids.data_ptr<int64_t>();
  bool vec = h % 8 == 0 && x.stride(0) % 8 == 0 && aligned16(x) && aligned16(router_weight);
  if (residual) {
    a.residual = residual->data_ptr(), a.norm_weight = norm_weight->data_ptr();
    a.h = hout.data_ptr(), a.res_out = rout.data_ptr();
    vec = vec && aligned16(*residual) && aligned16(*norm_weight) && aligned16(hout) && aligned16(rout);
  }
  a.vec = vec;
  a.t = static_cast<int>(t), a.hidden = static_cast<int>(h), a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.parts = static_cast<int>((e + kRouteBlockExperts - 1) / kRouteBlockExperts);
  a.eps = static_cast<float>(eps), a.offset = static_cast<float>(offset), a.scale = static_cast<float>(scale);
  a.renorm = renormalize, a.sigmoid = scoring == "sigmoid";
  a.cluster_experts = cluster_experts(x, vec, h, e, residual.has_value());
  FASTAWQ_CHECK(!x_f32 || a.cluster_experts > 0, "moe_route: fp32 x (sums) runs on the cluster form only (sm_90, "
                "16-byte rows, H <= ", kRouteClusterMaxHidden, ", E <= ", kRouteClusterMaxBlocks *
                kRouteClusterMaxBlockExperts, "); got ", shapes());
  a.late_trigger = late_trigger();
  at::Tensor logits;
  if (a.parts > 1 && a.cluster_experts == 0) {
    logits = at::empty({t, e}, f32);
    a.logits = logits.data_ptr<float>();
    a.counters = zeroed_counters(Workspace::kRouteCounters, x.device(), t);
  }
  launch_moe_route(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {weights, ids, hout, rout};
}

}  // namespace fastawq
