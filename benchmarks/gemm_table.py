"""W4A16 GEMM vs cuBLAS fp16 on the four Llama-3-8B layer shapes, in one run (GPU only).

Method (as ../shared/TARGETS.md): each measurement is 16 calls captured in one CUDA graph, each on
its own weight buffer so none is served from L2; replay time / 16, median of the replays. The
ratio to cuBLAS fp16 is taken within this run, since absolute times drift between machines.

    python benchmarks/gemm_table.py [--backends triton,cuda] [--ms 1,16,64,256,1024,4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from fastawq import _ext, ops, reference
from timing import time_graph, w4_bytes

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
MS = [1, 16, 64, 256, 1024, 4096]
TARGETS = {
    "cuda": {1: 3.0, 16: 2.5, 64: 1.3, 256: 0.9, 1024: 0.95, 4096: 0.95},
    "triton": {1: 1.5, 16: 1.2, 64: 0.9, 256: 0.8, 1024: 0.9, 4096: 0.9},
}
COPIES = 16
GROUP = 128


def run(backends: list[str], ms: list[int], dtype=torch.float16) -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for k, n in SHAPES:
        weights16 = [torch.randn(k, n, device=dev, dtype=dtype) * 0.02 for _ in range(COPIES)]
        packed = []
        for i in range(COPIES):
            gen = torch.Generator(device=dev).manual_seed(i)
            q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=dev, dtype=torch.int32, generator=gen)
            z = torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), device=dev, dtype=torch.int32, generator=gen)
            s = (torch.rand(k // GROUP, n, device=dev, generator=gen) * 0.01 + 1e-3).to(dtype)
            packed.append((q, s, z))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(COPIES)]

            def cublas(i):
                torch.matmul(x, weights16[i], out=outs[i])

            t_ref = time_graph(cublas, COPIES)
            row = {"K": k, "N": n, "M": m, "cublas_us": t_ref, "bytes_w4": w4_bytes(m, k, n, GROUP)}
            for be in backends:
                # Correctness on this exact input before timing it.
                got = ops.awq_gemm(x, *packed[0], GROUP, backend=be)
                ref = reference.awq_gemm(x, *packed[0], GROUP)
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

                def w4(i, be=be):
                    ops.awq_gemm(x, *packed[i], GROUP, backend=be)

                t = time_graph(w4, COPIES)
                row[f"{be}_us"] = t
                row[f"{be}_GBps"] = row["bytes_w4"] / t / 1e3
                row[f"{be}_ratio"] = t_ref / t
                row[f"{be}_relerr"] = err
            rows.append(row)
            print(_fmt_row(row, backends), flush=True)
            del outs, x
        del weights16, packed
        torch.cuda.empty_cache()
    return rows


def _fmt_row(row: dict, backends: list[str]) -> str:
    parts = [f"| {row['K']:>5} | {row['N']:>5} | {row['M']:>4} | {row['cublas_us']:>8.1f} |"]
    for be in backends:
        parts.append(f" {row[be + '_us']:>8.1f} | {row[be + '_GBps']:>6.0f} | {row[be + '_ratio']:>5.2f}x |")
    return "".join(parts)


def summary(rows: list[dict], backends: list[str]) -> str:
    lines = ["| M | " + " | ".join(f"{be} geomean speed-up (target)" for be in backends) + " |",
             "|---|" + "---|" * len(backends)]
    for m in sorted({r["M"] for r in rows}):
        cells = []
        for be in backends:
            ratios = [r[f"{be}_ratio"] for r in rows if r["M"] == m]
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            tgt = TARGETS.get(be, {}).get(m)
            mark = "" if tgt is None else (" ✓" if geo >= tgt else " ✗")
            cells.append(f"{geo:.2f}x ({tgt}x){mark}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default=None, help="comma list; default: triton, plus cuda when built")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_table.py needs a CUDA GPU", file=sys.stderr)
        return 1
    backends = args.backends.split(",") if args.backends else (["cuda"] if _ext.has_op("awq_gemm") else []) + ["triton"]
    ms = [int(v) for v in args.ms.split(",")]
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · g{GROUP} fp16 · backends {backends}")
    head = "|     K |     N |    M | cuBLAS us |" + "".join(f" {be} us |  GB/s | ratio |" for be in backends)
    print(head, flush=True)
    rows = run(backends, ms)
    text = summary(rows, backends)
    print(text)
    if "triton" in backends:
        from fastawq.triton_kernels import launch

        print("# Triton configs chosen by the tuner (M bucket, N, K):")
        for key, cfg in launch._TUNED.items():
            print(f"#   M<={key[1]:<5} N={key[2]:<6} K={key[3]:<6} {getattr(cfg, 'label', lambda: cfg)()}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_table.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
