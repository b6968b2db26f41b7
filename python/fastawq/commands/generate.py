"""`fastawq generate DIR "prompt"`: load an AWQ checkpoint and answer a prompt."""
from __future__ import annotations

import time


def run(args) -> int:
    import torch

    from fastawq.auto import AutoAWQForCausalLM
    from fastawq.eval import format_table
    from fastawq.generate import check_input_ids

    if not args.prompt:
        raise ValueError("the prompt is empty")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    model = AutoAWQForCausalLM.from_quantized(args.dir, device_map=args.device or "auto", fuse_layers=args.fuse_layers,
                                              max_seq_len=args.max_seq_len)
    tok = model.tokenizer
    if tok is None:
        raise FileNotFoundError(f"{args.dir} has no tokenizer files: `fastawq generate` needs one to encode the prompt")
    extra = {}
    if args.image is not None:
        from fastawq.multimodal import encode_prompt

        extra = {k: v.to(model.device) for k, v in encode_prompt(model.processor, args.prompt, args.image,
                                                                  chat=args.chat).items()}
        extra = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in extra.items()}
        ids = extra.pop("input_ids")
    else:
        if args.chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = args.prompt
        ids = tok(text, return_tensors="pt", add_special_tokens=not args.chat).input_ids
        check_input_ids(ids, model.model)
        ids = ids.to(model.device)
    t = time.perf_counter()
    out = model.generate(ids, **extra, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                         temperature=args.temperature if args.temperature > 0 else None, top_p=None, top_k=None,
                         pad_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t
    new = out[0, ids.shape[1]:]
    print(tok.decode(new, skip_special_tokens=True).strip())
    print(format_table(["prompt tokens", "new tokens", "seconds", "tokens/s"],
                       [[ids.shape[1], new.numel(), round(dt, 2), round(new.numel() / max(dt, 1e-9), 1)]]))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with an AWQ checkpoint")
    p.add_argument("dir", help="AWQ checkpoint folder")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    p.add_argument("--device", default=None)
    p.add_argument("--fuse-layers", action="store_true")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--image", default=None, help="an image file for a vision-language checkpoint")
    p.set_defaults(func=run)
