// Whether launches allow programmatic dependent launch (common/pdl.cuh). FASTAWQ_PDL means the same
// here as in triton_kernels/pdl.py; it is read at every launch (a getenv, ~0.1 us), so a process
// can compare both settings (benchmarks/bench_pdl.py) after re-capturing its graphs.
#include "common/pdl.cuh"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <string>

#include "common/checks.h"

namespace fastawq {
namespace {

bool pdl_requested() {
  const char* v = std::getenv("FASTAWQ_PDL");
  if (v == nullptr || *v == '\0') return true;
  const std::string s = v;
  FASTAWQ_CHECK(s == "1" || s == "0" || s == "on" || s == "off" || s == "true" || s == "false",
                "FASTAWQ_PDL must be 1/on/true or 0/off/false, got '", s, "'");
  return s == "1" || s == "on" || s == "true";
}

}  // namespace

bool pdl_enabled() {
  if (!pdl_requested()) return false;
  // Per device: 0 not asked yet, 1 before sm_90, 2 sm_90 or newer.
  static std::array<std::atomic<int>, 64> known{};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= static_cast<int>(known.size())) return false;
  int state = known[dev].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    state = major >= 9 ? 2 : 1;
    known[dev].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || (v[0] != '0' && v[0] != '1') || v[1] != '\0') return -1;
  return v[0] - '0';
}

bool env_flag_on(const char* name) { return env_switch(name) == 1; }

int env_int(const char* name, int lo, int hi, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' && n >= lo && n <= hi ? static_cast<int>(n) : fallback;
}

bool early_weight_loads() { return env_switch("FASTAWQ_GEMV_EARLY_LOADS") != 0; }

int gemv_prefetch_batches(int64_t weight_bytes) {
  constexpr int kDefault = 2;
  constexpr int64_t kL2Budget = int64_t{24} << 20;
  const char* v = std::getenv("FASTAWQ_GEMV_PREFETCH");
  if (v == nullptr || *v == '\0') return kDefault;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 0) return kDefault;
  // A one-wave grid has every block resident at once: more than the default on a layer larger
  // than about half of L2 would evict the first prefetched lines before they are read.
  if (n > kDefault && weight_bytes > kL2Budget) return kDefault;
  return static_cast<int>(std::min<long>(n, 1 << 20));
}

}  // namespace fastawq
