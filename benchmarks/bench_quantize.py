"""Time the AWQ search on a model of a named shape with random weights (no checkpoint needed).

    python benchmarks/bench_quantize.py --shape llama-3-8b                 # the H200 target: <= 3 min
    python benchmarks/bench_quantize.py --shape smollm2-135m --device cpu  # the 2-core CPU target: <= 10 min
    python benchmarks/bench_quantize.py --shape llama-3-8b --layers 8      # part of the model, extrapolated
    python benchmarks/bench_quantize.py --shape qwen3-30b-a3b              # MoE: <= 4 min (mixtral-8x7b: <= 6)
    python benchmarks/bench_quantize.py --shape deepseek-v3-moe --layers 1  # one DeepSeek-V3 MoE layer

The shapes are fastawq.shapes' (random weights with spread-out routing for MoE), built in place on
the device. 128 x 512 random calibration tokens by default (AutoAWQ's defaults). Prints a table of
the phases (capture, layer forward + statistics, scale search, clip search, packing), on a GPU with
each phase's peak memory (the resident model included, printed apart), and writes JSON to --json
(or $OUT/bench_quantize.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import time

import torch


# Shapes only this benchmark builds, as fastawq.shapes spells them. DeepSeek-V3 without its three
# dense first layers: every layer is an MoE layer (E=256, H=7168), so `--layers 1` times one and
# the projection to 61 layers is an upper bound.
EXTRA_SHAPES = {
    "deepseek-v3-moe": ("DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, first_k_dense_replace=0, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True), 128),
}


def build(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    """The named shape (fastawq.shapes or EXTRA_SHAPES) in full precision, `layers` decoder layers,
    built on the meta device and filled in place on `device`: no fp32 copy, no CPU round trip."""
    from fastawq import shapes

    cls_name, kw, g = shapes.SHAPES[shape] if shape in shapes.SHAPES else EXTRA_SHAPES[shape]
    full = kw["num_hidden_layers"]
    name = shape
    if shape not in shapes.SHAPES or (layers and layers != full):
        name = f"{shape}@{layers or full}"
        shapes.SHAPES[name] = (cls_name, dict(kw, num_hidden_layers=layers or full), g)
    try:
        model = shapes.build_random_model(name, quantized=False, device=device, dtype=dtype)
    finally:
        if name != shape:
            del shapes.SHAPES[name]
    return model, full, g


def main() -> None:
    from fastawq.eval import format_table
    from fastawq.quantize import AwqQuantizer, QuantConfig
    from fastawq.shapes import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted([*SHAPES, *EXTRA_SHAPES]), default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=None, help="build only this many layers and extrapolate")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=None, help="default: the shape's (128; 64 for smollm2-135m)")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--model-device", default=None, help="where the model waits between layers (default: --device)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("fastawq.quantize.moe").setLevel(logging.INFO)  # cold experts, chunked Grams

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    t = time.perf_counter()
    model, full_layers, shape_g = build(args.shape, args.layers, torch.device(args.model_device or device), dtype)
    if cuda:
        torch.cuda.synchronize()
    t_build = time.perf_counter() - t
    g = args.group_size or shape_g
    n_layers = len(model.model.layers)
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    ids = torch.randint(0, model.config.vocab_size, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    q = AwqQuantizer(model, QuantConfig(q_group_size=g), ids, apply_clip=not args.no_clip, device=device)
    # Peak GPU memory of each phase (over all layers): the quantizer ends every phase with _tick.
    peaks: dict[str, float] = {}
    if cuda:
        tick = q._tick

        def tick_with_peak(what: str, t0: float) -> None:
            torch.cuda.synchronize()
            tick(what, t0)
            peaks[what] = max(peaks.get(what, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()

        q._tick = tick_with_peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    q.quantize()
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    per_layer = (total - q.timings.get("capture", 0.0)) / n_layers
    projected = q.timings.get("capture", 0.0) + per_layer * full_layers
    head = ["phase", "seconds", "per layer"] + (["peak GiB"] if cuda else [])
    rows = [[k, round(v, 2), round(v / n_layers, 3)] + ([round(peaks.get(k, 0.0), 2)] if cuda else [])
            for k, v in q.timings.items()]
    rows.append(["total", round(total, 2), round(per_layer, 3)] + ([round(max(peaks.values(), default=0.0), 2)] if cuda else []))
    print(format_table(head, rows))
    print(f"{args.shape}: {n_layers}/{full_layers} layers, {args.samples}x{args.seq_len} tokens, g{g}, "
          f"{device}: built in {t_build:.1f}s, {total:.1f}s measured, {per_layer:.2f}s per layer, "
          f"{projected:.1f}s projected for all {full_layers} layers"
          + (f", model {resident:.1f} GiB, peak GPU memory {max(peaks.values(), default=0.0):.1f} GiB" if cuda else ""))
    try:  # FASTAWQ_COMMIT first: on the device machine git reads its copy's stale metadata (gpu_suite.sh)
        commit = os.environ.get("FASTAWQ_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = dict(shape=args.shape, layers=n_layers, full_layers=full_layers, samples=args.samples,
                  seq_len=args.seq_len, group_size=g, clip=not args.no_clip, device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                  threads=torch.get_num_threads(), build_s=t_build, total_s=total, projected_s=projected,
                  timings=q.timings, peak_gib=peaks, model_gib=resident, commit=commit, torch=torch.__version__)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_quantize.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
