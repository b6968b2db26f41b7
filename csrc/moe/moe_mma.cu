// moe_mma's entry: the two launches on the AWQ layout (their instances here), or the persistent
// form's (moe_mma_persistent.cu), or the packed layout's (moe_mma_packed.cu); three translation
// units so a build compiles them in parallel. The kernels' design: moe_mma.cuh.
#include "moe/moe_mma.cuh"

namespace fastawq {

void launch_moe_mma(const MoeMmaArgs& a, cudaStream_t stream) {
  if (a.packed) return launch_moe_mma_packed(a, stream);
  if (a.persistent_blocks > 0) return launch_moe_mma_persistent(a, stream);
  dispatch_instance<true>(a, [&]<typename T, typename Id, int ACT, int NT>() {
    launch_two<T, Id, ACT, NT, false>(a, stream);
  });
}

}  // namespace fastawq
