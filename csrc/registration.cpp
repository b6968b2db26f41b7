// The one place fastawq's ops are registered: each schema is written once, here.
// The CPU kernels (csrc/cpu/) are in every build; the CUDA ones only where CMakeLists.txt found
// the CUDA toolchain and defined FASTAWQ_WITH_CUDA.
#include <Python.h>
#include <torch/library.h>

#include "cpu/awq_cpu_ops.h"
#ifdef FASTAWQ_WITH_CUDA
#include "attention/attention_ops.h"
#include "ops.h"
#endif

TORCH_LIBRARY(fastawq, m) {
  m.def("awq_cpu_repack(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> (Tensor, Tensor, Tensor)");
  m.def("awq_cpu_gemm(Tensor x, Tensor w, Tensor scales, Tensor zeros16, int group_size, int n, Tensor? bias, "
        "str isa=\"auto\") -> Tensor");
  m.def("awq_cpu_isas() -> str[]", &fastawq::awq_cpu_isas);
  m.def("awq_cpu_decode_layer(Tensor(a!) res, Tensor? x, Tensor norm1, Tensor norm2, Tensor[] weights, int[] groups, "
        "int[] ns, Tensor?[] biases, Tensor(b!) k_cache, Tensor(c!) v_cache, int pos, Tensor cos, Tensor sin_signed, "
        "Tensor? q_norm, Tensor? k_norm, int num_heads, int num_kv_heads, float eps, float scale, str activation, "
        "str isa=\"auto\") -> Tensor");
#ifdef FASTAWQ_WITH_CUDA
  m.def("awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> Tensor");
  m.def("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
        "str kernel=\"auto\") -> Tensor");
  // No tensors: callable without a GPU, so Python asks the one owner of the fit rules.
  m.def("awq_gemm_declines(str kernel, int m, int n, int k, int group_size) -> str", &fastawq::awq_gemm_declines);
  m.def("awq_gemv_packed(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "int warps_per_sm=0) -> Tensor");
  m.def("awq_gemv_packed_act(Tensor gate_up, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "str act) -> Tensor");
  m.def("awq_gemv_packed_sums(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "Tensor(a!) sums, Tensor(b!)? zero=None) -> ()");
  m.def("awq_gemv_packed_act_sums(Tensor gate_up, Tensor wpacked, Tensor szpacked, int n, int group_size, "
        "Tensor? bias, str act, Tensor(a!) sums) -> ()");
  m.def("awq_gemv_packed_norm(Tensor x, Tensor? residual, Tensor norm_weight, float eps, float offset, "
        "Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias) -> (Tensor, Tensor)");
  m.def("awq_mma_packed(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "int chunks=0, int warps_per_sm=0) -> Tensor");
  m.def("awq_gemm_packed(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "int m_tiles=0, int chunks=0, int splits=0) -> Tensor");
  m.def("awq_wgmma_packed(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "int tokens=0, int splits=0) -> Tensor");
  m.def("awq_wgmma_packed_sums(Tensor x, Tensor wpacked, Tensor szpacked, int n, int group_size, Tensor? bias, "
        "Tensor(a!) sums, int tokens=0, int splits=0) -> ()");
  m.def("awq_wgmma_packed_declines() -> str", &fastawq::awq_wgmma_packed_declines);
  m.def("moe_gemv_w4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_scales, "
        "Tensor w13_qzeros, Tensor w2_qweight, Tensor w2_scales, Tensor w2_qzeros, int group_size, str act) -> Tensor");
  m.def("moe_gemv_w4_sums(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_scales, "
        "Tensor w13_qzeros, Tensor w2_qweight, Tensor w2_scales, Tensor w2_qzeros, int group_size, str act) -> Tensor");
  m.def("moe_mma_w4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_scales, "
        "Tensor w13_qzeros, Tensor w2_qweight, Tensor w2_scales, Tensor w2_qzeros, int group_size, str act, "
        "int pass_rows=8) -> Tensor");
  m.def("moe_mma_packed_w4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_wpacked, Tensor w13_szpacked, "
        "Tensor w2_wpacked, Tensor w2_szpacked, int group_size, str act, int pass_rows=8) -> Tensor");
  m.def("moe_gemv_packed_w4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_wpacked, Tensor w13_szpacked, "
        "Tensor w2_wpacked, Tensor w2_szpacked, int group_size, str act) -> Tensor");
  m.def("moe_gemv_packed_w4_sums(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_wpacked, "
        "Tensor w13_szpacked, Tensor w2_wpacked, Tensor w2_szpacked, int group_size, str act) -> Tensor");
  m.def("moe_gemv_w4_declines(int num_experts, int hidden, int inter, int group_size) -> str",
        &fastawq::moe_gemv_w4_declines);
  m.def("moe_route(Tensor x, Tensor? residual, Tensor? norm_weight, float eps, float offset, Tensor router_weight, "
        "int k, bool renormalize, str scoring, Tensor? correction_bias, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_route_declines(int num_experts, int hidden, int k) -> str", &fastawq::moe_route_declines);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lens, float scale) -> Tensor");
  m.def("decode_attention_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lens, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("rope_decode_attention(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor lens, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, int num_heads, "
        "float scale) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(fastawq, CPU, m) {
  m.impl("awq_cpu_repack", &fastawq::awq_cpu_repack);
  m.impl("awq_cpu_gemm", &fastawq::awq_cpu_gemm);
  m.impl("awq_cpu_decode_layer", &fastawq::awq_cpu_decode_layer);
}

#ifdef FASTAWQ_WITH_CUDA
TORCH_LIBRARY_IMPL(fastawq, CUDA, m) {
  m.impl("awq_dequantize", &fastawq::awq_dequantize);
  m.impl("awq_gemm", &fastawq::awq_gemm);
  m.impl("awq_gemv_packed", &fastawq::awq_gemv_packed);
  m.impl("awq_gemv_packed_act", &fastawq::awq_gemv_packed_act);
  m.impl("awq_gemv_packed_sums", &fastawq::awq_gemv_packed_sums);
  m.impl("awq_gemv_packed_act_sums", &fastawq::awq_gemv_packed_act_sums);
  m.impl("awq_gemv_packed_norm", &fastawq::awq_gemv_packed_norm);
  m.impl("awq_mma_packed", &fastawq::awq_mma_packed);
  m.impl("awq_gemm_packed", &fastawq::awq_gemm_packed);
  m.impl("awq_wgmma_packed", &fastawq::awq_wgmma_packed);
  m.impl("awq_wgmma_packed_sums", &fastawq::awq_wgmma_packed_sums);
  m.impl("moe_gemv_w4", &fastawq::moe_gemv_w4);
  m.impl("moe_gemv_w4_sums", &fastawq::moe_gemv_w4_sums);
  m.impl("moe_mma_w4", &fastawq::moe_mma_w4);
  m.impl("moe_mma_packed_w4", &fastawq::moe_mma_packed_w4);
  m.impl("moe_gemv_packed_w4", &fastawq::moe_gemv_packed_w4);
  m.impl("moe_gemv_packed_w4_sums", &fastawq::moe_gemv_packed_w4_sums);
  m.impl("moe_route", &fastawq::moe_route);
  m.impl("decode_attention", &fastawq::decode_attention);
  m.impl("decode_attention_out", &fastawq::decode_attention_out);
  m.impl("rope_decode_attention", &fastawq::rope_decode_attention);
}
#endif

// `import fastawq._C` only has to run the static registrations above: an empty module.
static PyModuleDef fastawq_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fastawq_c_module); }
