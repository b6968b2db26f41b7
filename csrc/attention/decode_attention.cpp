// Host entry of fastawq::decode_attention: validation, split count, partials, arrival counters.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "attention/attention_ops.h"
#include "attention/launch_attention.h"
#include "common/checks.h"
#include "common/pdl.cuh"
#include "common/workspace.h"

namespace fastawq {
namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// 16-byte vector loads: unit stride in D, every other stride a multiple of 8 elements.
bool vector_friendly(const at::Tensor& t) {
  if (t.stride(-1) != 1 || !aligned16(t)) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;
  }
  return true;
}

std::string problem(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& lens) {
  return cat("decode_attention (q ", shape_str(q), ", k_cache ", shape_str(k_cache), ", v_cache ",
             shape_str(v_cache), ", lens ", shape_str(lens), ")");
}

// q_sums (the rope form only): q is the QKV projection's fp32 sums, read in the caches' dtype.
void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& lens, bool q_sums = false) {
  // Built only when a check fails (TORCH_CHECK evaluates its message lazily).
  const auto p = [&] { return problem(q, k_cache, v_cache, lens); };
  FASTAWQ_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, p(),
                ": expected q [B, HQ, D] and k_cache, v_cache [B', S, HKV, D]");
  FASTAWQ_CHECK(q.is_cuda() && k_cache.device() == q.device() && v_cache.device() == q.device() &&
                    lens.device() == q.device(),
                p(), ": q, k_cache, v_cache and lens must be on one CUDA device, got ", q.device(), ", ",
                k_cache.device(), ", ", v_cache.device(), ", ", lens.device());
  if (q_sums) {
    FASTAWQ_CHECK(k_cache.scalar_type() == at::kHalf || k_cache.scalar_type() == at::kBFloat16, p(),
                  ": with fp32 qkv sums the caches must be fp16 or bf16, got ", k_cache.scalar_type());
  } else {
    FASTAWQ_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, p(),
                  ": q must be fp16 or bf16, got ", q.scalar_type());
  }
  const at::ScalarType dtype = q_sums ? k_cache.scalar_type() : q.scalar_type();
  FASTAWQ_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, p(),
                ": k_cache and v_cache must have q's dtype ", dtype, ", got ", k_cache.scalar_type(), " and ",
                v_cache.scalar_type());
  FASTAWQ_CHECK(lens.scalar_type() == at::kInt, p(), ": lens must be int32, got ", lens.scalar_type());
  FASTAWQ_CHECK(k_cache.sizes() == v_cache.sizes(), p(), ": k_cache and v_cache must have one shape");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(2);
  FASTAWQ_CHECK(k_cache.size(3) == d, p(), ": head_dim D=", d, " of q differs from the caches' ", k_cache.size(3));
  FASTAWQ_CHECK(d == 64 || d == 128 || d == 256, p(), ": head_dim D=", d, " is not supported (64, 128, 256)");
  FASTAWQ_CHECK(hkv > 0 && hq % hkv == 0, p(), ": HQ=", hq, " query heads are not a multiple of HKV=", hkv,
                " KV heads");
  FASTAWQ_CHECK(hq / hkv <= kDecodeMaxGroup, p(), ": ", hq / hkv, " query heads per KV head (HQ=", hq, ", HKV=",
                hkv, "); at most ", kDecodeMaxGroup, " are supported");
  FASTAWQ_CHECK(k_cache.size(0) >= b, p(), ": the caches hold ", k_cache.size(0), " rows, q has B=", b);
  FASTAWQ_CHECK(lens.dim() == 1 && lens.size(0) == b && lens.stride(0) == 1, p(),
                ": lens must be a contiguous [B] = [", b, "] tensor");
  FASTAWQ_CHECK(k_cache.size(1) > 0 && k_cache.size(1) < (int64_t(1) << 31) && hkv <= 65535 && b <= 65535, p(),
                ": S, HKV or B out of range");
  FASTAWQ_CHECK(vector_friendly(q), p(), ": q (strides ", q.strides(),
                ") needs unit stride in D, other strides that are multiples of 8 and 16-byte alignment");
  FASTAWQ_CHECK(vector_friendly(k_cache) && vector_friendly(v_cache), p(), ": k_cache (strides ",
                k_cache.strides(), ") and v_cache (strides ", v_cache.strides(),
                ") need unit stride in D, other strides that are multiples of 8 and 16-byte alignment");
}

