"""Fused CUDA-graph decode with one switch off and on, on one model, GPU.

--compare pdl: programmatic dependent launch (FASTAWQ_PDL=0 / 1); --compare route: the MoE router
GEMM in the routing launch (backend.ROUTE_FUSED False / True); --compare norm_route: the MoE
block's add + RMSNorm in that launch too (backend.NORM_ROUTE_FUSED); --compare route_cuda: the compiled
routing kernel (norm, router and top-k in one launch, backend.ROUTE_CUDA; off, Triton's launches);
--compare moe_mma: the compiled
MoE backend's tensor-core kernel (backend.MOE_MMA; off, the CUDA-core GEMV serves every load the
compiled backend was bound to); --compare packed_gemm: awq_gemm_packed (the tensor-core kernel with
the batch as the mma's M) for packed-layout batches above backend.PACKED_MMA_MAX_M (off: Triton
there; with --layout packed); --compare rope_attention: the rotary embedding and cache write
inside the compiled decode attention (backend.ROPE_ATTENTION_FUSED; off, rope_kv_cache's launch
before it); --compare act_gemv / norm_gemv: act_mul inside the down projection's GEMV / add +
RMSNorm inside the QKV and gate_up GEMVs (backend.ACT_GEMV_FUSED / NORM_GEMV_FUSED); --compare
gemm16: awq_gemm_packed instead of awq_mma_packed for packed-layout batches of 9 to 16 rows
(backend.PACKED_MMA_MAX_M 8, PACKED_GEMM_MAX_M 16); --compare gemm16_staged: the same with its
staged-x form (FASTAWQ_GEMM_STAGE_X=1), gemm16_staged_early with its weight ring also filled
before the PDL wait (FASTAWQ_GEMV_EARLY_LOADS=1); --compare defaults18: session 17's defaults (off)
against session 18's (on: gemm16, the deferred mma refills, the two-batch GEMV loop at M = 2, early
weight loads, the attention's cluster combine at small batches); --compare wgmma: awq_wgmma_packed
(sm_90a) at every M above the compiled buckets instead of Triton (backend.PACKED_WGMMA, with
PACKED_WGMMA_MAX_M None; with --layout packed, e.g. batch 64); --compare wgmma16: awq_wgmma_packed's
16-token tile (either form: FASTAWQ_WGMMA_FORM) for packed-layout batches of 9 to 16 rows instead of
awq_gemm_packed (backend.PACKED_WGMMA_16; on by default on sm_90 GPUs); --compare layout: the W4 layers'
weight layout (WQLinear.set_layout "awq" / "packed", exact both ways, converted in place; grouped
MoE experts follow where backend.experts_layout says so); --compare moe_layout: the routed experts'
layout alone (WQExperts.set_layout "awq" / "packed"). One random-weight model is built
once; rounds alternate the setting (off on, on off, ...), each re-capturing the decode graph, and
the table gives the median decode tokens/s of each (with --layers, also the full-depth estimate
of commands/bench.py).

    python benchmarks/bench_ab.py --compare pdl --shape llama-3-8b --layout packed --out $OUT
    python benchmarks/bench_ab.py --compare route --shape qwen3-30b-a3b --layers 8 --batches 1,16 --out $OUT
    python benchmarks/bench_ab.py --compare layout --shape qwen3-30b-a3b --batches 1 --out $OUT
    python benchmarks/bench_ab.py --compare env:FASTAWQ_ATTN_PREFETCH=0,1 --shape qwen3-30b-a3b --out $OUT

--compare env:NAME=OFF,ON sets the environment variable NAME to OFF and ON in turn: for the
compiled kernels' A/B switches that the host code reads at each call (a graph at its capture).
--compare may be given several times: the model is built once and each switch is A/B'd in turn
against the settings the process started with (a table and a JSON file each), which saves a model
build per switch on the GPU:

    python benchmarks/bench_ab.py --compare norm_gemv --compare env:FASTAWQ_GEMV_EARLY_LOADS=0,1 --batches 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fastawq import backend
from fastawq.commands import bench
from fastawq.modules.qlinear import WQLinear, set_layout
from fastawq.shapes import shape_config



CHOICES = ("pdl", "route", "norm_route", "route_cuda", "moe_mma", "packed_gemm", "rope_attention", "act_gemv",
           "norm_gemv", "gemm16", "gemm16_staged", "gemm16_staged_early", "defaults18", "wgmma", "wgmma16", "layout",
           "moe_layout")
# Environment variables a named switch sets (restored after it).
_SWITCH_ENV = {"pdl": ("FASTAWQ_PDL",), "gemm16_staged": ("FASTAWQ_GEMM_STAGE_X",),
               "gemm16_staged_early": ("FASTAWQ_GEMM_STAGE_X", "FASTAWQ_GEMV_EARLY_LOADS")}
# defaults18 off: the switches session 18 turned on by default, set to their session-17 values.
_DEFAULTS18_OFF = {"FASTAWQ_MMA_DEFER": "0", "FASTAWQ_GEMV_PINGPONG": "0", "FASTAWQ_GEMV_EARLY_LOADS": "0",
                   "FASTAWQ_ATTN_CLUSTER": "0"}
_SWITCH_ENV["defaults18"] = tuple(_DEFAULTS18_OFF)


def env_switch(compare: str) -> tuple[str, str, str] | None:
    """(NAME, OFF, ON) of --compare env:NAME=OFF,ON; None for the named switches."""
    if not compare.startswith("env:"):
        return None
    name, _, values = compare[4:].partition("=")
    off, _, on = values.partition(",")
    if not name or not off or not on or "," in on:
        raise SystemExit(f"--compare {compare!r}: write env:NAME=OFF,ON, e.g. env:FASTAWQ_ATTN_PREFETCH=0,1")
    return name, off, on


def apply(model: torch.nn.Module, compare: str, on: bool) -> None:
    env = env_switch(compare)
    if env is not None:
        os.environ[env[0]] = env[2] if on else env[1]
    elif compare == "pdl":
        os.environ["FASTAWQ_PDL"] = "1" if on else "0"
    elif compare == "route":
        backend.ROUTE_FUSED = on
    elif compare == "norm_route":
        backend.NORM_ROUTE_FUSED = on
    elif compare == "route_cuda":  # on: wherever it fits, whatever the expert count
        backend.ROUTE_CUDA = on
        backend.ROUTE_CUDA_EXPERTS = (1, 1 << 30)
    elif compare == "moe_mma":
        backend.MOE_MMA = on
    elif compare == "rope_attention":
        backend.ROPE_ATTENTION_FUSED = on
    elif compare == "act_gemv":
        backend.ACT_GEMV_FUSED = on
    elif compare == "norm_gemv":
        backend.NORM_GEMV_FUSED = on
    elif compare == "defaults18":
        for name, off in _DEFAULTS18_OFF.items():
            if on:
                os.environ.pop(name, None)
            else:
                os.environ[name] = off
        backend.PACKED_MMA_MAX_M, backend.PACKED_GEMM_MAX_M = (8, 16) if on else (16, 0)
        for module in model.modules():
            if isinstance(module, WQLinear):
                module.set_backend(module.backend)
    elif compare in ("packed_gemm", "gemm16", "gemm16_staged", "gemm16_staged_early", "wgmma", "wgmma16"):
        if compare == "wgmma":  # on: awq_wgmma_packed at every M above the compiled buckets (off: Triton)
            backend.PACKED_WGMMA, backend.PACKED_WGMMA_MAX_M = on, None
        elif compare == "wgmma16":  # on: awq_wgmma_packed (16-token tile) for M = 9 .. 16, not awq_gemm_packed
            backend.PACKED_WGMMA_16 = on
        elif compare == "packed_gemm":  # on: awq_gemm_packed above the tensor-core GEMV's bucket
            backend.PACKED_GEMM_MAX_M = 1 << 20 if on else 0
        else:  # on: awq_gemm_packed (the batch as the mma's M) for M = 9 .. 16, not awq_mma_packed
            if compare.startswith("gemm16_staged"):  # ... in its staged-x form (with its ring filled early)
                for name in _SWITCH_ENV[compare]:
                    os.environ[name] = "1" if on else "0"
            backend.PACKED_MMA_MAX_M = 8 if on else 16
            backend.PACKED_GEMM_MAX_M = 16 if on else 0
        for module in model.modules():  # plans bound per M bucket: bind them again
            if isinstance(module, WQLinear):
                module.set_backend(module.backend)
    elif compare == "moe_layout":  # on: the routed experts in the packed layout (WQExperts.set_layout)
        from fastawq.modules.moe import WQExperts

        for module in model.modules():
            if isinstance(module, WQExperts):
                module.set_layout("packed" if on else "awq")
    else:
        set_layout(model, "packed" if on else "awq")


_BACKEND_SWITCHES = ("ROUTE_FUSED", "NORM_ROUTE_FUSED", "ROUTE_CUDA", "ROUTE_CUDA_EXPERTS", "MOE_MMA",
                     "PACKED_GEMM_MAX_M", "PACKED_MMA_MAX_M", "ROPE_ATTENTION_FUSED", "ACT_GEMV_FUSED",
                     "NORM_GEMV_FUSED", "PACKED_WGMMA", "PACKED_WGMMA_MAX_M", "PACKED_WGMMA_16")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", action="append", default=None,
                    help=f"one of {', '.join(CHOICES)}, or env:NAME=OFF,ON; repeat to A/B several on one model "
                         "(default: pdl)")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
    ap.add_argument("--layout", choices=("awq", "packed"), default="awq", help="(with --compare layout: ignored)")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per setting")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script on a tiny shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    compares = args.compare or ["pdl"]
    for compare in compares:
        if env_switch(compare) is None and compare not in CHOICES:
            ap.error(f"--compare {compare!r}: choose one of {', '.join(CHOICES)} or env:NAME=OFF,ON")
    batches = [int(b) for b in args.batches.split(",")]
    full = shape_config(args.shape).num_hidden_layers if args.layers else None
    t0 = time.time()
    model = bench.build_model("fused-graphs", None, args.shape, args.device, args.max_seq_len, max(batches),
                              layout=args.layout, num_layers=args.layers)
    print(f"built {args.shape} ({args.layers or 'all'} layers, {args.layout}) in {time.time() - t0:.0f}s", flush=True)
    env_names = ({"FASTAWQ_PDL"} | {env_switch(c)[0] for c in compares if env_switch(c)}
                 | {name for c in compares for name in _SWITCH_ENV.get(c, ())})
    env_before = {name: os.environ.get(name) for name in env_names}
    saved = {n: getattr(backend, n) for n in _BACKEND_SWITCHES}

    def restore() -> None:
        """The settings the process started with (and the plans bound under them)."""
        for name, value in env_before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for n, v in saved.items():
            setattr(backend, n, v)
        for module in model.modules():
            if isinstance(module, WQLinear):
                module.set_backend(module.backend)

    for compare in compares:
        try:
            _compare(args, model, compare, batches, full)
        finally:
            if compare == "layout" and len(compares) > 1:
                set_layout(model, args.layout)
            restore()
    return 0


def _compare(args, model, compare: str, batches: list[int], full: int | None) -> None:
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        got: dict[str, list[tuple[float, float | None]]] = {"0": [], "1": []}
        for r in range(args.rounds):
            for setting in (("0", "1") if r % 2 == 0 else ("1", "0")):
                apply(model, compare, setting == "1")
                model.fastawq_runtime._graphs.clear()  # re-captured with this setting's launches
                row = bench.run_round(model, "fused-graphs", batch, args.prefill, args.decode, vocab,
                                      full_layers=full)
                got[setting].append((row.decode_tps, row.decode_tps_full))
        for setting, vals in got.items():
            tps = statistics.median(v[0] for v in vals)
            est = statistics.median(v[1] for v in vals) if full else None
            rows.append({"batch": batch, "on": setting, "decode_tps": tps, "decode_tps_full": est,
                         "all": [v[0] for v in vals]})
    lines = [f"| batch | {compare} on | decode tok/s ({args.layers or 'all'} layers) "
             f"| full depth ({full}, est.) | rounds |",
             "|---|---|---|---|---|"]
    for r in rows:
        est = f"{r['decode_tps_full']:.1f}" if r["decode_tps_full"] else "–"
        lines.append(f"| {r['batch']} | {r['on']} | {r['decode_tps']:.1f} | {est} | "
                     f"{', '.join(f'{v:.1f}' for v in r['all'])} |")
    for batch in batches:
        off, on = (next(r for r in rows if r["batch"] == batch and r["on"] == s) for s in ("0", "1"))
        lines.append(f"batch {batch}: {compare} on / off = {on['decode_tps'] / off['decode_tps']:.3f}x")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
        meta = {"compare": compare, "shape": args.shape, "layers": args.layers, "layout": args.layout, "gpu": gpu,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        tag = compare.replace(":", "_").replace("=", "_").replace(",", "_")
        with open(os.path.join(args.out, f"ab_{tag}_{args.shape}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
