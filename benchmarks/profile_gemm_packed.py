"""awq_gemm_packed (the tensor-core kernel with the batch as the mma's M), or with --kernel wgmma
awq_wgmma_packed (sm_90a), once per M and Llama-3-8B shape, automatic tile, for Nsight Compute (GPU
only):

    ncu --clock-control none --kernel-name regex:awq_gemm_packed --set full \
        python benchmarks/profile_gemm_packed.py [--ms 16,64] [--shapes 4096x4096,14336x4096]
    ncu --clock-control none --kernel-name regex:awq_wgmma_packed --set full \
        python benchmarks/profile_gemm_packed.py --kernel wgmma --ms 64,4096 --tile 0:0
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "tests")
from conftest import random_awq, random_input  # noqa: E402

from fastawq import _ext, ops  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--ms", default="16,64")
parser.add_argument("--shapes", default="4096x4096,14336x4096")
parser.add_argument("--kernel", choices=("gemm", "wgmma"), default="gemm")
parser.add_argument("--tile", default=None, help="gemm: M_TILES:CHUNKS:SPLITS, wgmma: TOKENS:SPLITS (0: automatic)")
args = parser.parse_args()
if not _ext.is_loaded():
    raise SystemExit(f"fastawq._C is not loaded: {_ext.status()}")
op = torch.ops.fastawq.awq_gemm_packed if args.kernel == "gemm" else torch.ops.fastawq.awq_wgmma_packed
tile = [int(v) for v in (args.tile or ("0:0:0" if args.kernel == "gemm" else "0:0")).split(":")]
for shape in args.shapes.split(","):
    k, n = map(int, shape.split("x"))
    qw, s, qz = random_awq(k, n, 128, "cuda", torch.float16, seed=k + n)
    packed = ops.awq_gemv_repack(qw, s, qz, 128)
    for m in map(int, args.ms.split(",")):
        x = random_input((m, k), "cuda", torch.float16)
        op(x, *packed, n, 128, None, *tile)
torch.cuda.synchronize()
print("profile_gemm_packed: done")