// FASTAWQ_ATTN_SPLIT_KEYS=N: a split takes at least N keys (rounded up to a multiple of
// kDecodeSplitKeys; default kDecodeSplitKeys), so short contexts run fewer splits and skip the
// cross-split combine. A benchmark switch, read at each call (a graph reads it at capture), so one
// process can A/B it (benchmarks/bench_ab.py --compare env:...); the default is what RESULTS.md measured.
int min_split_keys() {
  const char* v = std::getenv("FASTAWQ_ATTN_SPLIT_KEYS");
  const long n = v != nullptr ? std::strtol(v, nullptr, 10) : 0;
  const long r = (n + kDecodeSplitKeys - 1) / kDecodeSplitKeys * kDecodeSplitKeys;
  return static_cast<int>(r < kDecodeSplitKeys ? kDecodeSplitKeys : (r > (1 << 20) ? (1 << 20) : r));
}

// The kernel brings its split's K and V rows into L2 before its PDL wait, while the rope kernel
// runs: Qwen3-30B-A3B decode 460.3 -> 475.4 tokens/s at batch 1 (RESULTS.md, session 15).
// FASTAWQ_ATTN_PREFETCH=0 turns it off (an A/B switch, read at each call like the one above).
bool prefetch_kv() {
  const char* v = std::getenv("FASTAWQ_ATTN_PREFETCH");
  return !(v != nullptr && v[0] == '0' && v[1] == '\0');
}

// FASTAWQ_ATTN_CLUSTER=1 / 0 (read at each call like the ones above; sm_90 only) forces it: the
// splits of a (row, KV head) run as clusters of up to kDecodeMaxCluster that combine in distributed
// shared memory where the working splits fit in one (decode_attention.cu). Returns the cluster
// size (0: off); the caller rounds the splits down to a multiple of it.
// Unset: on where rows x KV heads <= kClusterMaxWork. H200, session 18 (RESULTS.md): decode +1.4 % on
// Qwen3-30B-A3B at batch 1 (4 KV heads), +0.4 / +0.5 % on the Llama-3-8B shape at batch 1 / 2 (8 KV
// heads), but -4.5 % at batch 4 and 8 there.
constexpr int kClusterMaxWork = 16;
int attention_cluster(int splits, int64_t work) {
  const int sw = env_switch("FASTAWQ_ATTN_CLUSTER");
  if (!(sw < 0 ? work <= kClusterMaxWork : sw == 1) || splits < 2) return 0;
  if (at::cuda::getCurrentDeviceProperties()->major < 9) return 0;
  return std::min(splits, kDecodeMaxCluster);
}

