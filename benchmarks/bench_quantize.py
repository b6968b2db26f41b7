"""Time the AWQ search on a model of a named shape with random weights (no checkpoint needed).

    python benchmarks/bench_quantize.py --shape llama-3-8b                 # the H200 target: <= 3 min
    python benchmarks/bench_quantize.py --shape smollm2-135m --device cpu  # the 2-core CPU target: <= 10 min
    python benchmarks/bench_quantize.py --shape llama-3-8b --layers 8      # part of the model, extrapolated
    python benchmarks/bench_quantize.py --shape qwen3-30b-a3b              # MoE: <= 4 min (mixtral-8x7b: <= 6)

128 x 512 random calibration tokens by default (AutoAWQ's defaults). Prints a table of the phases
(capture, layer forward + statistics, scale search, clip search, packing) and writes JSON to
--json (or $OUT/bench_quantize.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch

SHAPES = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000),
    # Mixture-of-experts shapes (issue targets: <= 4 min and <= 6 min on one H200).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
}


def build(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    config = AutoConfig.for_model(kw.pop("model_type", "llama"), max_position_embeddings=4096, **kw)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model, SHAPES[shape]["num_hidden_layers"]


def main() -> None:
    from fastawq.eval import format_table
    from fastawq.quantize import AwqQuantizer, QuantConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=None, help="build only this many layers and extrapolate")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=None, help="default 128 (64 for smollm2-135m)")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--model-device", default=None, help="where the model waits between layers (default: --device)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    g = args.group_size or (64 if args.shape == "smollm2-135m" else 128)
    t = time.perf_counter()
    model, full_layers = build(args.shape, args.layers, torch.device(args.model_device or device), dtype)
    t_build = time.perf_counter() - t
    n_layers = len(model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    q = AwqQuantizer(model, QuantConfig(q_group_size=g), ids, apply_clip=not args.no_clip, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    q.quantize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    per_layer = (total - q.timings.get("capture", 0.0)) / n_layers
    projected = q.timings.get("capture", 0.0) + per_layer * full_layers
    rows = [[k, round(v, 2), round(v / n_layers, 3)] for k, v in q.timings.items()]
    rows.append(["total", round(total, 2), round(per_layer, 3)])
    print(format_table(["phase", "seconds", "per layer"], rows))
    print(f"{args.shape}: {n_layers}/{full_layers} layers, {args.samples}x{args.seq_len} tokens, g{g}, "
          f"{device}: {total:.1f}s measured, {projected:.1f}s projected for all {full_layers} layers"
          + (f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = dict(shape=args.shape, layers=n_layers, full_layers=full_layers, samples=args.samples,
                  seq_len=args.seq_len, group_size=g, clip=not args.no_clip, device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                  threads=torch.get_num_threads(), build_s=t_build, total_s=total, projected_s=projected,
                  timings=q.timings, commit=commit, torch=torch.__version__)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_quantize.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
