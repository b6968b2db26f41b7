"""`fastawq export-gguf DIR OUT.gguf`: a float Hugging Face llama folder (e.g. the AWQ-scaled model
that `quantize(..., export_compatible=True)` + `save_quantized` writes) as a GGUF file for llama.cpp."""
from __future__ import annotations


def run(args) -> int:
    from fastawq.gguf_export import export_gguf

    out = export_gguf(args.model_dir, args.out, args.type, embed_type=args.embed_type, tokenizer_pre=args.tokenizer_pre,
                      overwrite=args.overwrite)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.type.upper()})")
    return 0


def add_parser(sub) -> None:
    from fastawq.gguf_export import GGUF_TYPES

    p = sub.add_parser("export-gguf", help="write a float (AWQ-scaled) llama checkpoint as GGUF for llama.cpp")
    p.add_argument("model_dir", help="Hugging Face folder with float safetensors, config.json and tokenizer.json")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", choices=GGUF_TYPES, default="f16", help="the decoder's linear weights (default f16)")
    p.add_argument("--embed-type", choices=GGUF_TYPES, default=None,
                   help="embedding / untied head (default q8_0 for 4-bit types, else --type)")
    p.add_argument("--tokenizer-pre", default=None,
                   help="llama.cpp's pre-tokenizer name, e.g. smollm or llama-bpe (default: 'default')")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)