// The rope form's extra inputs (rope_decode_attention), checked by its entry.
struct RopeInputs {
  const at::Tensor& positions;
  const at::Tensor& cos;
  const at::Tensor& sin;
  const std::optional<at::Tensor>& q_norm;
  const std::optional<at::Tensor>& k_norm;
  double eps;
};

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& lens,
         double scale, at::Tensor& out, const RopeInputs* rope = nullptr) {
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t s = k_cache.size(1), hkv = k_cache.size(2);
  if (b == 0 || hq == 0) return;
  const int64_t group = hq / hkv;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int splits = decode_attention_splits(static_cast<int>(b * hkv), static_cast<int>(s), sms);
  const int cluster = attention_cluster(splits, b * hkv);
  if (cluster > 0) splits = splits / cluster * cluster;

  DecodeAttentionArgs a{};
  a.dtype = out.scalar_type() == at::kHalf ? HalfType::kHalf : HalfType::kBFloat16;  // q's, or the caches'
  a.qkv_f32 = q.scalar_type() == at::kFloat;  // the rope form's entry admits it there only
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.lens = lens.data_ptr<int>();
  a.out = out.data_ptr();
  at::Tensor part_acc, part_ml;
  if (splits > 1) {
    // From the caching allocator (the graph's pool under capture), freed in stream order.
    const auto f32 = q.options().dtype(at::kFloat);
    part_acc = at::empty({b * hkv * splits * group * d}, f32);
    part_ml = at::empty({b * hkv * splits * group * 2}, f32);
    a.part_acc = part_acc.data_ptr<float>();
    a.part_ml = part_ml.data_ptr<float>();
    // Zeroed arrival counters, one per (row, KV head); the kernel re-arms them.
    a.counters = zeroed_counters(Workspace::kAttentionCounters, q.device(), b * hkv);
  }
  a.q_sb = q.stride(0);
  a.q_sh = q.stride(1);
  a.k_sb = k_cache.stride(0);
  a.k_ss = k_cache.stride(1);
  a.k_sh = k_cache.stride(2);
  a.v_sb = v_cache.stride(0);
  a.v_ss = v_cache.stride(1);
  a.v_sh = v_cache.stride(2);
  a.o_sb = out.stride(0);
  a.o_sh = out.stride(1);
  a.batch = static_cast<int>(b);
  a.seq_cap = static_cast<int>(s);
  a.hkv = static_cast<int>(hkv);
  a.group = static_cast<int>(group);
  a.head_dim = static_cast<int>(d);
  a.splits = splits;
  a.min_split_keys = min_split_keys();
  a.prefetch_kv = prefetch_kv();
  a.cluster = cluster;
  a.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  if (rope != nullptr) {
    a.rope = true;
    a.positions = rope->positions.data_ptr<int>();
    a.rope_cos = rope->cos.data_ptr<float>();
    a.rope_sin = rope->sin.data_ptr<float>();
    a.rope_rows = static_cast<int>(rope->cos.size(0));
    a.q_norm = rope->q_norm ? rope->q_norm->data_ptr() : nullptr;
    a.k_norm = rope->k_norm ? rope->k_norm->data_ptr() : nullptr;
    a.norm_eps = static_cast<float>(rope->eps);
    a.hq = static_cast<int>(hq);
  }
  launch_decode_attention(a, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& lens, double scale) {
  check_inputs(q, k_cache, v_cache, lens);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  run(q, k_cache, v_cache, lens, scale, out);
  return out;
}

void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& lens, double scale, at::Tensor& out) {
  check_inputs(q, k_cache, v_cache, lens);
  // Built only when a check fails (TORCH_CHECK evaluates its message lazily).
  const auto p = [&] { return problem(q, k_cache, v_cache, lens); };
  FASTAWQ_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.device() == q.device(), p(),
                ": out ", shape_str(out), " ", out.scalar_type(), " on ", out.device(), " must match q ",
                shape_str(q), " ", q.scalar_type(), " on ", q.device());
  FASTAWQ_CHECK(vector_friendly(out), p(), ": out (strides ", out.strides(),
                ") needs unit stride in D, other strides that are multiples of 8 and 16-byte alignment");
  FASTAWQ_CHECK(!out.is_alias_of(q) && !out.is_alias_of(k_cache) && !out.is_alias_of(v_cache), p(),
                ": out must not share memory with q or the caches (other blocks still read them)");
  const c10::cuda::CUDAGuard guard(q.device());
  run(q, k_cache, v_cache, lens, scale, out);
}

