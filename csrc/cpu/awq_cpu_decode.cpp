// One decoder layer of a Llama-shaped model's decode step on the CPU, in one op call: residual
// add, RMS norm, the qkv GEMM, optional q/k norms, rope (halves rotated), the new K/V row into the
// cache, attention over the filled part of the cache (grouped heads), the o GEMM and residual,
// RMS norm, the gate/up GEMM, the gated activation and the down GEMM. The GEMMs are awq_cpu_gemm;
// the rest are loops over one row per batch entry, fp32. It replaces ~20 torch calls from Python
// per layer (modules/fused_cpu.py), whose per-call overhead was about half of a decode step.
//
// Compiled without ISA flags (the module must load on any x86-64); the two inner loops of the
// attention (q.k and p*v over head_dim) have an AVX2+FMA version selected at run time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/checks.h"
#include "cpu/awq_cpu_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fastawq {
namespace cpu {
namespace {

float dot_plain(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_plain(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  float s = _mm_cvtss_f32(h);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
#endif

struct VecOps {
  float (*dot)(const float*, const float*, int64_t) = &dot_plain;
  void (*axpy)(float, const float*, float*, int64_t) = &axpy_plain;
  VecOps() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      dot = &dot_avx2;
      axpy = &axpy_avx2;
    }
#endif
  }
};

const VecOps& vec() {
  static const VecOps v;
  return v;
}

// out[i] = x[i] / rms(x) * w[i] over n elements (out may alias x).
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rope on one head: out = x * cos + flip_halves(x) * sin_signed.
void rope(float* x, const float* cos, const float* sin_signed, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float lo = x[i], hi = x[i + half];
    x[i] = lo * cos[i] + hi * sin_signed[i];
    x[i + half] = hi * cos[i + half] + lo * sin_signed[i + half];
  }
}

float act(int kind, float v) {
  if (kind == 0) return v / (1.0f + std::exp(-v));  // silu
  if (kind == 1) {  // gelu, tanh approximation
    const float c = 0.7978845608028654f;
    return 0.5f * v * (1.0f + std::tanh(c * (v + 0.044715f * v * v * v)));
  }
  return 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f));  // gelu
}

void check_f32(const char* name, const at::Tensor& t, int64_t numel) {
  FASTAWQ_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
                "awq_cpu_decode_layer: ", name, " must be a contiguous CPU fp32 tensor of ", numel, " elements, got ",
                t.scalar_type(), " ", shape_str(t));
}

}  // namespace
}  // namespace cpu

