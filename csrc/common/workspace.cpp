// The one owner of fastawq's graph-safe zeroed buffers (see workspace.h).
#include "common/workspace.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "common/checks.h"

namespace fastawq {

void* zeroed_workspace(Workspace use, const c10::Device& device, int64_t numel) {
  FASTAWQ_CHECK(device.is_cuda() && device.has_index(), "zeroed_workspace: needs an indexed CUDA device, got ",
                device);
  // Large enough that ordinary shapes never grow it (a grown buffer inside a capture is a new
  // allocation in the graph's pool).
  constexpr int64_t minimum = int64_t{1} << 16;
  const auto dtype = use == Workspace::kGemvSums || use == Workspace::kMoeSums ? at::kFloat : at::kInt;
  static std::mutex mu;
  // Leaked on purpose: destroying the tensors at exit would outlive the CUDA context.
  static auto* buffers = new std::map<std::pair<int, int>, std::vector<at::Tensor>>();
  const std::lock_guard<std::mutex> lock(mu);
  auto& bufs = (*buffers)[{static_cast<int>(use), device.index()}];
  if (bufs.empty() || bufs.back().numel() < numel) {
    bufs.push_back(at::zeros({std::max(numel, minimum)}, at::TensorOptions().dtype(dtype).device(device)));
  }
  return bufs.back().data_ptr();
}

}  // namespace fastawq
