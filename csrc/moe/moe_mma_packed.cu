// moe_mma's instances on the experts in the packed layout (moe_mma_packed_w4; run_work_packed in
// moe_mma.cuh), a translation unit of their own so they compile beside moe_mma.cu's.
#include "moe/moe_mma.cuh"

namespace fastawq {

void launch_moe_mma_packed(const MoeMmaArgs& a, cudaStream_t stream) {
  dispatch_instance(a, [&]<typename T, typename Id, int ACT, int NT>() {
    if (a.packed_chunks == 2) return launch_two<T, Id, ACT, NT, true, 2>(a, stream);
    launch_two<T, Id, ACT, NT, true, 4>(a, stream);
  });
}

}  // namespace fastawq