at::Tensor awq_cpu_decode_layer(const at::Tensor& res, const std::optional<at::Tensor>& x, const at::Tensor& norm1,
                                const at::Tensor& norm2, const std::vector<at::Tensor>& weights,
                                c10::IntArrayRef groups, c10::IntArrayRef ns,
                                const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, int64_t pos, const at::Tensor& cos,
                                const at::Tensor& sin_signed, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, int64_t num_heads, int64_t num_kv_heads,
                                double eps, double scale, const std::string& activation, const std::string& isa) {
  using namespace cpu;
  const char* op = "awq_cpu_decode_layer";
  FASTAWQ_CHECK(res.dim() == 2, op, ": res must be 2-D [B, H], got ", shape_str(res));
  const int64_t b = res.size(0), hidden = res.size(1);
  check_f32("res", res, b * hidden);
  if (x.has_value()) check_f32("x", *x, b * hidden);
  check_f32("norm1", norm1, hidden);
  check_f32("norm2", norm2, hidden);
  FASTAWQ_CHECK(weights.size() == 12 && groups.size() == 4 && ns.size() == 4 && biases.size() == 4, op,
                ": expected 12 weights (w, scales, zeros16 of qkv, o, gate_up, down), 4 groups, 4 ns, 4 biases; got ",
                static_cast<int64_t>(weights.size()), ", ", static_cast<int64_t>(groups.size()), ", ",
                static_cast<int64_t>(ns.size()), ", ", static_cast<int64_t>(biases.size()));
  FASTAWQ_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kFloat &&
                    v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
                op, ": k_cache / v_cache must be contiguous fp32 [B, S, kv_heads, head_dim], got ",
                k_cache.scalar_type(), " ", shape_str(k_cache), " and ", v_cache.scalar_type(), " ",
                shape_str(v_cache));
  const int64_t hq = num_heads, hkv = num_kv_heads, d = k_cache.size(3), seq = k_cache.size(1);
  FASTAWQ_CHECK(k_cache.size(0) >= b && k_cache.size(2) == hkv && hkv > 0 && hq % hkv == 0 && d % 2 == 0, op,
                ": cache ", shape_str(k_cache), " does not fit batch ", b, ", ", hq, " heads / ", hkv,
                " kv heads (head_dim even)");
  FASTAWQ_CHECK(pos >= 0 && pos < seq, op, ": position ", pos, " is outside the cache's ", seq, " slots");
  check_f32("cos", cos, d);
  check_f32("sin_signed", sin_signed, d);
  FASTAWQ_CHECK(q_norm.has_value() == k_norm.has_value(), op, ": q_norm and k_norm go together");
  if (q_norm.has_value()) {
    check_f32("q_norm", *q_norm, d);
    check_f32("k_norm", *k_norm, d);
  }
  const int kind = activation == "silu" ? 0 : activation == "gelu_pytorch_tanh" ? 1 : activation == "gelu" ? 2 : -1;
  FASTAWQ_CHECK(kind >= 0, op, ": activation must be silu, gelu_pytorch_tanh or gelu, got ", activation);
  const int64_t qd = hq * d, kd = hkv * d;
  FASTAWQ_CHECK(ns[0] == qd + 2 * kd && ns[1] == hidden && ns[2] % 2 == 0 && ns[3] == hidden, op,
                ": GEMM widths ", ns, " do not fit hidden ", hidden, ", q ", qd, ", kv ", kd);

  auto gemm = [&](const at::Tensor& in, int i) {
    return awq_cpu_gemm(in, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], groups[i], ns[i], biases.get(i),
                        isa);
  };
  float* r = res.mutable_data_ptr<float>();
  if (x.has_value()) {
    const float* xp = x->const_data_ptr<float>();
    for (int64_t i = 0; i < b * hidden; ++i) r[i] += xp[i];
  }
  auto h = at::empty({b, hidden}, res.options());
  float* hp = h.mutable_data_ptr<float>();
  for (int64_t row = 0; row < b; ++row) rms_norm(r + row * hidden, norm1.const_data_ptr<float>(), hp + row * hidden, hidden, eps);

  // qkv, then per head: q/k norms, rope; K and V rows into the cache.
  at::Tensor t = gemm(h, 0).contiguous();
  float* tp = t.mutable_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin_signed.const_data_ptr<float>();
  float* kc = k_cache.mutable_data_ptr<float>();
  float* vc = v_cache.mutable_data_ptr<float>();
  const int64_t row_stride = seq * kd;  // cache elements per batch entry
  for (int64_t row = 0; row < b; ++row) {
    float* tr = tp + row * ns[0];
    for (int64_t hh = 0; hh < hq + hkv; ++hh) {
      float* head = tr + hh * d;
      if (q_norm.has_value()) rms_norm(head, (hh < hq ? *q_norm : *k_norm).const_data_ptr<float>(), head, d, eps);
      rope(head, cp, sp, d);
    }
    std::copy(tr + qd, tr + qd + kd, kc + row * row_stride + pos * kd);
    std::copy(tr + qd + kd, tr + qd + 2 * kd, vc + row * row_stride + pos * kd);
  }

  // Attention of each (row, head) over positions 0..pos of its kv head.
  const int64_t len = pos + 1, group = hq / hkv;
  auto o = at::empty({b, qd}, res.options());
  float* op_ = o.mutable_data_ptr<float>();
  const VecOps& v = vec();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * hq, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, len * d)), [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(len));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / hq, hh = i % hq, kvh = hh / group;
      const float* q = tp + row * ns[0] + hh * d;
      const float* kb = kc + row * row_stride + kvh * d;
      const float* vb = vc + row * row_stride + kvh * d;
      float mx = -INFINITY;
      for (int64_t l = 0; l < len; ++l) {
        p[l] = sc * v.dot(q, kb + l * kd, d);
        mx = std::max(mx, p[l]);
      }
      float sum = 0.0f;
      for (int64_t l = 0; l < len; ++l) sum += (p[l] = std::exp(p[l] - mx));
      float* out = op_ + row * qd + hh * d;
      std::fill(out, out + d, 0.0f);
      for (int64_t l = 0; l < len; ++l) v.axpy(p[l], vb + l * kd, out, d);
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < d; ++j) out[j] *= inv;
    }
  });

  const at::Tensor attn = gemm(o, 1);
  const float* ap = attn.const_data_ptr<float>();
  for (int64_t i = 0; i < b * hidden; ++i) r[i] += ap[i];
  for (int64_t row = 0; row < b; ++row) rms_norm(r + row * hidden, norm2.const_data_ptr<float>(), hp + row * hidden, hidden, eps);
  const at::Tensor gu = gemm(h, 2);
  const int64_t inter = ns[2] / 2;
  auto a = at::empty({b, inter}, res.options());
  const float* gp = gu.const_data_ptr<float>();
  float* app = a.mutable_data_ptr<float>();
  for (int64_t row = 0; row < b; ++row)
    for (int64_t j = 0; j < inter; ++j) app[row * inter + j] = act(kind, gp[row * ns[2] + j]) * gp[row * ns[2] + inter + j];
  return gemm(a, 3);
}

}  // namespace fastawq
