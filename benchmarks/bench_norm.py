"""The fused engine's add + RMSNorm launch alone, GPU: the Triton kernel's forms (FASTAWQ_NORM_FORM
0 / 1 / 2, triton_kernels/norm.py) at the decode shapes of the Llama-3-8B-shaped engine's dense
sums layer: x as o_proj's or the down projection's fp32 sums beside an fp16 residual, H = 4096,
zeroing nothing, the QKV projection's and o_proj's sums (4096 + 6144 a row) or the down
projection's and gate_up's (4096 + 28672 a row), at 1, 16 and 64 rows.

Each number is the best of 5 replays of a CUDA graph of 50 back-to-back calls on the same inputs
(each call's programmatic-dependent-launch wait on the one before is inside the time), in
microseconds per call.

    python benchmarks/bench_norm.py [--rows 1,16,64] [--forms 0,1,2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from fastawq import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timing.py, when loaded by path (tests)
from timing import best_us  # noqa: E402

ZERO_WIDTHS = {"none": 0, "o+qkv": 4096 + 6144, "down+gate_up": 4096 + 28672}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--forms", default="0,1,2")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py needs a CUDA GPU")
    forms = args.forms.split(",")
    h = args.hidden
    print(f"{torch.cuda.get_device_name()}: us a call, add + RMSNorm, x fp32 sums + fp16 residual, H = {h}")
    print("| rows | zeroes | " + " | ".join(f"form {f}" for f in forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    before = os.environ.get("FASTAWQ_NORM_FORM")  # given back at the end
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, h, device="cuda") * 4
        r = torch.randn(rows, h, device="cuda", dtype=torch.float16)
        w = torch.randn(h, device="cuda", dtype=torch.float16)
        for name, zn in ZERO_WIDTHS.items():
            zero = torch.empty(rows, zn, device="cuda") if zn else None
            times, outs = [], []
            for f in forms:
                os.environ["FASTAWQ_NORM_FORM"] = f
                times.append(best_us(lambda: ops.add_rms_norm(x, r, w, 1e-5, backend="triton", zero=zero)))
                if zero is not None:
                    zero.fill_(float("nan"))
                outs.append(ops.add_rms_norm(x, r, w, 1e-5, backend="triton", zero=zero))
                if zero is not None and not torch.equal(zero, torch.zeros_like(zero)):
                    raise SystemExit(f"form {f}: rows {rows}, zero width {zn}: the sums were not zeroed")
            for f, o in zip(forms[1:], outs[1:]):  # every form gives the first form's bits
                if not (torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])):
                    raise SystemExit(f"form {f} differs from form {forms[0]} at rows {rows}, zero width {zn}")
            print(f"| {rows} | {name} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    if before is None:
        os.environ.pop("FASTAWQ_NORM_FORM", None)
    else:
        os.environ["FASTAWQ_NORM_FORM"] = before
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
