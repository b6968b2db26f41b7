"""GGUF export of an AWQ-scaled float model, for llama.cpp.

AutoAWQ's route to llama.cpp: `quantize(..., export_compatible=True)` folds AWQ's scales into the
weights and clips them, but packs nothing; `save_quantized` then writes that float model as a plain
Hugging Face checkpoint (`save_scaled_float`), and `export_gguf` writes it as GGUF, F16 or
quantized by the `gguf` package's own quantizers (llama.cpp's Q4_0 / Q4_1 / Q8_0 block formats).
The scaling survives any later GGUF quantization, which is where it helps.

Names and metadata are the inverse of what transformers' GGUF loader reads for the llama family
(its llama config mapping, and the q/k row permutation it undoes); other families are an error.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
SUPPORTED_MODEL_TYPES = ("llama",)

# Hugging Face name inside a decoder layer -> llama.cpp tensor name inside blk.N.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


# ---------------------------------------------------------------- the scaled float checkpoint
def save_scaled_float(
    model: nn.Module, save_dir: str | os.PathLike, tokenizer: Any = None, *, shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a model left by `quantize(..., export_compatible=True)` (AWQ scales folded, weights
    clipped, nothing packed) as a plain Hugging Face safetensors checkpoint."""
    from fastawq.quantize import ScaledActivation

    from fastawq.atomic import atomic_dir, write_manifest
    from fastawq.checkpoint import check_not_source, source_of

    save_dir = Path(save_dir)
    check_not_source(save_dir, source_of(model))
    scaled_acts = [n for n, m in model.named_modules() if isinstance(m, ScaledActivation)]
    if scaled_acts:
        # Plain transformers has nowhere to put an activation scale (e.g. GPT-NeoX's MLP).
        raise ValueError(
            f"{type(model).__name__} keeps AWQ scales in activation modules ({scaled_acts[0]}, ...); "
            "its scaled float model is not a plain Hugging Face checkpoint"
        )
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    # Through a temporary folder and one rename, like save_quantized: an old checkpoint survives
    # any failure, and a complete new one replaces it.
    with atomic_dir(save_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        write_manifest(tmp)
    log.info("saved the AWQ-scaled float model (not packed) to %s", save_dir)
    return save_dir


# ---------------------------------------------------------------- reading the float checkpoint
def _read_folder(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{src} has no config.json: pass a Hugging Face model folder")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"{src} is a packed {method} checkpoint; GGUF export takes the float model that "
            f"quantize(..., export_compatible=True) + save_quantized writes"
        )
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"GGUF export supports model_type {SUPPORTED_MODEL_TYPES}; {src} is {config.get('model_type')!r}"
        )
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {src} (fastawq reads only safetensors)")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
    return config, tensors


def _gguf_name(hf: str, n_layers: int) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < n_layers:
        inner = ".".join(parts[3:])
        if inner in _LAYER_NAMES:
            return f"blk.{parts[2]}.{_LAYER_NAMES[inner]}.{suffix}"
    raise ValueError(f"tensor {hf!r} has no llama.cpp name (is this a plain llama checkpoint?)")


def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp rotates interleaved pairs, transformers rotates halves: reorder each head's rows
    # (what transformers' loader undoes with its reverse permutation).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- the tokenizer
def _add_tokenizer(writer: Any, src: Path, vocab_size: int, pre: str | None) -> None:
    import gguf
    from gguf.vocab import LlamaHfVocab, SpecialVocab

    tj_path = src / "tokenizer.json"
    if not tj_path.exists():
        raise FileNotFoundError(f"{src} has no tokenizer.json (save the tokenizer with the model)")
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") == "BPE" and not model.get("byte_fallback", False):
        # byte-level BPE (GPT-2 style): llama.cpp's "gpt2" tokenizer model
        tokens = {i: t for t, i in model["vocab"].items()}
        types = dict.fromkeys(tokens, int(gguf.TokenType.NORMAL))
        for added in tj.get("added_tokens", []):
            tokens[added["id"]] = added["content"]
            types[added["id"]] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
        n = max(vocab_size, max(tokens) + 1)
        token_list = [tokens.get(i, f"[PAD{i}]") for i in range(n)]
        type_list = [types.get(i, int(gguf.TokenType.UNUSED)) for i in range(n)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or "default")
        writer.add_token_list(token_list)
        writer.add_token_types(type_list)
        load_merges = True
    else:
        try:
            vocab = LlamaHfVocab(src)
        except (FileNotFoundError, TypeError) as e:
            raise ValueError(f"{tj_path}: unsupported tokenizer for GGUF export ({e})") from None
        toks, scores, types = zip(*vocab.all_tokens())
        pad = max(0, vocab_size - len(toks))
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre(pre or "default")
        writer.add_token_list(list(toks) + [f"[PAD{i}]".encode() for i in range(len(toks), len(toks) + pad)])
        writer.add_token_scores(list(scores) + [-1000.0] * pad)
        writer.add_token_types([int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * pad)
        load_merges = False
    SpecialVocab(src, load_merges=load_merges, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


# ---------------------------------------------------------------- the writer
def export_gguf(
    src: str | os.PathLike, out: str | os.PathLike, gguf_type: str = "f16", *, embed_type: str | None = None,
    tokenizer_pre: str | None = None, overwrite: bool = False,
) -> Path:
    """Write the Hugging Face llama-family folder `src` (float safetensors) as the GGUF file `out`
    (an existing `out` only with overwrite=True; the file is written beside it and renamed in).

    gguf_type applies to the decoder's linear weights; norms stay F32; the embedding (and an untied
    output head) use `embed_type`, by default Q8_0 for 4-bit types (as llama.cpp's own files keep
    them at 8 bits) and gguf_type otherwise.
    """
    import gguf

    gguf_type = gguf_type.lower()
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type must be one of {GGUF_TYPES}, got {gguf_type!r}")
    embed_type = (embed_type or ("q8_0" if gguf_type.startswith("q4") else gguf_type)).lower()
    if embed_type not in GGUF_TYPES:
        raise ValueError(f"embed_type must be one of {GGUF_TYPES}, got {embed_type!r}")
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    config, tensors = _read_folder(src)
    rope = config.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError(f"GGUF export does not write rope_scaling {rope} yet")
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    vocab_size = config["vocab_size"]
    if config.get("tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: llama.cpp (and transformers' reader) use token_embd

    qtype = {t: getattr(gguf.GGMLQuantizationType, t.upper()) for t in GGUF_TYPES}
    ftype = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}

    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(config.get("_name_or_path") or src.name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))))
    if head_dim * n_head != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, ftype[gguf_type])))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, src, vocab_size, tokenizer_pre)

    for hf_name in sorted(tensors, key=lambda k: (k.count("layers."), k)):
        name = _gguf_name(hf_name, n_layers)
        w = tensors.pop(hf_name).float().numpy()
        if ".attn_q." in name:
            w = _permute_rows(w, n_head)
        elif ".attn_k." in name:
            w = _permute_rows(w, n_kv)
        if w.ndim == 1:
            t = "f32"
        elif name.startswith(("token_embd.", "output.")):
            t = embed_type
        else:
            t = gguf_type
        if t.startswith("q") and w.shape[-1] % 32:
            t = "f16"  # llama.cpp's blocks are 32 wide
            log.warning("%s: row length %d is not a multiple of 32, written as F16", hf_name, w.shape[-1])
        data = gguf.quants.quantize(np.ascontiguousarray(w), qtype[t])
        writer.add_tensor(name, data, raw_dtype=qtype[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    log.info("wrote %s (%s linears, %s embedding)", out, gguf_type.upper(), embed_type.upper())
    return out
