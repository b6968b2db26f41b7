"""Grouped W4 MoE (fastawq.ops.moe_w4: Triton, or the compiled decode kernel) vs the same routing in fp16 torch (GPU).

Shapes: the routed experts of Qwen3-30B-A3B (E=128, top-8, H=2048, I=768) and Mixtral-8x7B
(E=8, top-2, H=4096, I=14336), group size 128, T = 1, 16, 256 tokens. Method as gemm_table.py:
each measurement is COPIES calls captured in one CUDA graph, each call with its own routing
(so the experts it reads are mostly not in L2), replay time / COPIES, median of the replays.

The fp16 baseline gets the routing for free (index lists built on the host before timing) and is
the faster of: a loop over the experts that have tokens (gather, two matmuls, index_add), and
torch.bmm over all experts padded to the largest load. GB/s counts the bytes each call must move:
the weights of the experts its routing reaches, x and the output.

    python benchmarks/bench_moe.py [--out DIR] [--ts 1,16,256] [--shapes qwen3-30b-a3b,mixtral-8x7b] [--no-tune]
    python benchmarks/bench_moe.py --dry-run      # CPU, tiny shapes, plain timers: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fastawq import backend as fastawq_backend
from fastawq import reference
from fastawq.ops import moe as ops_moe
from fastawq.ops import repack

# name: (E, top-k, H, I, group size)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "mixtral-8x7b": (8, 2, 4096, 14336, 128),
    "tiny": (8, 2, 128, 96, 32),  # --dry-run
}
TS = [1, 16, 256]
TARGET = 1.5
COPIES = 16


def packed_experts(e: int, h: int, i: int, g: int, device, dtype=torch.float16, seed: int = 0):
    """Random stacked W4 experts (all nibbles uniform), straight on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, device=device, dtype=torch.int32, generator=gen)

    def scales(*shape):
        return (torch.rand(*shape, device=device, generator=gen) * 0.01 + 1e-3).to(dtype)

    return (words(e, h, 2 * i // 8), scales(e, h // g, 2 * i), words(e, h // g, 2 * i // 8),
            words(e, i, h // 8), scales(e, i // g, h), words(e, i // g, h // 8))


def routings(t: int, e: int, k: int, device, copies: int, seed: int = 0, balanced: bool = False):
    """`copies` routings of t tokens to k of e experts: the top-k of random logits, or with `balanced`
    every expert the same load where e divides t * k (token j takes experts (k j + r) mod e, r < k,
    relabelled by a random permutation a copy; the weights a softmax of random logits)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(copies):
        w, ids = reference.topk_route(torch.randn(t, e, generator=gen), k)
        if balanced:
            slots = (k * torch.arange(t)[:, None] + torch.arange(k)[None, :]) % e
            ids = torch.randperm(e, generator=gen)[slots].to(ids.dtype)
        out.append((ids.to(device), w.to(device=device, dtype=torch.float16)))
    return out


def loop_plan(ids: torch.Tensor, w: torch.Tensor):
    """Per expert with tokens: (expert, token indices, routing weights), built before timing."""
    plan = []
    for ex in ids.unique().tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        plan.append((ex, tok, w[tok, slot][:, None]))
    return plan


def bmm_plan(ids: torch.Tensor, w: torch.Tensor, e: int):
    """Token index [E, cap] and weight [E, cap, 1] per expert, padded with token 0 at weight 0."""
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    cap = int(counts.max())
    idx = torch.zeros(e, cap, dtype=torch.int64, device=ids.device)
    wts = torch.zeros(e, cap, 1, dtype=w.dtype, device=ids.device)
    for ex, tok, wt in loop_plan(ids, w):
        idx[ex, :tok.numel()] = tok
        wts[ex, :tok.numel()] = wt
    return idx, wts


def torch_loop(x, plan, w13, w2, out):
    out.zero_()
    for ex, tok, wt in plan:
        gate, up = (x[tok] @ w13[ex]).chunk(2, dim=-1)
        out.index_add_(0, tok, ((F.silu(gate) * up) @ w2[ex]) * wt)
    return out


def torch_bmm(x, plan, w13, w2, out):
    idx, wts = plan
    gate, up = torch.bmm(x[idx], w13).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2) * wts
    out.zero_()
    out.index_add_(0, idx.reshape(-1), y.reshape(-1, y.shape[-1]))
    return out


def moe_bytes(ids: torch.Tensor, h: int, i: int, g: int, w4: bool) -> int:
    experts = ids.unique().numel()
    if w4:
        per = (h * 2 * i + i * h) // 2 + (h // g * 2 * i + i // g * h) * 2 + (h // g * 2 * i + i // g * h) // 2
    else:
        per = (h * 2 * i + i * h) * 2
    return experts * per + 2 * 2 * ids.shape[0] * h


def time_plain(fn, reps: int) -> float:
    """CPU stand-in for timing.time_graph (dry run): median microseconds of reps calls."""
    times = []
    for r in range(reps):
        start = time.perf_counter()
        fn(r)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def moe_call(backend: str):
    """run(x, ids, w, packed, g) for a backend name: moe_w4's (triton, cuda, torch: its automatic
    kernel choice) or cuda:gemv / cuda:mma / cuda:mma8 / cuda:mma16 / cuda:mma24, one compiled kernel
    forced (torch.ops.fastawq; mma with backend.moe_pass_rows' pass, mma8 / 16 / 24 with that many
    tokens a pass),
    or cuda:mmapacked (/ 8 / 16): moe_mma_packed_w4 on the experts repacked once into the packed layout,
    cuda:gemvpacked: moe_gemv_packed_w4 on them; packed:BACKEND (packed:cuda, packed:triton):
    ops.moe_w4_packed's backend on them (what WQExperts in the packed layout run)."""
    repacked = {}  # id(the AWQ tensors) -> the packed layout's four tensors

    def packed_of(packed, g):
        if id(packed) not in repacked:
            repacked[id(packed)] = repack.awq_experts_repack(*packed, g)
        return repacked[id(packed)]

    if backend.startswith("packed:"):
        be = backend.split(":", 1)[1]
        return lambda x, ids, w, packed, g: ops_moe.moe_w4_packed(x, ids, w, *packed_of(packed, g), g, backend=be)
    if backend.startswith("cuda:"):
        kernel = backend.split(":", 1)[1]
        if kernel == "gemv":
            fn = torch.ops.fastawq.moe_gemv_w4
            return lambda x, ids, w, packed, g: fn(x, ids, w.float(), *packed, g, "silu")
        if kernel == "gemvpacked":
            fn = torch.ops.fastawq.moe_gemv_packed_w4
            return lambda x, ids, w, packed, g: fn(x, ids, w.float(), *packed_of(packed, g), g, "silu")
        on_packed = kernel.startswith("mmapacked")
        fn = torch.ops.fastawq.moe_mma_packed_w4 if on_packed else torch.ops.fastawq.moe_mma_w4
        rows = {"mma8": 8, "mma16": 16, "mma24": 24, "mmapacked8": 8, "mmapacked16": 16}.get(kernel)
        if rows is None and kernel not in ("mma", "mmapacked"):
            raise SystemExit(f"unknown compiled MoE kernel {kernel!r}: gemv, gemvpacked, mma, mma8, mma16, "
                             "mma24, mmapacked, mmapacked8 or mmapacked16")
        def run(x, ids, w, packed, g):
            t, k = ids.shape
            pass_rows = rows or fastawq_backend.moe_pass_rows(t, k, packed[0].shape[0])
            weights = packed_of(packed, g) if on_packed else packed
            return fn(x, ids, w.float(), *weights, g, "silu", pass_rows)

        return run
    return lambda x, ids, w, packed, g: ops_moe.moe_w4(x, ids, w, *packed, g, backend=backend)


def run_shape(name: str, ts: list[int], device: str, copies: int, backends: list[str],
              balanced: bool = False) -> list[dict]:
    e, k, h, i, g = SHAPES[name]
    dtype = torch.float16
    if device == "cuda":
        from timing import time_graph
    else:
        time_graph = time_plain
    packed = packed_experts(e, h, i, g, device, dtype)
    # fp16 experts for the baseline: random, since only their speed matters.
    w13 = torch.randn(e, h, 2 * i, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(e, i, h, device=device, dtype=dtype) * 0.02
    rows = []
    for t in ts:
        if balanced and (t * k) % e:
            raise SystemExit(f"--routing balanced: {name} has E={e}, which does not divide T * k = {t * k}")
        routes = routings(t, e, k, device, copies, seed=t, balanced=balanced)
        x = torch.randn(t, h, device=device, dtype=dtype)
        outs = [torch.empty(t, h, device=device, dtype=dtype) for _ in range(copies)]
        loops = [loop_plan(*rt) for rt in routes]
        t_loop = time_graph(lambda r: torch_loop(x, loops[r % copies], w13, w2, outs[r % copies]), copies)
        del loops
        bmms = [bmm_plan(*rt, e) for rt in routes]
        t_bmm = time_graph(lambda r: torch_bmm(x, bmms[r % copies], w13, w2, outs[r % copies]), copies)
        del bmms, outs
        nbytes = statistics.mean(moe_bytes(rt[0], h, i, g, True) for rt in routes)
        nbytes16 = statistics.mean(moe_bytes(rt[0], h, i, g, False) for rt in routes)
        flops = 2 * t * k * (h * 2 * i + i * h)
        best = min(t_loop, t_bmm)
        ids0, w0 = routes[0]
        ref = reference.moe_w4(x, ids0, w0, *packed, g)
        for backend in backends:
            run = moe_call(backend)
            # Correctness on this exact input before timing it (the fp32 oracle, one routing).
            got = run(x, ids0, w0, packed, g)
            relerr = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

            def w4(r):
                ids, w = routes[r % copies]
                run(x, ids, w, packed, g)

            t_w4 = time_graph(w4, copies)
            row = {
                "shape": name, "backend": backend, "routing": "balanced" if balanced else "random", "E": e, "k": k,
                "H": h, "I": i, "T": t, "relerr": relerr,
                "w4_us": t_w4, "w4_GBps": nbytes / t_w4 / 1e3, "w4_TFLOPs": flops / t_w4 / 1e6,
                "loop_us": t_loop, "bmm_us": t_bmm, "fp16_GBps": nbytes16 / best / 1e3,
                "ratio": best / t_w4,
            }
            rows.append(row)
            print(fmt_row(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


HEAD = ("| shape | W4 backend | T | W4 us | W4 GB/s | W4 TFLOP/s | fp16 loop us | fp16 bmm us | fp16 GB/s | speed-up "
        f"(target {TARGET}x) | rel err |")


def fmt_row(r: dict) -> str:
    mark = "✓" if r["ratio"] >= TARGET else "✗"
    return (f"| {r['shape']} | {r['backend']} | {r['T']} | {r['w4_us']:.1f} | {r['w4_GBps']:.0f} | {r['w4_TFLOPs']:.1f} | "
            f"{r['loop_us']:.1f} | {r['bmm_us']:.1f} | {r['fp16_GBps']:.0f} | {r['ratio']:.2f}x {mark} | "
            f"{r['relerr']:.1e} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape, torch backend, plain timers")
    ap.add_argument("--backends", default="triton",
                    help="W4 backends to time, comma-separated (triton; cuda: the compiled kernels as moe_w4 "
                         "picks them; cuda:gemv, cuda:mma: one forced; cuda:mma8, cuda:mma16, cuda:mma24: with "
                         "8 / 16 / 24 tokens a pass; cuda:mmapacked (8, 16): the tensor-core kernel on the experts "
                         "repacked into the packed layout)")
    ap.add_argument("--no-tune", action="store_true", help="the Triton heuristic configs, no timing of candidates")
    ap.add_argument("--routing", choices=["random", "balanced"], default="random",
                    help="random: the top-k of random logits (the targets' rows); balanced: every expert the "
                         "same load T * k / E (what a kernel would do without the load's spread)")
    args = ap.parse_args(argv)
    if args.no_tune:
        os.environ["FASTAWQ_TRITON_TUNE"] = "0"
    ts = [int(v) for v in args.ts.split(",")]
    if args.dry_run:
        device, shapes, copies, backends = "cpu", ["tiny"], 2, ["torch"]
    else:
        if not torch.cuda.is_available():
            print("bench_moe.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 1
        device, shapes, copies, backends = "cuda", args.shapes.split(","), COPIES, args.backends.split(",")
    for s in shapes:
        if s not in SHAPES:
            print(f"unknown shape {s!r}; choose from {sorted(SHAPES)}", file=sys.stderr)
            return 2
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"# {where} · torch {torch.__version__} · fp16 · W4 backends {', '.join(backends)} · "
          f"{args.routing} routing")
    print(HEAD)
    print("|" + "---|" * (HEAD.count("|") - 1))
    rows = []
    for s in shapes:
        rows += run_shape(s, ts, device, copies, backends, args.routing == "balanced")
    if "triton" in backends:
        from fastawq.triton_kernels import moe as tmoe

        print("# Triton MoE configs chosen by the tuner (T bucket, k, E, H, I):")
        for key, cfg in tmoe._TUNED.items():
            print(f"#   T<={key[1]:<4} k={key[2]} E={key[3]:<4} H={key[4]:<5} I={key[5]:<6} {cfg.label()}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump({"device": where, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
