// Host side of the CPU W4 GEMM: the load-time repack, argument checks, the choice of kernel by
// CPU features at run time, threading over column blocks, and the ops' registration. Compiled
// without ISA flags, so this file (and the module) loads on any x86-64 and on other CPUs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"
#include "cpu/awq_cpu_kernels.h"
#include "cpu/awq_cpu_ops.h"

namespace fastawq {
namespace cpu {

void gemm_blocks_scalar(const GemmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  const int64_t groups = a.k / a.group, octets = a.group / kStepK;
  for (int64_t nb = b0; nb < b1; ++nb) {
    const uint32_t* w = a.w + nb * (a.k / kStepK) * kBlockN;
    const int64_t n0 = nb * kBlockN, cols = std::min<int64_t>(kBlockN, a.n - n0);
    for (int64_t m = m0; m < m1; ++m) {
      float y[kBlockN] = {};
      for (int64_t g = 0; g < groups; ++g) {
        float acc[kBlockN] = {};
        for (int64_t o = g * octets; o < (g + 1) * octets; ++o) {
          for (int p = 0; p < 8; ++p) {
            const int64_t k = o * kStepK + kRowOfNibble[p];
            const float xv = a.x_dtype == Dtype::kFloat32
                                 ? static_cast<const float*>(a.x)[m * a.x_stride + k]
                                 : bf16_to_float(static_cast<const uint16_t*>(a.x)[m * a.x_stride + k]);
            for (int c = 0; c < kBlockN; ++c) acc[c] += xv * static_cast<float>((w[o * kBlockN + c] >> (4 * p)) & 0xf);
          }
        }
        const float xs = a.xsum[m * groups + g];
        for (int c = 0; c < kBlockN; ++c) {
          const float z = static_cast<float>(a.zeros16[(nb * groups + g) * kBlockN + c]) - 16.0f;
          y[c] += a.scales[(nb * groups + g) * kBlockN + c] * (acc[c] - z * xs);
        }
      }
      store_row(a, m, n0, cols, y);
    }
  }
}

namespace {

struct Kernels {
  BlockKernel avx512bf16 = kernel_avx512bf16();
  BlockKernel avx512 = kernel_avx512();
  BlockKernel avx2 = kernel_avx2();
  BlockKernel avx2_int8 = kernel_avx2_int8();
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

// The kernel for x's dtype: the named one (tests and benchmarks force each), or the best one this
// CPU runs. bf16 x without AVX512-BF16 is widened to fp32 by the caller (x_fp32 = true).
BlockKernel choose(const std::string& isa, bool x_bf16, bool& x_fp32) {
  const Kernels& k = kernels();
  x_fp32 = false;
  if (isa == "int8" || isa == "avx2_int8") {
    FASTAWQ_CHECK(k.avx2_int8 != nullptr, "awq_cpu_gemm: this CPU (or build) has no int8-activation (AVX2) kernel");
    return k.avx2_int8;
  }
  if (isa == "scalar") return &gemm_blocks_scalar;
  if (isa == "avx512bf16" || (isa == "auto" && x_bf16 && k.avx512bf16)) {
    FASTAWQ_CHECK(x_bf16, "awq_cpu_gemm: the avx512bf16 kernel takes bf16 activations");
    FASTAWQ_CHECK(k.avx512bf16 != nullptr, "awq_cpu_gemm: this CPU (or build) has no AVX512-BF16 kernel");
    return k.avx512bf16;
  }
  BlockKernel fp32 = nullptr;
  if (isa == "avx512") {
    FASTAWQ_CHECK(k.avx512 != nullptr, "awq_cpu_gemm: this CPU (or build) has no AVX-512 kernel");
    fp32 = k.avx512;
  } else if (isa == "avx2") {
    FASTAWQ_CHECK(k.avx2 != nullptr, "awq_cpu_gemm: this CPU (or build) has no AVX2 kernel");
    fp32 = k.avx2;
  } else {
    FASTAWQ_CHECK(isa == "auto", "awq_cpu_gemm: isa must be auto, avx512bf16, avx512, avx2, scalar, int8 or avx2_int8, got ", isa);
    fp32 = k.avx512 ? k.avx512 : k.avx2;
    if (fp32 == nullptr) return &gemm_blocks_scalar;
  }
  x_fp32 = x_bf16;
  return fp32;
}

// x rows -> int8 per block of `block` rows of K (scale = max|x| / 127, q = round(x / scale),
// ties to even), row j of each octet at byte kRowOfNibble[j] (GemmArgs); xsum[r, g] = sum over group g of q * scale.
template <typename Load>
void quantize_rows(Load load, int64_t m, int64_t k, int64_t g, int64_t block, int8_t* xq, float* xq_scale,
                   float* xsum) {
  const int64_t nblk = k / block, per_group = g / block;
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < k; ++j) row[j] = load(r, j);
      double gsum = 0.0;
      for (int64_t b = 0; b < nblk; ++b) {
        float amax = 0.0f;
        for (int64_t j = b * block; j < (b + 1) * block; ++j) amax = std::max(amax, std::fabs(row[j]));
        const float scale = amax / 127.0f;
        int32_t qsum = 0;
        for (int64_t j = b * block; j < (b + 1) * block; ++j) {
          const float q = scale > 0.0f ? std::nearbyint(row[j] / scale) : 0.0f;
          const int8_t qi = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
          xq[r * k + (j & ~int64_t{7}) + kRowOfNibble[j & 7]] = qi;
          qsum += qi;
        }
        xq_scale[r * nblk + b] = scale;
        gsum += static_cast<double>(scale) * qsum;
        if ((b + 1) % per_group == 0) {
          xsum[r * (k / g) + b / per_group] = static_cast<float>(gsum);
          gsum = 0.0;
        }
      }
    }
  });
}