at::Tensor rope_decode_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                 const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& lens,
                                 const std::optional<at::Tensor>& q_norm_weight,
                                 const std::optional<at::Tensor>& k_norm_weight, double eps, int64_t num_heads,
                                 double scale) {
  const auto p = [&] {
    return cat("rope_decode_attention (qkv ", shape_str(qkv), ", positions ", shape_str(positions), ", cos ",
               shape_str(cos), ", k_cache ", shape_str(k_cache), ", lens ", shape_str(lens), ", num_heads ",
               num_heads, ")");
  };
  FASTAWQ_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && k_cache.dim() == 4, p(),
                ": expected qkv [B, 1, (HQ + 2 HKV) D] (one decode token a row) and caches [B', S, HKV, D]");
  const int64_t b = qkv.size(0), hkv = k_cache.size(2), d = k_cache.size(3);
  FASTAWQ_CHECK(num_heads > 0 && qkv.size(2) == (num_heads + 2 * hkv) * d, p(), ": qkv's width ", qkv.size(2),
                " is not (", num_heads, " + 2 x ", hkv, ") heads of ", d);
  FASTAWQ_CHECK(qkv.stride(2) == 1, p(), ": qkv needs unit stride in its last dimension");
  // qkv in fp32: the QKV projection's sums (awq_gemv_packed_sums; FASTAWQ_QKV_SUMS), rounded to the
  // caches' dtype as the kernel reads them. Everything else then takes the caches' dtype.
  const bool sums = qkv.scalar_type() == at::kFloat;
  const at::ScalarType dtype = sums ? k_cache.scalar_type() : qkv.scalar_type();
  // q: the first num_heads heads of each qkv row, as decode_attention reads them.
  const at::Tensor q = qkv.select(1, 0).view({b, num_heads + 2 * hkv, d}).narrow(1, 0, num_heads);
  check_inputs(q, k_cache, v_cache, lens, sums);
  FASTAWQ_CHECK(positions.scalar_type() == at::kInt && positions.numel() == b && positions.is_contiguous() &&
                    positions.device() == qkv.device(),
                p(), ": positions must be a contiguous int32 [B] or [B, 1] tensor on ", qkv.device(), ", got ",
                positions.scalar_type(), " on ", positions.device());
  FASTAWQ_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.size(0) > 0 && cos.size(1) == d && cos.is_contiguous() &&
                    sin.is_contiguous() && aligned16(cos) && aligned16(sin) && cos.device() == qkv.device() &&
                    sin.device() == qkv.device(),
                p(), ": cos and sin must be contiguous, 16-byte aligned fp32 [S, ", d, "] tables on ", qkv.device(),
                ", got ", shape_str(cos), " ", cos.scalar_type(), " and ", shape_str(sin), " ", sin.scalar_type());
  FASTAWQ_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(), p(),
                ": q_norm_weight and k_norm_weight go together");
  for (const auto* w : {&q_norm_weight, &k_norm_weight}) {
    if (!w->has_value()) continue;
    const at::Tensor& t = **w;
    FASTAWQ_CHECK(t.dim() == 1 && t.size(0) == d && t.scalar_type() == dtype && t.is_contiguous() &&
                      aligned16(t) && t.device() == qkv.device(),
                  p(), ": the q/k norm weights must be contiguous, aligned [", d, "] tensors in ",
                  sums ? "the caches' dtype " : "qkv's dtype ", dtype, ", got ", shape_str(t), " ", t.scalar_type());
  }
  FASTAWQ_CHECK(!k_cache.is_alias_of(qkv) && !v_cache.is_alias_of(qkv), p(),
                ": the caches must not share memory with qkv (the kernel writes them while reading it)");
  const c10::cuda::CUDAGuard guard(qkv.device());
  at::Tensor out = at::empty({b, num_heads, d}, qkv.options().dtype(dtype));
  const RopeInputs rope{positions, cos, sin, q_norm_weight, k_norm_weight, eps};
  run(q, k_cache, v_cache, lens, scale, out, &rope);
  return out;
}

}  // namespace fastawq
