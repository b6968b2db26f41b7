"""An MoE block's routing at decode, launch against launch, GPU: the compiled fastawq::moe_route
(norm + router + top-k, or router + top-k) against the Triton paths ops.add_rms_norm_route and
ops.route take, at the Qwen3-30B-A3B (E=128, top-8, H=2048) and Mixtral-8x7B (E=8, top-2,
H=4096) routers, 1 and 16 tokens, fp16.

Each number is the best of 5 replays of a CUDA graph of 50 back-to-back calls on the same inputs
(so each call's programmatic-dependent-launch wait on the one before is inside the time), in
microseconds per call.

    python benchmarks/bench_route.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from fastawq import backend
from fastawq.ops import moe as ops_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing.py, when loaded by path (tests)
from timing import best_us  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 2048, 8), "mixtral-8x7b": (8, 4096, 2)}  # E, H, top-k


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (µs a call), for RESULTS.md."""
    keys = [k for k in rows[0] if k not in ("shape", "T")] if rows else []
    lines = ["| router, tokens | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {r['shape']}, {r['T']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ts", default="1,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not hasattr(torch.ops.fastawq, "moe_route"):
        raise SystemExit("bench_route needs a CUDA device and fastawq._C with moe_route")
    rows = []
    norm_before = backend.NORM_ROUTE_FUSED
    for name, (e, h, k) in SHAPES.items():
        for t in (int(v) for v in args.ts.split(",")):
            dev, f16 = "cuda", torch.float16
            x, res = torch.randn(t, h, device=dev, dtype=f16), torch.randn(t, h, device=dev, dtype=f16)
            nw, w = torch.randn(h, device=dev, dtype=f16), torch.randn(e, h, device=dev, dtype=f16) * 0.02
            row = {"shape": name, "T": t}
            row["cuda norm+route"] = best_us(
                lambda: torch.ops.fastawq.moe_route(x, res, nw, 1e-6, 0.0, w, k, True, "softmax", None, 1.0))
            row["cuda route"] = best_us(
                lambda: torch.ops.fastawq.moe_route(x, None, None, 0.0, 0.0, w, k, True, "softmax", None, 1.0))
            for fused in (True, False):  # Triton: the norm in the routing launch, or its own launch first
                backend.NORM_ROUTE_FUSED = fused
                row["triton norm+route" if fused else "triton norm, route"] = best_us(
                    lambda: ops_moe.add_rms_norm_route(x, res, nw, 1e-6, 0.0, w, k, backend="triton"))
            row["triton route"] = best_us(lambda: ops_moe.route(x, w, k, backend="triton"))
            rows.append(row)
            print(name, "T", t, " ".join(f"{key}: {v:.2f}us" for key, v in row.items() if key not in ("shape", "T")),
                  flush=True)
    backend.NORM_ROUTE_FUSED = norm_before
    print(table(rows), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        with open(os.path.join(args.out, "bench_route.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