void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  FASTAWQ_CHECK(t.device().is_cpu(), op, ": ", name, " ", shape_str(t), " must be on the CPU, got ", t.device());
}

}  // namespace
}  // namespace cpu

std::vector<std::string> awq_cpu_isas() {
  const cpu::Kernels& k = cpu::kernels();
  std::vector<std::string> out;
  if (k.avx512bf16) out.emplace_back("avx512bf16");
  if (k.avx512) out.emplace_back("avx512");
  if (k.avx2) out.emplace_back("avx2");
  out.emplace_back("scalar");
  if (k.avx2_int8) out.emplace_back("avx2_int8");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> awq_cpu_repack(const at::Tensor& qweight, const at::Tensor& scales,
                                                              const at::Tensor& qzeros, int64_t group_size) {
  using namespace cpu;
  const char* op = "awq_cpu_repack";
  check_cpu(op, "qweight", qweight);
  check_cpu(op, "scales", scales);
  check_cpu(op, "qzeros", qzeros);
  FASTAWQ_CHECK(qweight.dim() == 2 && scales.dim() == 2 && qzeros.dim() == 2, op,
                ": expected 2-D qweight [K, N/8], scales [K/G, N], qzeros [K/G, N/8]; got qweight ",
                shape_str(qweight), ", scales ", shape_str(scales), ", qzeros ", shape_str(qzeros));
  FASTAWQ_CHECK(qweight.scalar_type() == at::kInt && qzeros.scalar_type() == at::kInt, op,
                ": qweight and qzeros must be int32, got ", qweight.scalar_type(), " and ", qzeros.scalar_type());
  FASTAWQ_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16 ||
                    scales.scalar_type() == at::kFloat,
                op, ": scales must be fp16, bf16 or fp32, got ", scales.scalar_type());
  const int64_t k = qweight.size(0), n = qweight.size(1) * 8, g = group_size;
  FASTAWQ_CHECK(g > 0 && g % kStepK == 0 && k % g == 0, op, ": group_size=", g, " must be a positive multiple of ",
                kStepK, " that divides K=", k, " (qweight ", shape_str(qweight), ")");
  const int64_t groups = k / g;
  FASTAWQ_CHECK(scales.size(0) == groups && scales.size(1) == n && qzeros.size(0) == groups && qzeros.size(1) == n / 8,
                op, ": inconsistent shapes for K=", k, ", N=", n, ", group_size=", g, ": expected scales [", groups,
                ", ", n, "] and qzeros [", groups, ", ", n / 8, "], got scales ", shape_str(scales), " and qzeros ",
                shape_str(qzeros));
  const int64_t nblocks = (n + kBlockN - 1) / kBlockN;
  auto w = at::zeros({nblocks, k / kStepK, kBlockN}, qweight.options());
  auto s_out = at::zeros({nblocks, groups, kBlockN}, scales.options().dtype(at::kFloat));
  auto z_out = at::empty({nblocks, groups, kBlockN}, qzeros.options().dtype(at::kByte)).fill_(16);
  const auto q = qweight.contiguous();
  const auto zq = qzeros.contiguous();
  const auto s32 = scales.to(at::kFloat).contiguous();
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(q.const_data_ptr<int32_t>());
  const uint32_t* zp = reinterpret_cast<const uint32_t*>(zq.const_data_ptr<int32_t>());
  const float* sp = s32.const_data_ptr<float>();
  uint32_t* wp = reinterpret_cast<uint32_t*>(w.mutable_data_ptr<int32_t>());
  float* so = s_out.mutable_data_ptr<float>();
  uint8_t* zo = z_out.mutable_data_ptr<uint8_t>();
  // AWQ: column c of each group of 8 sits in nibble kNibbleOfRow[c] (AWQ_REVERSE_ORDER has the
  // same values); here: row r of each octet sits in nibble kNibbleOfRow[r].
  at::parallel_for(0, k / kStepK, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      for (int r = 0; r < kStepK; ++r) {
        const uint32_t* row = qp + (o * kStepK + r) * (n / 8);
        for (int64_t c = 0; c < n; ++c) {
          const uint32_t nib = (row[c / 8] >> (4 * kNibbleOfRow[c % 8])) & 0xf;
          wp[((c / kBlockN) * (k / kStepK) + o) * kBlockN + c % kBlockN] |= nib << (4 * kNibbleOfRow[r]);
        }
      }
    }
  });
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t at = ((c / kBlockN) * groups + gi) * kBlockN + c % kBlockN;
      so[at] = sp[gi * n + c];
      zo[at] = static_cast<uint8_t>(16 + ((zp[gi * (n / 8) + c / 8] >> (4 * kNibbleOfRow[c % 8])) & 0xf));
    }
  }
  return {w, s_out, z_out};
}

