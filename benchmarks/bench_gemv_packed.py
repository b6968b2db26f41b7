"""The decode kernel on the repacked layout (gemv_packed) against cuBLAS and the current kernels.

One run, CUDA-graph timed as in ../shared/TARGETS.md: each timing captures one call per weight copy
(16 copies, so no call is served from L2), median of 10 replays. Per (shape, M, dtype): cuBLAS in the
activation dtype, the current compiled kernels that take the problem (gemv at M = 1, gemv_staged at
M <= 2, mma), and gemv_packed. GB/s use the AWQ byte count (benchmarks/timing.w4_bytes); the packed
layout reads 1.5 bytes more per (group, column) for its 16-bit zeros.

    python benchmarks/bench_gemv_packed.py --out gemv_packed.json     # from the repository root
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import geomean, print_table, time_graph, w4_bytes  # noqa: E402

from fastawq import _ext, reference  # noqa: E402
from fastawq.ops.repack import awq_gemv_repack  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
CURRENT = ("gemv", "gemv_staged", "mma")
COPIES = 16


def bench_shape(k: int, n: int, g: int, ms: list[int], dtype: torch.dtype) -> list[dict]:
    qw = torch.randint(-(2**31), 2**31 - 1, (COPIES, k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-(2**31), 2**31 - 1, (COPIES, k // g, n // 8), dtype=torch.int32, device="cuda")
    s = (torch.rand(COPIES, k // g, n, device="cuda") * 0.02 + 0.002).to(dtype)
    packed = [awq_gemv_repack(qw[i], s[i], qz[i], g) for i in range(COPIES)]
    wf = torch.randn(COPIES, k, n, device="cuda", dtype=dtype)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = reference.awq_gemm(x.float(), qw[0], s[0].float(), qz[0], g)
        got = torch.ops.fastawq.awq_gemv_packed(x, packed[0][0], packed[0][1], n, g, None).float()
        rel = ((got - ref).norm() / ref.norm()).item()  # sanity on these very weights
        t_cublas = time_graph(lambda i: torch.matmul(x, wf[i]), COPIES)
        variants = {"gemv_packed": lambda i: torch.ops.fastawq.awq_gemv_packed(x, *packed[i], n, g, None)}
        for name in CURRENT:
            if not torch.ops.fastawq.awq_gemm_declines(name, m, n, k, g):
                variants[name] = lambda i, name=name: torch.ops.fastawq.awq_gemm(x, qw[i], s[i], qz[i], g, None, name)
        nbytes = w4_bytes(m, k, n, g)
        for name, fn in variants.items():
            t = time_graph(fn, COPIES)
            rows.append(dict(k=k, n=n, m=m, g=g, dtype=str(dtype).removeprefix("torch."), variant=name, us=t,
                             cublas_us=t_cublas, speedup=t_cublas / t, gbps=nbytes / t / 1e3,
                             packed_rel_err=rel))
    del qw, qz, s, packed, wf
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if not _ext.has_op("awq_gemv_packed") or not torch.cuda.is_available():
        raise SystemExit(f"needs CUDA and fastawq._C with awq_gemv_packed: {_ext.status()}")
    ms = [int(v) for v in args.ms.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    torch.manual_seed(0)
    t0 = time.time()
    rows = []
    for dtype in dtypes:
        for k, n in SHAPES:
            rows += bench_shape(k, n, args.group, ms, dtype)
    print_table(rows, [("dtype", "dtype", 8, ""), ("K", "k", 6, ""), ("N", "n", 6, ""), ("M", "m", 3, ""),
                       ("variant", "variant", 12, ""), ("us", "us", 8, ".2f"), ("cuBLAS", "cublas_us", 8, ".2f"),
                       ("x", "speedup", 6, ".2f"), ("GB/s", "gbps", 6, ".0f"), ("relerr", "packed_rel_err", 8, ".1e")])
    print("\ngeomean speed-up over cuBLAS (same dtype), 4 Llama-3-8B shapes; packed / best current:")
    print(f"{'dtype':>8} {'variant':>12} " + " ".join(f"{'M=' + str(m):>6}" for m in ms))
    summary = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        for v in ("gemv_packed", *CURRENT):
            cells = []
            for m in ms:
                sel = [r["speedup"] for r in rows if r["m"] == m and r["variant"] == v and r["dtype"] == dtype]
                gm = geomean(sel) if len(sel) == len(SHAPES) else None
                summary[f"{dtype}/{v}/{m}"] = gm
                cells.append(f"{gm:>6.2f}" if gm else f"{'-':>6}")
            print(f"{dtype:>8} {v:>12} " + " ".join(cells))
        ratios = []
        for m in ms:
            cur = [summary[f"{dtype}/{v}/{m}"] for v in CURRENT if summary.get(f"{dtype}/{v}/{m}")]
            new = summary.get(f"{dtype}/gemv_packed/{m}")
            ratios.append(f"{new / max(cur):>6.2f}" if new and cur else f"{'-':>6}")
        print(f"{dtype:>8} {'new/best':>12} " + " ".join(ratios))
    print(f"\n{time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "geomean": summary}, f, indent=1)


if __name__ == "__main__":
    main()
