// Schemas and CUDA kernels of the attention ops. A fragment of the fastawq library, kept apart
// from csrc/registration.cpp so that the attention family builds and registers on its own.
#include <torch/library.h>

#include "attention/attention_ops.h"

TORCH_LIBRARY_FRAGMENT(fastawq, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lens, float scale) -> Tensor");
  m.def("decode_attention_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lens, float scale, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(fastawq, CUDA, m) {
  m.impl("decode_attention", &fastawq::decode_attention);
  m.impl("decode_attention_out", &fastawq::decode_attention_out);
}
