"""transformers' own loader (fastawq registered as its "awq" backend) against fastawq's
from_quantized, on one fastawq checkpoint, in one run (GPU).

A random W4 model of a named shape (optionally cut to --layers decoder layers, to keep the save
short) is saved once; then each loader's model prefills and greedily decodes with the same
stepper (benchmarks share fastawq.commands.bench.run_round), unfused in both cases, plus
from_quantized's fused + CUDA-graph engine for reference. Prints a table and JSON.

    python benchmarks/bench_hf_backend.py --shape llama-3-8b --layers 8 --out DIR
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers kept from the shape (0: all)")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--diagnose", action="store_true",
                    help="per model: the backends its W4 layers bound, plans rebuilt while decoding, top kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_hf_backend.py needs a CUDA GPU", file=sys.stderr)
        return 1

    import fastawq  # noqa: F401  (arms the transformers backend)
    from transformers import AutoModelForCausalLM

    from fastawq import shapes
    from fastawq.auto import AutoAWQForCausalLM
    from fastawq.checkpoint import save_quantized
    from fastawq.commands.bench import format_table, run_round
    from fastawq.quantize.config import QuantConfig

    cls, kwargs, g = shapes.SHAPES[args.shape]
    name = args.shape
    if args.layers:
        name = f"{args.shape}-{args.layers}l"
        shapes.SHAPES[name] = (cls, {**kwargs, "num_hidden_layers": args.layers}, g)
    model = shapes.build_random_model(name, quantized=True, device="cuda")
    vocab = model.config.vocab_size
    rows, load_s = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        t = time.perf_counter()
        save_quantized(model, ckpt, QuantConfig(w_bit=4, q_group_size=g, zero_point=True))
        save_s = time.perf_counter() - t
        del model
        gc.collect()
        torch.cuda.empty_cache()

        loaders = {
            "from_quantized (unfused)": lambda: AutoAWQForCausalLM.from_quantized(
                ckpt, fuse_layers=False, device_map="cuda", torch_dtype=torch.float16).model,
            "transformers from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=torch.float16, device_map="cuda"),
            "from_quantized (fused + graphs)": lambda: AutoAWQForCausalLM.from_quantized(
                ckpt, fuse_layers=True, device_map="cuda", torch_dtype=torch.float16,
                max_seq_len=args.prefill + args.decode + 8).model,
        }
        for label, load in loaders.items():
            t = time.perf_counter()
            m = load()
            load_s[label] = time.perf_counter() - t
            kinds = sorted({type(x).__name__ for x in m.modules() if "Linear" in type(x).__name__})
            rebuilt = _count_plans()
            row = run_round(m, label, 1, args.prefill, args.decode, vocab)
            row.note = ""
            rows.append(row)
            print(f"{label}: load {load_s[label]:.1f} s, linears {kinds}, plans built {rebuilt()}", flush=True)
            if args.diagnose:
                _diagnose(m, vocab)
            del m
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{name} on {torch.cuda.get_device_name()}, fp16, batch 1 (save {save_s:.1f} s)\n")
    print(format_table(rows))
    ratio = rows[1].decode_tps / rows[0].decode_tps
    print(f"\ntransformers / from_quantized (both unfused) decode: {ratio:.3f}x")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_hf_backend.json"), "w") as f:
        json.dump({"shape": name, "device": torch.cuda.get_device_name(), "rows": [asdict(r) for r in rows],
                   "load_s": load_s, "decode_ratio_unfused": ratio}, f, indent=1)
    return 0


def _count_plans():
    """How many times W4 layers (re)built their dispatch plan since this call."""
    from fastawq.modules import qlinear

    count = [0]
    orig = getattr(qlinear.ops.awq_gemm_plan, "__wrapped__", qlinear.ops.awq_gemm_plan)

    def counting(*a, **k):
        count[0] += 1
        return orig(*a, **k)

    counting.__wrapped__ = orig
    qlinear.ops.awq_gemm_plan = counting
    return lambda: count[0]


def _diagnose(model, vocab: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from fastawq.generate import stepper_for
    from fastawq.modules import WQLinear

    backends = sorted({getattr(getattr(m, "_plan", None), "backend", "none") for m in model.modules()
                       if isinstance(m, WQLinear)})
    rot = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    print(f"  attn_implementation {getattr(model.config, '_attn_implementation', None)!r}, "
          f"inv_freq {getattr(getattr(rot, 'inv_freq', None), 'dtype', None)}, dtype {model.dtype}")
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        if len(seen) < 1:
            seen.append((tuple(q.shape), q.stride(), k.stride(), q.dtype, None if attn_mask is None else
                         (tuple(attn_mask.shape), attn_mask.dtype), kw.get("is_causal"), kw.get("enable_gqa")))
        return sdpa(q, k, v, attn_mask, *a, **kw)
    step = stepper_for(model)
    tok = step.prefill(torch.randint(0, vocab, (1, 16), device=step.device)).argmax(-1)
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        tok = step.decode(tok).argmax(-1)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    print(f"  first decode SDPA call (q shape, q/k strides, dtype, mask, is_causal, enable_gqa): {seen}")
    for cudnn in (False, True):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(16):
            tok = step.decode(tok).argmax(-1)
        torch.cuda.synchronize()
        print(f"  cudnn SDPA {'on ' if cudnn else 'off'}: {(time.perf_counter() - t) / 16 * 1e3:.2f} ms per decode step")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            tok = step.decode(tok).argmax(-1)
        torch.cuda.synchronize()
    print(f"  W4 plan backends {backends}")
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
