"""One call of each compiled MoE kernel family (moe_gemv_w4, moe_mma_w4) at the Qwen3-30B-A3B and
Mixtral-8x7B expert shapes, 16 tokens (PROFILE_MOE_T), for Nsight Compute (GPU only); moe_mma_w4
with backend.moe_pass_rows' pass (PROFILE_MOE_PASS: 8 or 16 forces one); PROFILE_MOE_SHAPES (comma-separated)
picks the shapes:

    ncu --clock-control none --kernel-name regex:moe_ --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats python benchmarks/profile_moe.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import SHAPES, packed_experts, routings  # noqa: E402

from fastawq import _ext, backend  # noqa: E402

if not _ext.has_op("moe_mma_w4"):
    raise SystemExit(f"fastawq._C without moe_mma_w4: {_ext.status()}")
t = int(os.environ.get("PROFILE_MOE_T", "16"))
for name in os.environ.get("PROFILE_MOE_SHAPES", "qwen3-30b-a3b,mixtral-8x7b").split(","):
    e, k, h, i, g = SHAPES[name]
    weights = packed_experts(e, h, i, g, "cuda")
    ids, w = routings(t, e, k, "cuda", 1)[0]
    x = torch.randn(t, h, device="cuda", dtype=torch.float16)
    torch.ops.fastawq.moe_gemv_w4(x, ids, w.float(), *weights, g, "silu")
    pass_rows = int(os.environ.get("PROFILE_MOE_PASS", "0")) or backend.moe_pass_rows(t, k, e)
    torch.ops.fastawq.moe_mma_w4(x, ids, w.float(), *weights, g, "silu", pass_rows)
    torch.cuda.synchronize()
    del weights
print("profile_moe: done")
