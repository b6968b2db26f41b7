// Every host entry point of fastawq._C, declared once. Schemas live in registration.cpp.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace fastawq {

// qweight [K, N/8] int32 · scales [K/G, N] fp16|bf16 · qzeros [K/G, N/8] int32 -> w [K, N] (scales' dtype)
at::Tensor awq_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                          int64_t group_size);

// x [M, K] fp16|bf16 · qweight [K, N/8] · scales [K/G, N] (x's dtype) · qzeros [K/G, N/8] · bias [N] -> [M, N]
// kernel: "gemv" | "gemv_staged" | "mma" | "dequant_cublas", or "auto" (the tensor-core kernel
// for small M where it fits, else dequantize + cuBLAS). A named kernel that declines the problem
// is an error.
at::Tensor awq_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                    const std::string& kernel);

// "" when `kernel` takes an [m, k] x [k, n] problem with this group size, else why not. The one
// owner of the kernels' shape rules (needs no GPU; operand alignment is checked by awq_gemm).
std::string awq_gemm_declines(const std::string& kernel, int64_t m, int64_t n, int64_t k, int64_t group_size);

// Internal: dequantize into a preallocated out [K, N] (used by the large-M path of awq_gemm).
void awq_dequantize_into(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                         int64_t group_size, at::Tensor& out);

// x [M<=8, K] fp16|bf16 · wpacked [K/8, N] int32 · szpacked [K/G, 2N] (x's dtype), both from
// fastawq.ops.repack.awq_gemv_repack · bias [N] -> [M, N]: the decode kernel on the repacked layout.
// warps_per_sm 0: the grid is one wave of what fits; set, the grid's target, for a benchmark sweep.
at::Tensor awq_gemv_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, int64_t warps_per_sm);
// awq_gemv_packed of RMSNorm(x + residual) * (norm_weight + offset) (M <= 2), the norm made in the
// kernel's shared memory: add_rms_norm and the GEMV in one launch. Returns (out, x + residual), the
// second empty without a residual.
std::tuple<at::Tensor, at::Tensor> awq_gemv_packed_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                         const at::Tensor& norm_weight, double eps, double offset,
                                                         const at::Tensor& wpacked, const at::Tensor& szpacked,
                                                         int64_t n, int64_t group_size,
                                                         const std::optional<at::Tensor>& bias);

// awq_gemv_packed of act(gate) * up for gate_up [M, 2K] (M <= 2, act silu / gelu_pytorch_tanh /
// gelu), the product made in the kernel's shared memory: act_mul and the GEMV in one launch.
at::Tensor awq_gemv_packed_act(const at::Tensor& gate_up, const at::Tensor& wpacked, const at::Tensor& szpacked,
                               int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias,
                               const std::string& act);

// awq_gemv_packed / awq_gemv_packed_act (M <= 2) adding y = x W + bias into sums [M, N] fp32, which
// an earlier kernel zeroed (add_rms_norm_zero in the fused engine), instead of returning y: the
// blocks add their tiles and exit, with no fence, arrival or conversion pass; the consumer rounds
// the sums (add_rms_norm takes fp32 x). FASTAWQ_DENSE_SUMS in python/fastawq/modules/fused.py.
// zero (optional, fp32, 16-byte aligned, numel % 4 == 0, apart from sums): filled with zeros by the
// launch, after its PDL wait, for a later projection's sums. _act_sums also takes gate_up as fp32
// sums [M, 2K] (the activation dtype is then szpacked's), rounded to it as they are read
// (FASTAWQ_DENSE_GU_SUMS).
void awq_gemv_packed_sums(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                          int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& sums,
                          const std::optional<at::Tensor>& zero);
void awq_gemv_packed_act_sums(const at::Tensor& gate_up, const at::Tensor& wpacked, const at::Tensor& szpacked,
                              int64_t n, int64_t group_size, const std::optional<at::Tensor>& bias,
                              const std::string& act, at::Tensor& sums);

// The same on the tensor cores for x [M<=32, K] (csrc/gemv/awq_mma_packed.cu). chunks (32-column
// chunks per block tile: 1, 2, 4) and warps_per_sm (the grid's target) 0: the kernel's defaults;
// set, they let a benchmark sweep the tile.
at::Tensor awq_mma_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                          int64_t group_size, const std::optional<at::Tensor>& bias, int64_t chunks,
                          int64_t warps_per_sm);

// The same on the tensor cores with the batch as the mma's M, any M (csrc/gemv/awq_gemm_packed.cu).
// m_tiles (16-row mma tiles per block: 1, 2, 4), chunks (128-column chunks per block: 1, 2) and
// splits (K splits) 0: by M, and one wave of what fits; set, they let a benchmark sweep the tile.
at::Tensor awq_gemm_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, int64_t m_tiles, int64_t chunks,
                           int64_t splits);

