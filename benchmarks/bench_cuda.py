"""Times fastawq's compiled W4A16 kernels against torch.matmul fp16 (cuBLAS) in the same run.

Each timing captures `reps` calls in one CUDA graph, each call on its own weight buffer (so no
call is served from the 60 MB L2), and reports replay time / reps, median of `replays` replays.

    python benchmarks/bench_cuda.py [--ms 1,16,64] [--variants auto,gemv] [--json out.json]

Variants are the kernel names of `awq_gemm(..., kernel=)`; each is timed where
`awq_gemm_declines` says it takes the problem.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from fastawq import _ext, reference
from timing import geomean, print_table, time_graph, w4_bytes

KERNELS = ("auto", "gemv", "gemv_staged", "mma", "dequant_cublas")
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
COPY_BW = 4268e9  # measured device-to-device copy bandwidth on the H200, bytes/s


def make_weights(k: int, n: int, g: int, copies: int, dtype=torch.float16):
    qw = torch.randint(-(2**31), 2**31 - 1, (copies, k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-(2**31), 2**31 - 1, (copies, k // g, n // 8), dtype=torch.int32, device="cuda")
    s = (torch.rand(copies, k // g, n, device="cuda") * 0.02 + 0.002).to(dtype)
    return qw, s, qz


def bench_shape(k: int, n: int, ms: list[int], g: int, keep: set[str] | None = None) -> list[dict]:
    copies = max(2, min(16, math.ceil(240e6 / (k * n // 2))))  # > 4x L2 of weight bytes per graph
    qw, s, qz = make_weights(k, n, g, copies)
    wf = torch.randn(copies, k, n, device="cuda", dtype=torch.float16)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        # Sanity: the kernel is right on these weights before it is timed.
        got = torch.ops.fastawq.awq_gemm(x, qw[0], s[0], qz[0], g, None).float()
        ref = reference.awq_gemm(x.float(), qw[0], s[0].float(), qz[0], g)
        rel = ((got - ref).norm() / ref.norm()).item()
        reps = copies
        t_cublas = time_graph(lambda i: torch.matmul(x, wf[i]), reps)
        variants = {
            name: (lambda i, name=name: torch.ops.fastawq.awq_gemm(x, qw[i], s[i], qz[i], g, None, name))
            for name in KERNELS
            if (keep is None or name in keep) and not torch.ops.fastawq.awq_gemm_declines(name, m, n, k, g)
        }
        nbytes = w4_bytes(m, k, n, g)
        for name, fn in variants.items():
            t = time_graph(fn, reps)
            rows.append(dict(k=k, n=n, m=m, g=g, variant=name, us=t, cublas_us=t_cublas, speedup=t_cublas / t,
                             gbps=nbytes / t / 1e3, roofline_us=nbytes / COPY_BW * 1e6,
                             tflops=2 * m * k * n / t / 1e6, rel_err=rel))
        del x
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated kernel names to time (default: all of {', '.join(KERNELS)})")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if not _ext.is_loaded():
        raise SystemExit(f"fastawq._C is not loaded: {_ext.status()}")
    torch.manual_seed(0)
    rows = []
    for k, n in SHAPES:
        keep = set(args.variants.split(",")) if args.variants else None
        if keep and keep - set(KERNELS):
            raise SystemExit(f"--variants: unknown {sorted(keep - set(KERNELS))}; expected {KERNELS}")
        rows += bench_shape(k, n, ms, args.group, keep)
        torch.cuda.empty_cache()
    print_table(rows, [("K", "k", 6, ""), ("N", "n", 6, ""), ("M", "m", 5, ""), ("variant", "variant", 14, ""),
                       ("us", "us", 9, ".2f"), ("cuBLAS", "cublas_us", 9, ".2f"), ("x", "speedup", 6, ".2f"),
                       ("GB/s", "gbps", 7, ".0f"), ("floor us", "roofline_us", 8, ".2f"),
                       ("TFLOP/s", "tflops", 7, ".1f"), ("relerr", "rel_err", 8, ".1e")])
    print("\ngeomean speed-up over cuBLAS fp16 (4 Llama-3-8B shapes), by variant and M:")
    print(f"{'variant':>12} " + " ".join(f"{m:>6}" for m in ms))
    for v in sorted({r["variant"] for r in rows}):
        cells = []
        for m in ms:
            sel = [r["speedup"] for r in rows if r["m"] == m and r["variant"] == v]
            cells.append(f"{geomean(sel):>6.2f}" if len(sel) == len(SHAPES) else f"{'-':>6}")
        print(f"{v:>12} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
