"""Shared GPU timing for the benchmark scripts (run them from the repository root)."""
from __future__ import annotations

import math
import statistics

import torch


def w4_bytes(m: int, k: int, n: int, g: int) -> int:
    """Bytes a W4A16 GEMM must move: packed weights, fp16 scales, packed zeros, x in, y out."""
    return k * n // 2 + (k // g) * n * 2 + (k // g) * n // 2 + 2 * m * k + 2 * m * n


def time_graph(fn, reps: int, replays: int = 10) -> float:
    """Median microseconds per call of fn(i) for i in range(reps), from CUDA-graph replays.

    Give each i its own weight buffer so that no call is served from L2; the graph removes the
    launch gaps that would dominate microsecond kernels.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(reps):  # warm-up outside the graph: compilation, tuning, workspaces
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def best_us(fn, calls: int = 50, replays: int = 5) -> float:
    """Microseconds per call of fn(), the best of `replays` replays of a CUDA graph of `calls`
    back-to-back calls on the same inputs (each call's programmatic-dependent-launch wait on the one
    before is inside the time): for launches whose inputs live in L2 in the engine too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph: compilation, workspaces
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(rows: list[dict], columns: list[tuple[str, str, int, str]]) -> None:
    """A header line, then a line per row; each column is (header, row key, width, format spec)."""
    print(" ".join(f"{head:>{width}}" for head, _, width, _ in columns))
    for r in rows:
        print(" ".join(f"{r[key]:>{width}{spec}}" for _, key, width, spec in columns))
