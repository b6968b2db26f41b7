"""Large-model quantization on one GPU: streaming from disk under a memory budget, and the 70B search.

    python benchmarks/bench_stream.py                  # both parts (H200: about 8 minutes)
    python benchmarks/bench_stream.py --part 8b        # (a) Llama-3-8B shape from disk, 6 GiB budgets (~4 min)
    python benchmarks/bench_stream.py --part 70b --layers 10   # (b) 10 of 80 layers timed, extrapolated

(a) writes random fp16 Llama-3-8B-shaped weights once as safetensors shards (--dir, default
/tmp/fastawq_bench_8b), then runs, each in its own process so peak RSS is that run's:
`stream` = quantize_streaming with max_memory {"cuda:0": "6GiB", "cpu": "6GiB"}, and
`in_memory` = from_pretrained + quantize + save_quantized, unconstrained. The stream line
carries the streaming's own split of its time (`stream_seconds`: capture, outer tensors, waits
on the reader and the writer, search, and the writer thread's layers / checkpoints / journal).
(b) builds a Llama-3-70B-shaped skeleton on the meta device and generates each layer's weights on
the GPU from a seed (no disk), running the full AWQ search (scales + clipping + packing) per layer.
Every step prints one JSON line; the last line of each part is its summary.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _random_(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place: linears N(0, 0.02), norms 1 + N(0, 0.1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32))


def _skeleton(shape: dict, layers: int | None = None):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    kw = dict(shape)
    if layers:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(**kw, dtype="float16")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    return model.eval(), config


def write_8b(d: Path) -> None:
    """One shard per decoder layer plus one for the embeddings and head, generated on the GPU."""
    from safetensors.torch import save_file

    if (d / "model.safetensors.index.json").exists():
        emit(step="write_8b", skipped=True, dir=str(d))
        return
    t = time.perf_counter()
    d.mkdir(parents=True, exist_ok=True)
    model, config = _skeleton(LLAMA3_8B)
    n = config.num_hidden_layers
    weight_map = {}
    layers = model.model.layers
    for i in range(n):
        layers[i].to_empty(device="cuda")
        _random_(layers[i], seed=i)
        name = f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors"
        save_file({f"model.layers.{i}.{k}": v.cpu() for k, v in layers[i].state_dict().items()}, str(d / name))
        weight_map.update({f"model.layers.{i}.{k}": name for k in layers[i].state_dict()})
        layers[i].to("meta")
    name = f"model-{n + 1:05d}-of-{n + 1:05d}.safetensors"
    tensors = {}
    for prefix, mod in (("model.embed_tokens", model.model.embed_tokens), ("model.norm", model.model.norm),
                        ("lm_head", model.lm_head)):
        mod.to_empty(device="cuda")
        _random_(mod, seed=10_000 + len(tensors))
        tensors.update({f"{prefix}.{k}": v.cpu() for k, v in mod.state_dict().items()})
    save_file(tensors, str(d / name))
    weight_map.update({k: name for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(str(d))
    emit(step="write_8b", dir=str(d), gib=sum(p.stat().st_size for p in d.glob("*.safetensors")) / 2**30,
         seconds=round(time.perf_counter() - t, 1))


def _calib(n: int, seq: int) -> torch.Tensor:
    return torch.randint(0, LLAMA3_8B["vocab_size"], (n, seq), generator=torch.Generator().manual_seed(0))


def child(mode: str, src: str, out: str, n: int, seq: int) -> None:
    """One measured run (its own process)."""
    shutil.rmtree(out, ignore_errors=True)
    torch.cuda.reset_peak_memory_stats()
    ids = _calib(n, seq)
    qc = {"w_bit": 4, "q_group_size": 128, "zero_point": True}
    t = time.perf_counter()
    split = {}
    if mode == "stream":
        import logging

        from fastawq.quantize.stream import quantize_streaming

        class Keep(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if msg.startswith("streamed "):
                    split.update(json.loads(msg[msg.index("{"):]))

        lg = logging.getLogger("fastawq.quantize.stream")
        lg.setLevel(logging.INFO)
        lg.addHandler(Keep())
        quantize_streaming(src, out, None, qc, ids, max_calib_samples=n, max_calib_seq_len=seq, device="cuda",
                           max_memory={"cuda:0": "6GiB", "cpu": "6GiB"})
    else:
        from fastawq.auto import AutoAWQForCausalLM

        m = AutoAWQForCausalLM.from_pretrained(src)
        m.quantize(None, quant_config=qc, calib_data=ids, max_calib_samples=n, max_calib_seq_len=seq, device="cuda")
        m.save_quantized(out)
    emit(step=mode, seconds=round(time.perf_counter() - t, 1),
         peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
         peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), **({"stream_seconds": split} if split else {}))


def part_8b(args) -> None:
    d = Path(args.dir)
    write_8b(d)
    res = {}
    for mode in ("stream", "in_memory"):
        out = f"{args.dir}_{mode}"
        try:
            r = subprocess.run([sys.executable, __file__, "--child", mode, "--dir", str(d), "--out", out,
                                "--n", str(args.n), "--seq", str(args.seq)], capture_output=True, text=True,
                               timeout=args.child_timeout)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            emit(step=mode, error=f"killed after {args.child_timeout} s",
                 stderr=tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
            continue
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            emit(step=mode, error=r.stderr[-2000:])
            continue
        print(lines[-1], flush=True)
        res[mode] = json.loads(lines[-1])
        shutil.rmtree(out, ignore_errors=True)  # 6 GB each: the disk of a 1-GPU machine is 64 GiB
    if len(res) == 2:
        s, m = res["stream"], res["in_memory"]
        emit(part="8b", stream_s=s["seconds"], in_memory_s=m["seconds"], ratio=round(s["seconds"] / m["seconds"], 2),
             stream_rss_gib=s["peak_rss_gib"], stream_gpu_gib=s["peak_gpu_gib"],
             in_memory_rss_gib=m["peak_rss_gib"], in_memory_gpu_gib=m["peak_gpu_gib"],
             targets="rss<=6, gpu<=6, ratio<=1.5")


@torch.no_grad()
def part_70b(args) -> None:
    from fastawq.quantize.awq import AwqQuantizer, search_precision

    n_layers = args.layers or LLAMA3_70B["num_hidden_layers"]
    model, config = _skeleton(LLAMA3_70B, n_layers)
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        mod.to_empty(device="cuda")
        _random_(mod, seed=99)
    q = AwqQuantizer(model, {"w_bit": 4, "q_group_size": 128}, _calib(args.n, args.seq), device="cuda")
    layers = model.model.layers
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with search_precision(q.device):
        inps, kwargs = q._capture_inputs(layers)
        for i in range(n_layers):
            t = time.perf_counter()
            layers[i].to_empty(device="cuda")
            _random_(layers[i], seed=i)
            inps = q.quantize_layer(i, layers[i], inps, kwargs[i])
            layers[i].to("meta")
            torch.cuda.synchronize()
            emit(step="70b_layer", layer=i, seconds=round(time.perf_counter() - t, 2),
                 peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    total = time.perf_counter() - t0
    full = LLAMA3_70B["num_hidden_layers"]
    est = total if n_layers == full else total / n_layers * full
    emit(part="70b", layers_timed=n_layers, seconds=round(total, 1),
         full_80_layers_seconds=round(est, 1), extrapolated=n_layers != full, target_seconds=600,
         phases={k: round(v, 1) for k, v in q.timings.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["8b", "70b", "all"], default="all")
    ap.add_argument("--dir", default="/tmp/fastawq_bench_8b")
    ap.add_argument("--layers", type=int, default=None,
                    help="70B: time this many layers and extrapolate to 80 (default with --part all: 12)")
    ap.add_argument("--n", type=int, default=128, help="calibration samples")
    ap.add_argument("--seq", type=int, default=512, help="calibration sequence length")
    ap.add_argument("--child-timeout", type=int, default=200, help="seconds each measured run may take")
    ap.add_argument("--child", choices=["stream", "in_memory"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_stream.py needs a CUDA GPU")
    if args.child:
        return child(args.child, args.dir, args.out, args.n, args.seq)
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, pid=os.getpid())
    if args.part in ("8b", "all"):
        part_8b(args)
    if args.part in ("70b", "all"):
        if args.part == "all" and args.layers is None:
            args.layers = 12  # keeps both parts inside 9 minutes; the summary is labelled extrapolated
        part_70b(args)


if __name__ == "__main__":
    main()
