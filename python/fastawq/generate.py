"""Token generation: greedy and sampling, stop tokens, streaming, chat templates.

Works on fused models (fastawq.modules.fused: static cache, CUDA-graph decode) and on any
transformers causal LM (its own dynamic cache), through the same two-step interface.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

StreamCallback = Callable[[torch.Tensor], None]


class FusedStepper:
    """prefill/decode over a fused model's runtime."""

    def __init__(self, model: torch.nn.Module):
        self.runtime = model.fastawq_runtime
        self.device = self.runtime.device

    def check(self, batch: int, total_len: int) -> None:
        self.runtime.check_fits(batch, total_len)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.runtime.prefill(ids, start=0, last_only=True)[:, -1]

    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        return self.runtime.decode(tok)


class HFStepper:
    """prefill/decode over a plain transformers model and its dynamic KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: Any = None
        # transformers >= 5.2x renamed past_key_values to cache (the old name still warns).
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def check(self, batch: int, total_len: int) -> None:
        return None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids.to(self.device), use_cache=True, logits_to_keep=1)
        self.cache = getattr(out, self.cache_kw)
        return out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tok.reshape(-1, 1), use_cache=True, **{self.cache_kw: self.cache})
        self.cache = getattr(out, self.cache_kw)
        return out.logits[:, -1]


def stepper_for(model: torch.nn.Module) -> FusedStepper | HFStepper:
    return FusedStepper(model) if hasattr(model, "fastawq_runtime") else HFStepper(model)


# logits [B, V]  ->  next token ids [B] int64
def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy when temperature == 0; else softmax(logits / T) restricted to top-k and nucleus top-p."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    x = logits.float() / temperature
    if top_k is not None and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def vocab_size(model: torch.nn.Module) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return getattr(getattr(model, "config", None), "vocab_size", None)


# ids [B, L] integer  ->  the same, or ValueError before any model call
def check_input_ids(ids: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
    """An empty prompt or an id outside the vocabulary fails here, not as a reshape or index
    error deep inside the model."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [L] or [batch, L], got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"the prompt is empty (input_ids shape {tuple(ids.shape)}): give at least one token")
    v = vocab_size(model) if model is not None else None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (v is not None and hi >= v):
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary [0, {v})")
    return ids


def encode(tokenizer: Any, prompt: Any, chat: bool = False) -> torch.Tensor:
    """Prompt -> input_ids [B, L]: a str, a list of chat messages ({"role", "content"} dicts), a
    list of ids, or a tensor. chat=True wraps a str in the tokenizer's chat template."""
    if isinstance(prompt, torch.Tensor):
        return prompt.unsqueeze(0) if prompt.dim() == 1 else prompt
    if isinstance(prompt, str) and not prompt:
        raise ValueError("the prompt is empty")
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        return tokenizer(prompt, return_tensors="pt").input_ids
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("chat messages need a tokenizer with a chat template")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_tensors="pt")
        if not isinstance(ids, torch.Tensor):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return ids
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError("a list prompt must hold token ids (ints) or chat messages (dicts)")
        return torch.tensor([list(prompt)], dtype=torch.long)
    raise TypeError(f"cannot encode a prompt of type {type(prompt).__name__}")


def _stop_ids(tokenizer: Any, model: torch.nn.Module, stop_token_ids: Sequence[int] | int | None) -> list[int]:
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if eos is None:
            gc = getattr(model, "generation_config", None)
            eos = getattr(gc, "eos_token_id", None)
        stop_token_ids = eos
    if stop_token_ids is None:
        return []
    return [int(stop_token_ids)] if isinstance(stop_token_ids, int) else [int(t) for t in stop_token_ids]


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    input_ids: Any,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: Sequence[int] | int | None = None,
    stream: StreamCallback | None = None,
    *,
    seed: int | None = None,
    chat: bool = False,
) -> torch.Tensor:
    """Generate up to max_new_tokens after input_ids; returns [B, L + generated] token ids.

    input_ids: tensor [L] or [B, L], list of ids, str (needs tokenizer), or chat messages.
    stop_token_ids defaults to the tokenizer's (else the generation config's) EOS; a row that
    stopped is padded with its stop token until all rows stop. stream(new_ids [B]) is called after
    every step. seed makes sampling reproducible. A fused model's cache is checked before any work."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    ids = check_input_ids(encode(tokenizer, input_ids, chat=chat), model)
    b, seq = ids.shape
    step = stepper_for(model)
    step.check(b, seq + max_new_tokens)
    ids = ids.to(step.device)
    stops = torch.tensor(_stop_ids(tokenizer, model, stop_token_ids), dtype=torch.long, device=step.device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=step.device if step.device.type == "cuda" else "cpu").manual_seed(seed)
    finished = torch.zeros(b, dtype=torch.bool, device=step.device)
    out = [ids]
    logits = step.prefill(ids)
    for i in range(max_new_tokens):
        tok = sample_next(logits, temperature, top_k, top_p, gen)
        if stops.numel():
            tok = torch.where(finished, stops[0], tok)
            finished |= torch.isin(tok, stops)
        out.append(tok[:, None])
        if stream is not None:
            stream(tok)
        if i == max_new_tokens - 1 or (stops.numel() and bool(finished.all())):
            break
        logits = step.decode(tok)
    return torch.cat(out, dim=1)


class TextStream:
    """A stream callback that decodes row 0's new tokens into text pieces for on_text(str)."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tok: torch.Tensor) -> None:
        self.ids.append(int(tok.reshape(-1)[0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        # Hold back an incomplete multi-byte character until the next token completes it.
        if text.endswith("\ufffd"):
            return
        self.on_text(text[self.printed:])
        self.printed = len(text)


def chat(model: torch.nn.Module, tokenizer: Any, messages: Any, max_new_tokens: int = 128, **kw: Any) -> str:
    """Answer a user message (str) or a message list with the tokenizer's chat template."""
    ids = encode(tokenizer, messages, chat=True)
    out = generate(model, tokenizer, ids, max_new_tokens, **kw)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def generate_hf_style(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    *,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    streamer: Any = None,
    attention_mask: torch.Tensor | None = None,
    **ignored: Any,
) -> torch.Tensor:
    """The subset of transformers' generate() a fused model serves (unpadded batches)."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("fused generate() takes unpadded batches (attention_mask must be all ones)")
    for key in ignored:
        if key not in ("pad_token_id", "use_cache", "generation_config", "return_dict_in_generate"):
            log.warning("fused generate() ignores %s=", key)
    gc = getattr(model, "generation_config", None)
    if max_new_tokens is None:
        max_new_tokens = (max_length - input_ids.shape[-1]) if max_length else getattr(gc, "max_new_tokens", None) or 20
    if eos_token_id is None:
        eos_token_id = getattr(gc, "eos_token_id", None)
    callback = None
    if streamer is not None:
        streamer.put(input_ids.cpu())
        callback = lambda tok: streamer.put(tok.cpu())  # noqa: E731
    temp = (temperature if temperature is not None else getattr(gc, "temperature", 1.0) or 1.0) if do_sample else 0.0
    out = generate(
        model, None, input_ids, max_new_tokens, temperature=temp,
        top_k=top_k if do_sample else None, top_p=top_p if do_sample else None,
        stop_token_ids=eos_token_id if eos_token_id is not None else [], stream=callback,
    )
    if streamer is not None:
        streamer.end()
    return out