// x [M, K] fp32|bf16 · w [NB, K/8, 64] · scales [NB, K/G, 64] fp32 · zeros16 [NB, K/G, 64] uint8 · bias [N] -> [M, N]
at::Tensor awq_cpu_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros16,
                        int64_t group_size, int64_t n, const std::optional<at::Tensor>& bias, const std::string& isa) {
  using namespace cpu;
  const char* op = "awq_cpu_gemm";
  check_cpu(op, "x", x);
  FASTAWQ_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", shape_str(x));
  FASTAWQ_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                ": x must be fp32 or bf16, got ", x.scalar_type(), " (x ", shape_str(x), ")");
  FASTAWQ_CHECK(w.dim() == 3 && w.size(2) == kBlockN && w.scalar_type() == at::kInt && w.is_contiguous() &&
                    w.device().is_cpu(),
                op, ": w must be a contiguous CPU int32 [N/64, K/8, 64] from awq_cpu_repack, got ", w.scalar_type(),
                " ", shape_str(w));
  const int64_t m = x.size(0), k = x.size(1), nblocks = w.size(0), g = group_size;
  FASTAWQ_CHECK(w.size(1) * kStepK == k, op, ": x ", shape_str(x), " has K=", k, " but w ", shape_str(w), " has K=",
                w.size(1) * kStepK);
  FASTAWQ_CHECK(g > 0 && g % kStepK == 0 && k % g == 0, op, ": group_size=", g, " must be a multiple of ", kStepK,
                " that divides K=", k);
  FASTAWQ_CHECK(n > (nblocks - 1) * kBlockN && n <= nblocks * kBlockN, op, ": N=", n, " does not match w ", shape_str(w));
  const int64_t groups = k / g;
  FASTAWQ_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu() &&
                    scales.dim() == 3 && scales.size(0) == nblocks && scales.size(1) == groups &&
                    scales.size(2) == kBlockN,
                op, ": scales must be a contiguous CPU fp32 [", nblocks, ", ", groups, ", ", kBlockN, "], got ",
                scales.scalar_type(), " ", shape_str(scales));
  FASTAWQ_CHECK(zeros16.scalar_type() == at::kByte && zeros16.is_contiguous() && zeros16.device().is_cpu() &&
                    zeros16.sizes() == scales.sizes(),
                op, ": zeros16 must be a contiguous CPU uint8 ", shape_str(scales), ", got ", zeros16.scalar_type(),
                " ", shape_str(zeros16));
  at::Tensor bias32;
  if (bias.has_value()) {
    check_cpu(op, "bias", *bias);
    FASTAWQ_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias ", shape_str(*bias), " must be [", n, "]");
    bias32 = bias->to(at::kFloat).contiguous();
  }

  bool widen = false;
  const BlockKernel kernel = choose(isa, x.scalar_type() == at::kBFloat16, widen);
  const bool int8 = kernel == kernels().avx2_int8;
  at::Tensor xk = widen ? x.to(at::kFloat) : x;
  if (xk.stride(1) != 1 || (m > 1 && xk.stride(0) < k)) xk = xk.contiguous();
  const bool x_bf16 = xk.scalar_type() == at::kBFloat16;
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;

  std::vector<float> xsum(static_cast<size_t>(m * groups));
  std::vector<int8_t> xq;
  std::vector<float> xq_scale;
  const int64_t xq_block = g % 32 == 0 ? 32 : g % 16 == 0 ? 16 : 8;
  if (int8) {
    // x quantized once for every column block (and the zero-point fold's group sums of it).
    xq.resize(static_cast<size_t>(m * k));
    xq_scale.resize(static_cast<size_t>(m * (k / xq_block)));
    const int64_t stride = xk.stride(0);
    if (x_bf16) {
      const uint16_t* xp = reinterpret_cast<const uint16_t*>(xk.const_data_ptr<at::BFloat16>());
      quantize_rows([&](int64_t r, int64_t j) { return bf16_to_float(xp[r * stride + j]); }, m, k, g, xq_block,
                    xq.data(), xq_scale.data(), xsum.data());
    } else {
      const float* xp = xk.const_data_ptr<float>();
      quantize_rows([&](int64_t r, int64_t j) { return xp[r * stride + j]; }, m, k, g, xq_block, xq.data(),
                    xq_scale.data(), xsum.data());
    }
  }
  // Per-group sums of x exactly as the kernel reads it (bf16 or fp32), for the zero-point fold.
  for (int64_t r = 0; r < m && !int8; ++r) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      double sum = 0.0;
      if (x_bf16) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(xk.const_data_ptr<at::BFloat16>()) + r * xk.stride(0);
        for (int64_t j = gi * g; j < (gi + 1) * g; ++j) sum += bf16_to_float(row[j]);
      } else {
        const float* row = xk.const_data_ptr<float>() + r * xk.stride(0);
        for (int64_t j = gi * g; j < (gi + 1) * g; ++j) sum += row[j];
      }
      xsum[r * groups + gi] = static_cast<float>(sum);
    }
  }

  GemmArgs args{};
  args.m = m;
  args.k = k;
  args.n = n;
  args.group = g;
  args.w = reinterpret_cast<const uint32_t*>(w.const_data_ptr<int32_t>());
  args.scales = scales.const_data_ptr<float>();
  args.zeros16 = zeros16.const_data_ptr<uint8_t>();
  args.bias = bias32.defined() ? bias32.const_data_ptr<float>() : nullptr;
  args.x = xk.const_data_ptr();
  args.x_stride = xk.stride(0);
  args.x_dtype = x_bf16 ? Dtype::kBFloat16 : Dtype::kFloat32;
  args.xsum = xsum.data();
  args.out = out.mutable_data_ptr();
  args.out_stride = n;
  args.out_dtype = x.scalar_type() == at::kBFloat16 ? Dtype::kBFloat16 : Dtype::kFloat32;
  if (int8) {
    args.xq = xq.data();
    args.xq_scale = xq_scale.data();
    args.xq_block = xq_block;
  }
  // Enough columns per task to pay for waking a thread (~1-2 us): small layers run inline.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, k * kBlockN * m));
  if (widen) {
    // bf16 x through an fp32 kernel: compute in fp32, round once.
    auto out32 = at::empty({m, n}, x.options().dtype(at::kFloat));
    args.out = out32.mutable_data_ptr();
    args.out_dtype = Dtype::kFloat32;
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { kernel(args, b0, b1, 0, m); });
    out.copy_(out32);
    return out;
  }
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) { kernel(args, b0, b1, 0, m); });
  return out;
}

}  // namespace fastawq
