"""One M=1 call of each GEMV kernel (register, staged) per Llama-3-8B shape, for Nsight Compute
(GPU only):

    ncu --clock-control none --kernel-name regex:awq_gemv --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats python benchmarks/profile_gemv.py
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from conftest import random_awq, random_input  # noqa: E402

from fastawq import _ext  # noqa: E402

if not _ext.is_loaded():
    raise SystemExit(f"fastawq._C is not loaded: {_ext.status()}")
for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
    qw, s, qz = random_awq(k, n, 128, "cuda", torch.float16, seed=k + n)
    x = random_input((1, k), "cuda", torch.float16)
    for kernel in ("gemv", "gemv_staged"):
        torch.ops.fastawq.awq_gemm(x, qw, s, qz, 128, None, kernel)
torch.cuda.synchronize()
print("profile_gemv: done")
