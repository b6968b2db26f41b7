"""End-to-end speed on a random-weight model shape (default llama-3-8b), GPU.

Runs, in order of importance and within --budget seconds: fused W4 + CUDA graphs over a few
lengths (cache of --max-seq-len), then fp16 transformers, fused W4 eager and unfused W4 on fewer
lengths; then a profile of fused decode steps (kernel time vs. wall time, top kernels).
Writes e2e.json and e2e.md to --out.

    python benchmarks/bench_e2e.py --out $OUT --budget 200
    # mixture of experts: 8 of 48 layers measured, full depth estimated; batch 1 and 16
    python benchmarks/bench_e2e.py --shape qwen3-30b-a3b --layers 8 --batches 1,16 --modes fused-graphs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import asdict

import torch

from fastawq.commands import bench


def weight_bytes(model: torch.nn.Module) -> int:
    names = {n for n, _ in model.named_buffers() if n.endswith(("k_cache", "v_cache"))}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n not in names)
    return total  # parameters() counts tied embeddings once


def profile_decode(shape: str, max_seq_len: int, ctx: int, steps: int = 20, layout: str = "awq",
                   num_layers: int | None = None) -> dict:
    """GPU kernel time vs wall time of `steps` graph-replayed decode steps at context `ctx`."""
    m = bench.build_model("fused-graphs", None, shape, "cuda", max_seq_len, 1, layout=layout, num_layers=num_layers)
    rt = m.fastawq_runtime
    ids = torch.randint(0, m.config.vocab_size, (1, ctx), device="cuda")
    tok = rt.prefill(ids)[:, -1].argmax(-1)
    for _ in range(3):
        tok = rt.decode(tok).argmax(-1)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = rt.decode(tok).argmax(-1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is not None and "CUDA" in str(dt) and e.device_time > 0:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time  # us
    total_us = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    wb = weight_bytes(m)
    m_layers = m.config.num_hidden_layers
    del m, rt
    torch.cuda.empty_cache()
    return {
        "ctx": ctx, "steps": steps, "layers": m_layers, "wall_ms_per_token": 1e3 * wall / steps,
        "kernel_ms_per_token": total_us / 1e3 / steps, "weight_gb": wb / 1e9,
        "top_kernels_us_per_token": [(k[:90], v / steps) for k, v in top],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later modes are skipped past it")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--graph-lengths", default="64,512,2048")
    ap.add_argument("--other-len", type=int, default=2048, help="prefill length of the other modes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layout", choices=("awq", "packed", "auto"), default="auto",
                    help="W4 weight layout (WQLinear.set_layout; auto: as from_quantized picks for the device and, "
                         "in the fused modes, the largest batch)")
    ap.add_argument("--modes", default="fused-graphs,fp16,fused,w4", help="comma list, run in this order")
    ap.add_argument("--layers", type=int, default=None,
                    help="build this many decoder layers; rows add a full-depth estimate (commands/bench.py)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes for the fused-graphs rows")
    ap.add_argument("--prefill-chunk", type=int, default=bench.DEFAULT_PREFILL_CHUNK,
                    help="the fused modes' prefill chunk (fuse_model's prefill_chunk; 0: the prompt in one pass; "
                    f"default {bench.DEFAULT_PREFILL_CHUNK})")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t_start = time.time()
    plan = [
        ("fused-graphs", [int(x) for x in args.graph_lengths.split(",")], None),
        ("fp16", [args.other_len], 32),
        ("fused", [args.other_len], 64),
        ("w4", [args.other_len], 32),
    ]
    plan = [p for p in plan if p[0] in args.modes.split(",")]
    rows: list[bench.Row] = []
    for mode, lengths, max_decode in plan:
        if time.time() - t_start > args.budget:
            print(f"skip {mode}: past the {args.budget:.0f}s budget", flush=True)
            continue
        t = time.time()
        new = bench.bench(None, args.shape, [mode], lengths, batches if mode == "fused-graphs" else 1, args.device,
                          max_seq_len=args.max_seq_len, max_decode=max_decode, layout=args.layout,
                          num_layers=args.layers, prefill_chunk=args.prefill_chunk or None)
        rows += new
        print(f"{mode} done in {time.time() - t:.0f}s", flush=True)
        print(bench.format_table(new), flush=True)
    prof = None
    if args.device.startswith("cuda") and time.time() - t_start < args.budget + 30:
        try:
            # Context 512, or half the cache where it is shorter (the cache holds prompt + steps).
            ctx = min(512, args.max_seq_len // 2)
            prof = profile_decode(args.shape, args.max_seq_len, ctx, layout=args.layout, num_layers=args.layers)
        except Exception as e:  # the table matters more than the profile
            print(f"profile failed: {type(e).__name__}: {e}")
    commit = os.environ.get("FASTAWQ_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    meta = {
        "shape": args.shape, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU", "torch": torch.__version__,
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "max_seq_len": args.max_seq_len, "layout": args.layout, "layers": args.layers,
        "prefill_chunk": args.prefill_chunk,
        # The FASTAWQ_* environment of the run: the switches it set (docs/ops.md) and the build's.
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTAWQ_")},
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    table = bench.format_table(rows)
    fp16 = {r.prefill_len: r.prefill_tps for r in rows if r.mode == "fp16" and r.prefill_tps and r.batch == 1}
    fused = {r.prefill_len: r.prefill_tps for r in rows if r.mode == "fused-graphs" and r.prefill_tps and r.batch == 1}
    lines = [json.dumps(meta), "", table, ""]
    for n in sorted(set(fp16) & set(fused)):
        lines.append(f"prefill {n}: fused W4 / fp16 = {fused[n] / fp16[n]:.2f}x")
    if prof:
        lines.append(
            f"decode profile at ctx {prof['ctx']} ({prof['layers']} layers): wall {prof['wall_ms_per_token']:.3f} ms/token, GPU kernels "
            f"{prof['kernel_ms_per_token']:.3f} ms/token, weights {prof['weight_gb']:.2f} GB"
        )
        for name, us in prof["top_kernels_us_per_token"]:
            lines.append(f"  {us:8.1f} us  {name}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows], "profile": prof}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