// The same on Hopper's warpgroup MMA (sm_90a builds and devices only; csrc/gemv/awq_wgmma_packed_sm90.cu).
// tokens (batch rows a block: 32, 64, 128) and splits (K splits) 0: by M, and one wave of what fits.
at::Tensor awq_wgmma_packed(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                            int64_t group_size, const std::optional<at::Tensor>& bias, int64_t tokens, int64_t splits);
// Why awq_wgmma_packed cannot run on the current CUDA device ("" when it can): not built for
// sm_90a, or the device is not sm_90. Needs a CUDA device.
// awq_wgmma_packed adding x W + bias into sums (a contiguous fp32 [M, N], usually zeroed by
// the launch before): no split-K arrival or conversion pass at the end, the consumer (add_rms_norm) rounds.
void awq_wgmma_packed_sums(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& szpacked, int64_t n,
                           int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& sums, int64_t tokens,
                           int64_t splits);
std::string awq_wgmma_packed_declines();

// MoE decode on the CUDA cores (csrc/moe/): x [T, H] fp16|bf16 · topk_ids [T, k] int32|int64 ·
// topk_weights [T, k] fp32 · stacked AWQ expert weights as fastawq::moe_w4 (scales in x's dtype)
// -> [T, H] = sum_j w[:, j] * down_e(act(gate_e(x)) * up_e(x)). Ids outside [0, E) add nothing.
at::Tensor moe_gemv_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                       const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                       int64_t group_size, const std::string& act);

// moe_gemv_w4's weighted sum before its rounding to x's dtype: [T, H] fp32. At one token (the ring
// form) w2 leaves it unconverted, with no arrival or last-block pass; rounded to x's dtype it is
// moe_gemv_w4's output up to the order of the fp32 additions. The fused engine's next add_rms_norm
// reads it (python/fastawq/modules/fused.py, FASTAWQ_MOE_SUMS).
at::Tensor moe_gemv_w4_sums(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                            const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                            int64_t group_size, const std::string& act);

// The same on the tensor cores, each expert read once per call (csrc/moe/moe_mma.cuh); T * k at most
// kMoeMmaMaxAssign (common/launch.h), x 16-byte aligned; pass_rows (8 or 16) tokens of an expert
// per pass over its weights (python/fastawq/backend.py's moe_pass_rows picks it).
at::Tensor moe_mma_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& w13_qweight, const at::Tensor& w13_scales, const at::Tensor& w13_qzeros,
                      const at::Tensor& w2_qweight, const at::Tensor& w2_scales, const at::Tensor& w2_qzeros,
                      int64_t group_size, const std::string& act, int64_t pass_rows);

// moe_mma_w4 on experts repacked into the packed layout (python/fastawq/ops/repack.py,
// awq_experts_repack): w13_wpacked [E, H/8, 2I] int32, w13_szpacked [E, H/G, 4I], w2_wpacked
// [E, I/8, H], w2_szpacked [E, I/G, 2H] (x's dtype).
at::Tensor moe_mma_packed_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                             const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                             const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                             const std::string& act, int64_t pass_rows);

// moe_gemv_w4 (and _sums) on experts in the packed layout (as moe_mma_packed_w4 takes them),
// csrc/moe/moe_gemv_packed.cu: x 16-byte aligned with a row stride a multiple of 8.
at::Tensor moe_gemv_packed_w4(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                              const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                              const std::string& act);
at::Tensor moe_gemv_packed_w4_sums(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                   const at::Tensor& w13_wpacked, const at::Tensor& w13_szpacked,
                                   const at::Tensor& w2_wpacked, const at::Tensor& w2_szpacked, int64_t group_size,
                                   const std::string& act);

// "" when moe_gemv_w4 and moe_mma_w4 take E experts of H x I with this group size, else why not (no GPU needed).
std::string moe_gemv_w4_declines(int64_t num_experts, int64_t hidden, int64_t inter, int64_t group_size);

// An MoE block's routing in one launch (csrc/moe/route.cu): x [T, H] fp16|bf16 · router_weight [E, H]
// (x's dtype) -> (topk_weights [T, k] fp32, topk_ids [T, k] int64, h, x + residual) as
// reference.route; with residual and norm_weight [H], of h = RMSNorm(x + residual) * (norm_weight +
// offset) (both [T, H]; empty tensors without the norm), as ops.add_rms_norm_route.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
    double eps, double offset, const at::Tensor& router_weight, int64_t k, bool renormalize, const std::string& scoring,
    const std::optional<at::Tensor>& correction_bias, double scale);

// "" when moe_route takes E experts of width H and top-k (no GPU needed), else why not.
std::string moe_route_declines(int64_t num_experts, int64_t hidden, int64_t k);

}  // namespace fastawq
