"""One call of each compiled MoE kernel family (moe_gemv_w4, moe_mma_w4) at the Qwen3-30B-A3B and
Mixtral-8x7B expert shapes, 16 tokens (PROFILE_MOE_T), for Nsight Compute (GPU only); moe_mma_w4
with backend.moe_pass_rows' pass (PROFILE_MOE_PASS: 8 or 16 forces one); PROFILE_MOE_SHAPES (comma-separated)
picks the shapes; PROFILE_MOE_LAYOUT=packed runs the same two families on the experts in the packed
layout instead (moe_gemv_packed_w4, moe_mma_packed_w4; "both": the AWQ pair, then the packed pair):

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
from fastawq.ops import repack  # noqa: E402

layout = os.environ.get("PROFILE_MOE_LAYOUT", "awq")
if layout not in ("awq", "packed", "both"):
    raise SystemExit(f"PROFILE_MOE_LAYOUT must be awq, packed or both, got {layout!r}")
need = {"awq": ["moe_mma_w4"], "packed": ["moe_mma_packed_w4"], "both": ["moe_mma_w4", "moe_mma_packed_w4"]}[layout]
for op in need:
    if not _ext.has_op(op):
        raise SystemExit(f"fastawq._C without {op}: {_ext.status()}")
t = int(os.environ.get("PROFILE_MOE_T", "16"))
for name in os.environ.get("PROFILE_MOE_SHAPES", "qwen3-30b-a3b,mixtral-8x7b").split(","):
    e, k, h, i, g = SHAPES[name]
    weights = packed_experts(e, h, i, g, "cuda")
    ids, w = routings(t, e, k, "cuda", 1)[0]
    x = torch.randn(t, h, device="cuda", dtype=torch.float16)
    pass_rows = int(os.environ.get("PROFILE_MOE_PASS", "0")) or backend.moe_pass_rows(t, k, e)
    if layout in ("awq", "both"):
        torch.ops.fastawq.moe_gemv_w4(x, ids, w.float(), *weights, g, "silu")
        torch.ops.fastawq.moe_mma_w4(x, ids, w.float(), *weights, g, "silu", pass_rows)
    if layout in ("packed", "both"):
        packed = repack.awq_experts_repack(*weights, g)
        torch.ops.fastawq.moe_gemv_packed_w4(x, ids, w.float(), *packed, g, "silu")
        torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float(), *packed, g, "silu", pass_rows)
        del packed
    torch.cuda.synchronize()
    del weights
print("profile_moe: done")
