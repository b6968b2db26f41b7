"""One fused CUDA-graph decode step, kernel by kernel (torch.profiler), GPU: per kernel its calls and
microseconds a step, then the start, duration and gap before of the first 40 kernels of one step.

With programmatic dependent launch a kernel starts while the one before drains and waits inside
itself, so durations overlap and gaps come out negative: the second table gives each kernel its
share of the step, the time by which it moved the step's end (its end less the later of its start
and the previous kernel's end: `step_shares`), which sums to the span less the idle gaps.

    python benchmarks/profile_step.py SHAPE:BATCH [SHAPE:BATCH ...]   # e.g. qwen3-30b-a3b:1 mixtral-8x7b:1
    python benchmarks/profile_step.py --set ROUTE_CUDA_EXPERTS="(1, 128)" mixtral-8x7b:1

--set NAME=VALUE (repeatable) sets fastawq.backend.NAME to the Python literal VALUE before the
models are built: a switch of the automatic choice, profiled without editing the package.
"""
from __future__ import annotations

import argparse
import ast
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastawq import backend
from fastawq.commands import bench


def kernel_totals(events) -> dict[str, list]:
    """Per kernel name [calls, microseconds] of the profiler's GPU events."""
    agg: dict[str, list] = {}
    for e in events:
        if e.device_type is None or "CUDA" not in str(e.device_type) or e.device_time <= 0:
            continue
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += e.device_time
    return agg


def step_shares(kernels: list[tuple[str, float, float]]) -> tuple[dict[str, list], float]:
    """Per kernel name [calls, share], and the idle time, of one stream's kernels (name, start, end)
    in start order: a kernel's share is its end less the later of its start and the furthest end
    before it (0 when it ends inside an earlier kernel); idle, the gaps where nothing ran."""
    shares: dict[str, list] = {}
    idle = 0.0
    reach = None  # the furthest end so far
    for name, start, end in kernels:
        if end < start:
            raise ValueError(f"kernel {name!r} ends ({end}) before it starts ({start})")
        base = start if reach is None else max(start, reach)
        if reach is not None and start > reach:
            idle += start - reach
        a = shares.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += max(0.0, end - base)
        reach = end if reach is None else max(reach, end)
    return shares, idle


def run(shape: str, batch: int, layout: str = "packed", ctx: int = 64, steps: int = 10, layers: int | None = None):
    """Print the profile of `steps` decode steps of a random `shape` model after a ctx-token prompt."""
    m = bench.build_model("fused-graphs", None, shape, "cuda", 256, batch, layout=layout, num_layers=layers)
    rt = m.fastawq_runtime
    ids = torch.randint(0, m.config.vocab_size, (batch, ctx), device="cuda")
    tok = rt.prefill(ids)[:, -1].argmax(-1)
    for _ in range(5):
        tok = rt.decode(tok).argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 40
    for _ in range(n):
        tok = rt.decode(tok).argmax(-1)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = rt.decode(tok).argmax(-1)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type is not None and "CUDA" in str(e.device_type) and e.device_time > 0]
    evs.sort(key=lambda e: e.time_range.start)
    agg = kernel_totals(evs)  # kernel name -> [calls, us]
    span = (evs[-1].time_range.end - evs[0].time_range.start) / steps
    ksum = sum(v[1] for v in agg.values()) / steps
    print(f"\n##### {shape} batch {batch} layout {layout}: wall {wall*1e3:.3f} ms/token ({batch/wall:.1f} tok/s), "
          f"profiled span {span/1e3:.3f} ms/step, kernel sum {ksum/1e3:.3f} ms/step, kernels/step {len(evs)/steps:.0f}")
    for name, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t/steps:9.1f} us/step  {c/steps:6.1f} calls  {t/c:7.2f} us/call  {name[:110]}")
    shares, idle = step_shares([(e.name, e.time_range.start, e.time_range.end) for e in evs])
    print(f"  share of the step (what each kernel adds past the one before; idle {idle/steps:.1f} us/step):")
    for name, (c, t) in sorted(shares.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t/steps:9.1f} us/step share  {c/steps:6.1f} calls  {t/c:7.2f} us/call  {name[:100]}")
    # The middle step's first 40 kernels (a few layers).
    per = len(evs) // steps
    mid = evs[per * (steps // 2): per * (steps // 2) + per]
    t0 = mid[0].time_range.start
    print("  timeline (start us, dur us, gap before us):")
    prev_end = t0
    for e in mid[:40]:
        s = e.time_range.start
        print(f"    {s - t0:8.1f} {e.device_time:7.2f} {s - prev_end:6.2f}  {e.name[:90]}")
        prev_end = e.time_range.end
    gaps = []
    prev = mid[0]
    for e in mid[1:]:
        gaps.append(e.time_range.start - prev.time_range.end)
        prev = e
    print(f"  gaps: sum {sum(gaps):.1f} us/step, mean {sum(gaps)/len(gaps):.2f}, n {len(gaps)}")
    del m, rt
    torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", metavar="SHAPE:BATCH", help="e.g. qwen3-30b-a3b:1 llama-3-8b:16")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="set fastawq.backend.NAME to the Python literal VALUE first (repeatable)")
    args = ap.parse_args(argv)
    specs = []
    for spec in args.specs:
        shape, _, batch = spec.partition(":")
        if not batch.isdigit():
            ap.error(f"{spec!r}: expected SHAPE:BATCH, e.g. qwen3-30b-a3b:1")
        specs.append((shape, int(batch)))
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(backend, name):
            raise SystemExit(f"--set {name}: fastawq.backend has no such switch")
        setattr(backend, name, ast.literal_eval(value))
        print(f"backend.{name} = {getattr(backend, name)!r}")
    for shape, batch in specs:
        run(shape, batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
