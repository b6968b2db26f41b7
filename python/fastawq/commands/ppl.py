"""`fastawq ppl DIR --text FILE`: perplexity of a checkpoint (AWQ or float) on a text file."""
from __future__ import annotations

from pathlib import Path


def run(args) -> int:
    import torch

    from fastawq import data
    from fastawq.eval import format_table, perplexity

    from fastawq.checkpoint import check_local_path

    d = check_local_path(args.dir) or Path(args.dir)
    if args.text and not Path(args.text).is_file():
        raise FileNotFoundError(f"--text {args.text}: no such file")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}")
    cfg = (d / "config.json").read_text() if (d / "config.json").exists() else ""
    if '"quantization_config"' in cfg:
        from fastawq.auto import AutoAWQForCausalLM

        model = AutoAWQForCausalLM.from_quantized(str(d), device_map=args.device or "auto")
        tok, kind = model.tokenizer, "awq"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.float32 if dev == "cpu" else torch.float16
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, use_safetensors=True).to(dev).eval()
        tok, kind = AutoTokenizer.from_pretrained(str(d)), "float"
    if args.text:
        text, source = Path(args.text).read_text(encoding="utf-8", errors="replace"), args.text
    else:
        text, source = data.heldout_text(), "fastawq held-out text (stdlib docstrings)"
    ppl = perplexity(model, tok, text, args.seq_len, args.stride, max_tokens=args.max_tokens)
    print(format_table(["model", "kind", "text", "seq_len", "perplexity"], [[str(d), kind, source, args.seq_len, ppl]]))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity of a checkpoint on a text file")
    p.add_argument("dir", help="AWQ checkpoint or Hugging Face model folder")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: fastawq's held-out text)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--device", default=None)
    p.set_defaults(func=run)
