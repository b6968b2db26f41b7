"""One fused prefill, kernel by kernel (torch.profiler), GPU: its wall time and, per kernel name, the
calls and milliseconds, largest first. Written for issue 11's prefill row, where chunked prefill ran
at 0.65x the one pass (benchmarks/RESULTS.md, session 32): which attention kernel SDPA picks for a
chunk after the first, and what each chunk costs.

    python benchmarks/profile_prefill.py --shape llama-3-8b --length 2048 --chunks 1024,0
    python benchmarks/profile_prefill.py --shape llama-3-8b --length 2048 --chunks 512 --layers 8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastawq.commands import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import kernel_totals  # noqa: E402  (benchmarks/ is not a package)


def run(shape: str, length: int, chunk: int, layout: str, layers: int | None, top: int) -> None:
    m = bench.build_model("fused-graphs", None, shape, "cuda", 2 * length, 1, prefill_chunk=chunk or None,
                          layout=layout, num_layers=layers)
    rt = m.fastawq_runtime
    ids = torch.randint(0, m.config.vocab_size, (1, length), device="cuda")
    for _ in range(2):  # Triton's first-use tuning and SDPA's first calls happen here
        rt.reset()
        rt.prefill(ids)
    torch.cuda.synchronize()
    n = 3
    t0 = time.perf_counter()
    for _ in range(n):
        rt.reset()
        rt.prefill(ids)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rt.reset()
        rt.prefill(ids)
        torch.cuda.synchronize()
    agg = kernel_totals(prof.events())
    total = sum(t for _, t in agg.values())
    print(f"\n##### {shape} ({layers or 'all'} layers), prefill {length} tokens, chunk {chunk or 'one pass'}, "
          f"layout {layout}: wall {wall * 1e3:.2f} ms ({length / wall:,.1f} tok/s), kernels {total / 1e3:.2f} ms")
    for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {t / 1e3:9.3f} ms  {c:5d} calls  {t / c:9.2f} us/call  {name[:110]}")
    del m, rt
    torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--chunks", default="1024,0", help="comma list of prefill chunk sizes (0: one pass)")
    ap.add_argument("--layout", choices=("awq", "packed", "auto"), default="auto")
    ap.add_argument("--layers", type=int, default=None, help="build only this many decoder layers")
    ap.add_argument("--top", type=int, default=12, help="kernels listed a run")
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.length < 1 or any(c < 0 for c in chunks):
        ap.error(f"--length {args.length} must be positive and --chunks {args.chunks} non-negative")
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py needs a CUDA device")
    for chunk in chunks:
        run(args.shape, args.length, chunk, args.layout, args.layers, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
