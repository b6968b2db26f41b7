// The one place fastawq's CUDA ops are registered: each schema is written once, here. The CPU
// kernels (csrc/cpu/, built with or without CUDA) register theirs from csrc/cpu/awq_cpu.cpp with
// TORCH_LIBRARY_FRAGMENT; FASTAWQ_WITH_CUDA is defined by CMakeLists.txt in CUDA builds only.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(fastawq, m) {
#ifdef FASTAWQ_WITH_CUDA
  m.def("awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> Tensor");
  m.def("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias) -> Tensor");
  m.def("awq_gemm_config(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
        "int path, int split_k) -> Tensor");
  m.def("awq_repack_tiled(Tensor qweight) -> Tensor");
  m.def("awq_gemm_tiled(Tensor x, Tensor qweight_tiled, Tensor scales, Tensor qzeros, int group_size, Tensor? bias, "
        "int split_k) -> Tensor");
#endif
}

#ifdef FASTAWQ_WITH_CUDA
TORCH_LIBRARY_IMPL(fastawq, CUDA, m) {
  m.impl("awq_dequantize", &fastawq::awq_dequantize);
  m.impl("awq_gemm", &fastawq::awq_gemm);
  m.impl("awq_gemm_config", &fastawq::awq_gemm_config);
  m.impl("awq_repack_tiled", &fastawq::awq_repack_tiled);
  m.impl("awq_gemm_tiled", &fastawq::awq_gemm_tiled);
}

// The repack is a pure permutation: it also runs on CPU tensors (checkpoints load there first).
TORCH_LIBRARY_IMPL(fastawq, CPU, m) { m.impl("awq_repack_tiled", &fastawq::awq_repack_tiled); }
#endif

// `import fastawq._C` only has to run the static registrations above: an empty module.
static PyModuleDef fastawq_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fastawq_c_module); }
