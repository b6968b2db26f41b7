"""W4A16 GEMM vs cuBLAS on the four Llama-3-8B layer shapes, in one run (GPU only).

Method (as ../shared/TARGETS.md): each measurement is 16 calls captured in one CUDA graph, each on
its own weight buffer so none is served from L2; replay time / 16, median of the replays. The
ratio to cuBLAS (in the activation dtype) is taken within this run, since absolute times drift
between machines.

Columns: `--backends` forces a backend on the AWQ layout (`cuda`, `triton`, ...); `--layouts`
runs the automatic dispatch on a weight layout (`awq`: ops.awq_gemm, `packed`: ops.packed_gemm
on the repacked weights), which is what a WQLinear in that layout runs; `--kernels` forces a
compiled kernel on the packed layout (`gemv`, `gemv:WARPS_PER_SM`, `mma`, `mma:CHUNKS:WARPS_PER_SM`,
`gemm`, `gemm:M_TILES:CHUNKS:SPLITS`), for tuning.

    python benchmarks/gemm_table.py [--backends triton,cuda] [--ms 1,16,64,256,1024,4096] [--out DIR]
    python benchmarks/gemm_table.py --layouts awq,packed --dtypes float16,bfloat16 \
        --ms 1,2,4,8,16,32,64,128,256,1024,4096 --out DIR
    python benchmarks/gemm_table.py --kernels gemv,mma,mma:2:16 --ms 1,2,4,8,16,32
    python benchmarks/gemm_table.py --kernels mma,gemm,gemm:2:2:0 --ms 16,32,64,128,256
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from fastawq import _ext, ops, reference
from fastawq.ops import repack
from timing import time_graph, w4_bytes

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
MS = [1, 16, 64, 256, 1024, 4096]
TARGETS = {
    "cuda": {1: 3.0, 16: 2.5, 64: 1.3, 256: 0.9, 1024: 0.95, 4096: 0.95},
    "triton": {1: 1.5, 16: 1.2, 64: 0.9, 256: 0.8, 1024: 0.9, 4096: 0.9},
}
COPIES = 16
GROUP = 128


# Compiled kernels on the packed layout a `--kernels` column may force, and their largest M.
KERNEL_MAX_M = {"gemv": repack.MAX_M, "mma": repack.MMA_MAX_M, "gemm": 1 << 30, "wgmma": 1 << 30, "wgmmaws": 1 << 30,
                "wgmmaplain": 1 << 30}
_PACKED: dict[int, list] = {}


def _kernel_caller(col: str, awq: list[tuple], x: torch.Tensor, n: int):
    """fn(i) for a "kernel:gemv[:WARPS_PER_SM]", "kernel:mma[:CHUNKS:WARPS_PER_SM]",
    "kernel:gemm[:M_TILES:CHUNKS:SPLITS]" or "kernel:wgmma[:TOKENS:SPLITS]" column (None where M is beyond the kernel); 0 or nothing: the
    kernel's automatic tile and grid. "wgmma" takes the op's automatic form (warp-specialized on the
    64- and 128-token tiles); "wgmmaws" / "wgmmaplain" force the warp-specialized / plain form
    (FASTAWQ_WGMMA_FORM, set around each call: the host reads it at each call, a graph at capture)."""
    name, *tile = col.removeprefix("kernel:").split(":")
    if name == "gemv":
        chunks, warps = 0, (int(tile[0]) if tile else 0)
    elif name == "gemm":
        m_tiles, chunks, splits = map(int, tile) if tile else (0, 0, 0)
    elif name in ("wgmma", "wgmmaws", "wgmmaplain"):
        tokens, splits = map(int, tile) if tile else (0, 0)
    else:
        chunks, warps = (int(tile[0]), int(tile[1])) if tile else (0, 0)
    if x.shape[0] > KERNEL_MAX_M[name] or (name == "mma" and chunks == 4 and x.shape[0] > 16):  # <= 2 mma tiles
        return None
    key = id(awq[0][0])
    if key not in _PACKED:  # one repack per shape for every kernel column and M
        _PACKED.clear()
        _PACKED[key] = [ops.awq_gemv_repack(*w, GROUP) for w in awq]
    packed = _PACKED[key]
    if name == "gemv":
        return lambda i: torch.ops.fastawq.awq_gemv_packed(x, *packed[i], n, GROUP, None, warps)
    if name == "gemm":
        return lambda i: torch.ops.fastawq.awq_gemm_packed(x, *packed[i], n, GROUP, None, m_tiles, chunks, splits)
    if name == "wgmma":
        return lambda i: torch.ops.fastawq.awq_wgmma_packed(x, *packed[i], n, GROUP, None, tokens, splits)
    if name in ("wgmmaws", "wgmmaplain"):
        form = name[len("wgmma"):]

        def form_call(i):
            before = os.environ.get("FASTAWQ_WGMMA_FORM")
            os.environ["FASTAWQ_WGMMA_FORM"] = form
            try:
                return torch.ops.fastawq.awq_wgmma_packed(x, *packed[i], n, GROUP, None, tokens, splits)
            finally:
                if before is None:
                    del os.environ["FASTAWQ_WGMMA_FORM"]
                else:
                    os.environ["FASTAWQ_WGMMA_FORM"] = before
        return form_call
    return lambda i: torch.ops.fastawq.awq_mma_packed(x, *packed[i], n, GROUP, None, chunks, warps)


def _callers(columns: list[str], awq: list[tuple], x: torch.Tensor, n: int) -> dict:
    """column -> fn(i) running copy i (None: the column skips this M); a layout column binds one
    plan per copy, as WQLinear does."""
    out = {}
    for col in columns:
        if col.startswith("kernel:"):
            out[col] = _kernel_caller(col, awq, x, n)
            continue
        if col == "layout:awq":
            plans = [ops.awq_gemm_plan(x, *w, GROUP) for w in awq]
        elif col == "layout:packed":
            plans = [ops.packed_gemm_plan(x, *ops.awq_gemv_repack(*w, GROUP), n, GROUP) for w in awq]
        else:
            out[col] = lambda i, be=col: ops.awq_gemm(x, *awq[i], GROUP, backend=be)
            continue
        out[col] = lambda i, plans=plans: plans[i](x)
    return out


def _compile_task(task: tuple) -> int:
    """In a worker process: run every Triton candidate config of one (dtype, layout, M) once, on the
    smallest shape, so the compiled kernels land in Triton's on-disk cache (the same M, N, K
    specialisations as the timed calls; the main process's tuner then loads instead of compiling)."""
    dtype_name, layout, m = task
    from fastawq.triton_kernels import launch

    dtype = getattr(torch, dtype_name)
    k, n = SHAPES[1]
    dev = torch.device("cuda")
    q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=dev, dtype=torch.int32)
    z = torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), device=dev, dtype=torch.int32)
    s = (torch.rand(k // GROUP, n, device=dev) * 0.01 + 1e-3).to(dtype)
    wts = launch.W4(q, s, z, n)
    if layout == "packed":
        wts = launch.W4(*ops.awq_gemv_repack(q, s, z, GROUP), None, n)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    out = torch.empty(m, n, device=dev, dtype=dtype)
    done = 0
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for cfg in launch.candidate_configs(m, n, k, GROUP, sms, packed=layout == "packed"):
        try:
            launch._run(cfg, x, wts, GROUP, None, out)
            done += 1
        except Exception:  # a config this GPU rejects: the tuner skips it as well
            pass
    torch.cuda.synchronize()
    return done


def precompile(columns: list[str], ms: list[int], dtypes: list[torch.dtype], jobs: int) -> None:
    """Compile the Triton tuning candidates of the automatic columns in `jobs` processes at once."""
    layouts = [c.removeprefix("layout:") for c in columns if c.startswith("layout:") or c == "triton"]
    layouts = ["awq" if v == "triton" else v for v in dict.fromkeys(layouts)]
    tasks = [(str(d).removeprefix("torch."), v, m) for d in dtypes for v in layouts for m in ms]
    if not tasks or jobs <= 1:
        return
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(jobs) as pool:
        runs = sum(pool.imap_unordered(_compile_task, tasks))
    print(f"# precompiled {runs} Triton candidate runs in {jobs} processes: {time.time() - t0:.0f} s", flush=True)


def run(columns: list[str], ms: list[int], dtype=torch.float16) -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for k, n in SHAPES:
        weights16 = [torch.randn(k, n, device=dev, dtype=dtype) * 0.02 for _ in range(COPIES)]
        awq = []
        for i in range(COPIES):
            gen = torch.Generator(device=dev).manual_seed(i)
            q = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=dev, dtype=torch.int32, generator=gen)
            z = torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), device=dev, dtype=torch.int32, generator=gen)
            s = (torch.rand(k // GROUP, n, device=dev, generator=gen) * 0.01 + 1e-3).to(dtype)
            awq.append((q, s, z))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(COPIES)]

            def cublas(i):
                torch.matmul(x, weights16[i], out=outs[i])

            t_ref = time_graph(cublas, COPIES)
            row = {"dtype": str(dtype).removeprefix("torch."), "K": k, "N": n, "M": m, "cublas_us": t_ref,
                   "bytes_w4": w4_bytes(m, k, n, GROUP)}
            ref = reference.awq_gemm(x, *awq[0], GROUP).float()
            for col, fn in _callers(columns, awq, x, n).items():
                name = _name(col)
                if fn is None:
                    row.update({f"{name}_us": math.nan, f"{name}_GBps": math.nan, f"{name}_ratio": math.nan,
                                f"{name}_relerr": math.nan})
                    continue
                # Correctness on this exact input before timing it.
                err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
                t = time_graph(fn, COPIES)
                row[f"{name}_us"] = t
                row[f"{name}_GBps"] = row["bytes_w4"] / t / 1e3
                row[f"{name}_ratio"] = t_ref / t
                row[f"{name}_relerr"] = err
            rows.append(row)
            print(_fmt_row(row, [_name(c) for c in columns]), flush=True)
            del outs, x
        del weights16, awq
        _PACKED.clear()
        torch.cuda.empty_cache()
    return rows


def _name(column: str) -> str:
    return column.removeprefix("layout:").removeprefix("kernel:")


def _fmt_row(row: dict, names: list[str]) -> str:
    parts = [f"| {row['dtype']:>8} | {row['K']:>5} | {row['N']:>5} | {row['M']:>4} | {row['cublas_us']:>8.1f} |"]
    for be in names:
        parts.append(f" {row[be + '_us']:>8.1f} | {row[be + '_GBps']:>6.0f} | {row[be + '_ratio']:>5.2f}x |")
    return "".join(parts)


def geomeans(rows: list[dict], names: list[str]) -> dict[str, float]:
    """'dtype/column/M' -> geomean over the shapes of the ratio to cuBLAS."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for m in sorted({r["M"] for r in rows}):
            for be in names:
                ratios = [r[f"{be}_ratio"] for r in rows if r["M"] == m and r["dtype"] == dtype]
                out[f"{dtype}/{be}/{m}"] = (
                    math.nan if any(math.isnan(x) for x in ratios) else math.exp(sum(map(math.log, ratios)) / len(ratios))
                )
    return out


def summary(rows: list[dict], names: list[str]) -> str:
    geo = geomeans(rows, names)
    lines = ["| dtype | M | " + " | ".join(f"{be} geomean × cuBLAS (target)" for be in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for m in sorted({r["M"] for r in rows}):
            cells = []
            for be in names:
                tgt = TARGETS.get(be, {}).get(m)
                mark = "" if tgt is None else (f" ({tgt}x)" + (" ✓" if geo[f"{dtype}/{be}/{m}"] >= tgt else " ✗"))
                cells.append(f"{geo[f'{dtype}/{be}/{m}']:.2f}x{mark}")
            lines.append(f"| {dtype} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default=None, help="comma list; default: triton, plus cuda when built "
                    "(none when --layouts is given)")
    ap.add_argument("--layouts", default="", help="comma list of awq, packed: automatic dispatch on that layout")
    ap.add_argument("--kernels", default="", help="comma list of compiled kernels on the packed layout, forced: "
                    "gemv, gemv:WARPS_PER_SM, mma, mma:CHUNKS:WARPS_PER_SM (a tile of the swap-AB tensor-core "
                    "kernel), gemm, gemm:M_TILES:CHUNKS:SPLITS (the tensor-core kernel with the batch as the mma's M), "
                    "wgmma or wgmma:TOKENS:SPLITS (the warpgroup-MMA kernel, sm_90a; wgmmaws / wgmmaplain: its warp-specialized / plain form forced)")
    ap.add_argument("--shapes", default="", help="comma list of KxN layer shapes (default: the four Llama-3-8B "
                    "shapes of TARGETS.md), e.g. 2048x5120,4096x2048 for Qwen3-30B-A3B's attention projections")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                    help="processes that compile the Triton tuning candidates first (1: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_table.py needs a CUDA GPU", file=sys.stderr)
        return 1
    layouts = [v for v in args.layouts.split(",") if v]
    if args.backends is not None:
        backends = [v for v in args.backends.split(",") if v]
    else:
        backends = [] if layouts else (["cuda"] if _ext.has_op("awq_gemm") else []) + ["triton"]
    kernels = [v for v in args.kernels.split(",") if v]
    if kernels and args.backends is None:
        backends = []
    columns = backends + [f"layout:{v}" for v in layouts] + [f"kernel:{v}" for v in kernels]
    names = [_name(c) for c in columns]
    if args.shapes:
        global SHAPES
        try:
            SHAPES = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shapes.split(",") if shape]
        except ValueError:
            ap.error(f"--shapes {args.shapes!r}: write KxN,KxN (e.g. 2048x5120)")
        if not SHAPES or any(len(s) != 2 or s[0] % GROUP or s[1] % 8 for s in SHAPES):
            ap.error(f"--shapes {args.shapes!r}: each KxN needs K a multiple of {GROUP} and N of 8")
    ms = [int(v) for v in args.ms.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · g{GROUP} · columns {columns}")
    print("|    dtype |     K |     N |    M | cuBLAS us |" + "".join(f" {be} us |  GB/s | ratio |" for be in names),
          flush=True)
    t0 = time.time()
    precompile(columns, ms, dtypes, args.jobs)
    rows = [r for dtype in dtypes for r in run(columns, ms, dtype)]
    print(summary(rows, names))
    if "layout:packed" in columns and "layout:awq" in columns:
        geo = geomeans(rows, names)
        print("# packed / awq (automatic dispatch on each layout), by dtype and M:")
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            cells = " ".join(f"M={m}:{geo[f'{dtype}/packed/{m}'] / geo[f'{dtype}/awq/{m}']:.2f}" for m in ms)
            print(f"#   {dtype}: {cells}")
    from fastawq.triton_kernels import launch

    if launch._TUNED:
        print("# Triton configs chosen by the tuner (M bucket, N, K, dtype, packed layout):")
        for key, cfg in launch._TUNED.items():
            print(f"#   M<={key[1]:<5} N={key[2]:<6} K={key[3]:<6} {str(key[5]).removeprefix('torch.'):<9} "
                  f"packed={key[7]!s:<5} {getattr(cfg, 'label', lambda: cfg)()}")
    print(f"# {time.time() - t0:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_table.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "columns": columns,
                   "rows": rows, "geomean": geomeans(rows, names)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
