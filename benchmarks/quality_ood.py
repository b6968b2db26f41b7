"""AWQ quality out of domain: calibrate on fastawq's default set, evaluate on text it never saw.

    nice -n 10 python benchmarks/quality_ood.py [--model smollm2|gemma3-270m] [--calib-samples 128]
        [--variant NAME:KEY=VAL,...]

SmolLM2-135M-Instruct (fastawq.data.smollm2_path; Llama) or Gemma 3 270M (fastawq.data.gemma3_270m_path;
every window scored after a BOS token, as Gemma expects), 4-bit g64 with zero points, fp32 on CPU.
Evaluation sets (16 disjoint windows of 512 tokens each by default):
  brown-genres  Brown-corpus genres that calibration never used (fastawq.data.BROWN_HELDOUT_GENRES)
  brown-files   other files of the calibration genres (never in calibration)
  python-docs   a fixed set of Python 3.11 documentation sources (.rst.txt; no docs in calibration)
Each variant is one AWQ run (pseudo-quantized after the search); fp and RTN are shared.
Recovered = (RTN - AWQ) / (RTN - fp). `--save-scaled DIR` keeps the first variant's scaled float
model (export_compatible) as a Hugging Face folder; `--gguf-scaled DIR [--gguf-type q4_0]` then
compares the same GGUF quantization of the unscaled and of the AWQ-scaled model (both written by
fastawq.gguf_export, read back and dequantized by transformers' GGUF loader).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from fastawq import data  # noqa: E402
from fastawq.eval import format_table, perplexity  # noqa: E402
from fastawq.quantize import AwqQuantizer, QuantConfig, pseudo_quantize_model, quantize  # noqa: E402

SETS = {
    "brown-genres": lambda: data.brown_heldout_text("genres"),
    "brown-files": lambda: data.brown_heldout_text("files"),
    "python-docs": lambda: data.python_docs_heldout_text(),
}

# name -> (label, loader, feed each evaluation window after a BOS token: Gemma without one scores
# Brown text at about 3x the perplexity)
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", data.smollm2_path, False),
    "gemma3-270m": ("Gemma 3 270M", data.gemma3_270m_path, True),
}


def parse_variant(spec: str) -> tuple[str, dict]:
    """"name:calib=stdlib,n_grid=40,duo=0,clip=1" -> (name, options)."""
    name, _, opts = spec.partition(":")
    out: dict = {}
    for kv in filter(None, opts.split(",")):
        k, _, v = kv.partition("=")
        if k not in ("calib", "n_grid", "duo", "clip"):
            raise SystemExit(f"unknown variant option {k!r} in {spec!r} (calib, n_grid, duo, clip)")
        out[k] = v if k == "calib" else int(v)
    return name, out


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
                isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores; {' '.join(isa)})"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    if os.environ.get("FASTAWQ_COMMIT"):  # on the device machine git reads its copy's stale metadata
        return os.environ["FASTAWQ_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"
    return out.stdout.strip() + (" (modified)" if dirty else "") if out.returncode == 0 else "?"


def gguf_compare(args, fp_dir: Path, scaled_dir: Path, fp, ppl, t0: float) -> int:
    import tempfile

    from transformers import AutoModelForCausalLM

    from fastawq.gguf_export import export_gguf

    del fp  # the float model's perplexity is the main run's
    rows, results = [], {}
    models = [("unscaled", fp_dir), ("AWQ-scaled", scaled_dir)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, src in [m for m in models if args.gguf_which in ("both", m[0])]:
            name = f"{label}-{args.gguf_type}.gguf"
            export_gguf(src, Path(tmp) / name, args.gguf_type)
            m = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=name, dtype=torch.float32).eval()
            results[label] = ppl(m)
            print(label, results[label], flush=True)
            rows.append([f"GGUF {args.gguf_type.upper()} of the {label} model"] + list(results[label].values()))
            del m
    print(format_table(["model"] + args.sets, rows))
    print(f"GGUF {args.gguf_type.upper()} (linears; embedding Q8_0), eval {args.windows} x {args.seq_len} tokens "
          f"per set; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_name()}; "
          f"total {time.perf_counter() - t0:.0f}s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sets", nargs="*", default=list(SETS), choices=list(SETS))
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME:calib=default|stdlib|FILE,n_grid=20,duo=1,clip=1 (repeatable; default: one default run)")
    ap.add_argument("--save-scaled", type=Path, default=None, help="save the first variant's scaled float model here")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--gguf-scaled", type=Path, default=None,
                    help="only the GGUF comparison: the scaled float folder a --save-scaled run wrote")
    ap.add_argument("--gguf-type", default="q4_0")
    ap.add_argument("--gguf-which", choices=["both", "unscaled", "AWQ-scaled"], default="both")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    commit = _commit()  # the tree the run started from (a long run may outlive HEAD)
    label, loader, bos = MODELS[args.model]
    path = loader()
    tok = AutoTokenizer.from_pretrained(str(path))
    fp = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_safetensors=True).eval()
    tokens = args.windows * args.seq_len
    ids = {}
    for s in args.sets:
        ids[s] = torch.tensor(tok(SETS[s](), add_special_tokens=False)["input_ids"])[:tokens]
        if ids[s].numel() < tokens:
            raise SystemExit(f"evaluation set {s} has only {ids[s].numel()} tokens, {tokens} needed")

    bos_id = tok.bos_token_id if bos else None

    def ppl(m) -> dict:
        return {s: perplexity(m, tok, ids[s], args.seq_len, progress=False, bos_token_id=bos_id) for s in args.sets}

    if args.gguf_scaled is not None:
        return gguf_compare(args, path, args.gguf_scaled, fp, ppl, t0)
    qc = QuantConfig(w_bit=4, q_group_size=args.group_size, zero_point=True)
    results = {"fp": ppl(fp)}
    print("fp", results["fp"], flush=True)
    results["rtn"] = ppl(pseudo_quantize_model(copy.deepcopy(fp), qc))
    print("rtn", results["rtn"], flush=True)
    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    timing = {}
    for i, (name, opt) in enumerate(variants):
        quantizer = type("Q", (AwqQuantizer,), {"n_grid": opt.get("n_grid", AwqQuantizer.n_grid)})
        model = copy.deepcopy(fp)
        t = time.perf_counter()
        quantize(model, tok, qc, calib=opt.get("calib"), max_calib_samples=args.calib_samples,
                 max_calib_seq_len=args.calib_seq_len, duo_scaling=bool(opt.get("duo", 1)),
                 apply_clip=bool(opt.get("clip", 1)), export_compatible=True, device="cpu", quantizer_cls=quantizer)
        timing[name] = time.perf_counter() - t
        if i == 0 and args.save_scaled is not None:
            model.half().save_pretrained(str(args.save_scaled))
            tok.save_pretrained(str(args.save_scaled))
            model.float()
        results[name] = ppl(pseudo_quantize_model(model, qc))
        print(name, opt, results[name], f"{timing[name]:.0f}s", flush=True)
        del model

    rows = [["full precision (fp32)", "-"] + [results["fp"][s] for s in args.sets],
            ["round-to-nearest", "-"] + [results["rtn"][s] for s in args.sets]]
    for name, opt in variants:
        cells = [f"AWQ {name}", ",".join(f"{k}={v}" for k, v in opt.items()) or "defaults"]
        for s in args.sets:
            r, f, a = results["rtn"][s], results["fp"][s], results[name][s]
            cells.append(f"{a:.3f} ({(r - a) / (r - f) * 100:.0f} %)")
        rows.append(cells)
    print(format_table(["model", "options"] + args.sets, rows))
    print(f"{label} 4-bit g{args.group_size}; calibration {args.calib_samples} x {args.calib_seq_len} "
          f"tokens; eval {args.windows} x {args.seq_len} tokens per set; commit {commit}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_name()}; "
          f"quantize {', '.join(f'{k} {v:.0f}s' for k, v in timing.items())}; total {time.perf_counter() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "variants": dict(variants), "timing": timing,
                                         "commit": commit, "cpu": cpu_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
