"""`fastawq bench`: prefill and decode speed and peak memory, the table AutoAWQ users know.

For each length L (32, 64, ... up to --max-len) it prefills L tokens and then decodes L more
(greedy), in one of four modes: fp16 (transformers), w4 (unfused W4, transformers' cache),
fused (fused W4 layers, eager) and fused-graphs (fused W4, CUDA-graph decode).

With --shape NAME --layers N a random model of N decoder layers (fewer than the shape's full
depth D) is measured, and each row also gives a full-depth estimate, labelled as such: the head
of a step (embedding, final norm, lm_head: timed apart) plus the rest of the measured step time
scaled by D / N.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fastawq.modules.fused import DEFAULT_PREFILL_CHUNK

log = logging.getLogger(__name__)

MODES = ("fp16", "w4", "fused", "fused-graphs")


@dataclass
class Row:
    mode: str
    batch: int
    prefill_len: int
    decode_len: int
    prefill_tps: float | None = None
    decode_tps: float | None = None
    memory_gib: float | None = None
    note: str = ""
    layers: int | None = None  # decoder layers measured
    full_layers: int | None = None  # the shape's depth, when more than measured
    prefill_tps_full: float | None = None  # estimates at full depth (see the module doc)
    decode_tps_full: float | None = None


def lengths_for(max_len: int, rounds: int | None) -> list[int]:
    out, n = [], 32
    while n <= max_len and (rounds is None or len(out) < rounds):
        out.append(n)
        n *= 2
    return out


def build_model(mode: str, model: str | None, shape: str | None, device: str, max_seq_len: int,
                batch_size: int, gemm_backend: str | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                dtype: torch.dtype = torch.float16, layout: str = "awq",
                num_layers: int | None = None, on_phase: Callable[[str], None] | None = None) -> torch.nn.Module:
    """The model for one mode, from a named random shape (num_layers: that many decoder layers)
    or a checkpoint directory; its W4 layers in `layout` (WQLinear.set_layout: "awq" or "packed";
    "auto": what from_quantized picks, backend.preferred_layout for this device and, in the fused
    modes, batch_size). on_phase(name) is called after each step ("weights", "fused", "layout";
    profile_memory.py)."""
    from fastawq.modules.fused import fuse_model
    from fastawq.modules.qlinear import WQLinear, set_layout

    phase = on_phase or (lambda name: None)

    if shape is not None:
        from fastawq.shapes import build_random_model

        m = build_random_model(shape, quantized=mode != "fp16", device=device, dtype=dtype, num_layers=num_layers)
    elif num_layers is not None:
        raise ValueError("--layers applies to a random --shape model, not a checkpoint")
    elif mode == "fp16":
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    else:
        try:
            from fastawq.auto import AutoAWQForCausalLM
        except ImportError as e:
            raise SystemExit(f"loading a quantized checkpoint needs fastawq.AutoAWQForCausalLM: {e}")
        m = AutoAWQForCausalLM.from_quantized(model, fuse_layers=False, device_map=device, torch_dtype=dtype)
        m = getattr(m, "model", m)
    phase("weights")
    if gemm_backend:
        for mod in m.modules():
            if isinstance(mod, WQLinear):
                mod.backend = gemm_backend
    if mode.startswith("fused"):
        fuse_model(m, max_seq_len, batch_size, use_cuda_graphs=mode == "fused-graphs", prefill_chunk=prefill_chunk)
        phase("fused")
    if layout == "auto":
        from fastawq.backend import preferred_layout

        layout = preferred_layout(torch.device(device), batch_size if mode.startswith("fused") else None)
    if layout != "awq":
        # After fusing, which concatenates AWQ tensors.
        set_layout(m, layout)
        phase("layout")
    return m


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resident_gib() -> float | None:
    """The process's resident memory on the CPU (weights, cache, activations, and the runtime)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def head_seconds(model: torch.nn.Module, batch: int, device: torch.device, reps: int = 50) -> float:
    """Seconds of one step's head for `batch` tokens: embedding, final norm and lm_head (the part
    of a step that does not grow with depth), CUDA-graph replayed on a GPU like a decode step."""
    from fastawq.models import architecture_of
    from fastawq.models.base import get_submodule

    arch = architecture_of(model)
    embed, norm, head = (get_submodule(model, p) for p in (arch.embed_path, arch.final_norm_path, arch.lm_head_path))
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def run() -> torch.Tensor:
        return head(norm(embed(ids)))

    with torch.inference_mode():
        fn = run
        if device.type == "cuda":
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            fn = graph.replay
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
    return (time.perf_counter() - t0) / reps


def full_depth(seconds: float, head: float, layers: int, full_layers: int) -> float:
    """A step's time at full depth from one measured with `layers` layers and its head time."""
    return head + max(seconds - head, 0.0) * full_layers / layers


def run_round(model: torch.nn.Module, mode: str, batch: int, prefill_len: int, decode_len: int,
              vocab: int, warmup: bool = True, full_layers: int | None = None) -> Row:
    """Prefill prefill_len tokens, then greedy-decode decode_len; time each phase separately.
    With full_layers above the model's depth, also estimate both at full depth."""
    from fastawq.generate import stepper_for

    step = stepper_for(model)
    device = step.device
    row = Row(mode, batch, prefill_len, decode_len, layers=getattr(model.config, "num_hidden_layers", None))
    gen = torch.Generator(device="cpu").manual_seed(prefill_len)
    ids = torch.randint(0, vocab, (batch, prefill_len), generator=gen).to(device)
    try:
        step.check(batch, prefill_len + decode_len)
        if warmup:
            # Compile/autotune the kernels for this M and capture the decode graph, untimed.
            logits = step.prefill(ids)
            step.decode(logits.argmax(-1))
            step.decode(logits.argmax(-1))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        logits = step.prefill(ids)
        _sync(device)
        t1 = time.perf_counter()
        tok = logits.argmax(-1)
        for _ in range(decode_len):
            tok = step.decode(tok).argmax(-1)
        _sync(device)
        t2 = time.perf_counter()
        row.prefill_tps = batch * prefill_len / (t1 - t0)
        row.decode_tps = batch * decode_len / (t2 - t1)
        if full_layers and row.layers and full_layers > row.layers:
            head = head_seconds(model, batch, device)
            row.full_layers = full_layers
            row.prefill_tps_full = batch * prefill_len / full_depth(t1 - t0, head, row.layers, full_layers)
            row.decode_tps_full = batch / full_depth((t2 - t1) / decode_len, head, row.layers, full_layers)
        if device.type == "cuda":
            row.memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
        else:
            row.memory_gib = _resident_gib()
    except Exception as e:  # an OOM (or a too-long round) is a row, and the run goes on
        if _is_oom(e):
            row.note = "OOM"
        elif type(e).__name__ == "CacheOverflowError":
            row.note = "exceeds cache"
        else:
            raise
        if hasattr(step, "cache"):
            step.cache = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def format_table(rows: list[Row]) -> str:
    # The memory column keeps AutoAWQ's name; on the CPU it holds the process's resident memory.
    head = ["Mode", "Batch Size", "Prefill Length", "Decode Length", "Prefill tokens/s",
            "Decode tokens/s", "Memory (VRAM)"]
    scaled = [r for r in rows if r.full_layers]
    if scaled:
        # Measured on fewer layers than the shape has: say so in the header, add the estimates.
        head[4:6] = [f"Prefill tokens/s ({scaled[0].layers} layers, measured)",
                     f"Decode tokens/s ({scaled[0].layers} layers, measured)"]
        head[6:6] = [f"Prefill tokens/s ({scaled[0].full_layers} layers, estimated)",
                     f"Decode tokens/s ({scaled[0].full_layers} layers, estimated)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.note:
            cells = [r.note] * (len(head) - 4)
        else:
            cells = [f"{r.prefill_tps:,.1f}", f"{r.decode_tps:,.1f}"]
            if scaled:
                cells += [f"{r.prefill_tps_full:,.1f}" if r.prefill_tps_full else "n/a",
                          f"{r.decode_tps_full:,.1f}" if r.decode_tps_full else "n/a"]
            cells.append(f"{r.memory_gib:.2f} GiB" if r.memory_gib is not None else "n/a")
        lines.append("| " + " | ".join([r.mode, str(r.batch), str(r.prefill_len), str(r.decode_len), *cells]) + " |")
    return "\n".join(lines)


def bench(model: str | None, shape: str | None, modes: list[str], lengths: list[int], batch: int | list[int],
          device: str, max_seq_len: int | None = None, max_decode: int | None = None,
          gemm_backend: str | None = None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
          dtype: torch.dtype = torch.float16, layout: str = "awq", num_layers: int | None = None) -> list[Row]:
    """Run every mode over every batch size and length; each mode's model (its fused cache sized for
    the largest batch) is built once and freed before the next is built."""
    rows: list[Row] = []
    batches = [batch] if isinstance(batch, int) else list(batch)
    full_layers = None
    if shape is not None and num_layers is not None:
        from fastawq.shapes import shape_config

        full_layers = shape_config(shape).num_hidden_layers
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
        if mode == "fused-graphs" and not device.startswith("cuda"):
            log.warning("CUDA graphs need a GPU: fused-graphs runs eagerly on %s", device)
        msl = max_seq_len or 2 * max(lengths)
        try:
            m = build_model(mode, model, shape, device, msl, max(batches), gemm_backend, prefill_chunk, dtype,
                            layout, num_layers)
        except Exception as e:
            if not _is_oom(e):
                raise
            rows += [Row(mode, b, n, n, note="OOM") for b in batches for n in lengths]
            continue
        vocab = m.config.vocab_size
        for b in batches:
            for n in lengths:
                d = min(n, max_decode) if max_decode else n
                row = run_round(m, mode, b, n, d, vocab, full_layers=full_layers)
                log.info("%s", row)
                rows.append(row)
        del m
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def main(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.shape is None):
        raise SystemExit("give either MODEL (a checkpoint directory) or --shape NAME")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else lengths_for(args.max_len, args.rounds)
    modes = [m.strip() for m in args.mode.split(",")]
    # On CPU, fp16 runs as scalar loops on x86 and bf16 slows the small ops: fp32 activations
    # (the int4 kernel itself computes in bf16, see fastawq.cpu).
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.startswith("cuda") else torch.float32)
    batches = [int(x) for x in str(args.batch_size).split(",")]
    rows = bench(args.model, args.shape, modes, lengths, batches, device, args.max_seq_len,
                 args.max_decode, args.gemm_backend, args.prefill_chunk or None, dtype, args.layout, args.layers)
    name = args.shape or args.model
    if any(r.full_layers for r in rows):
        name += (f" ({args.layers} layers measured; full-depth estimate = embedding + final norm + lm_head "
                 f"timed apart + the rest x {rows[0].full_layers}/{args.layers})")
    dev = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(f"\n{name} on {dev}, batch {args.batch_size}, {str(dtype).removeprefix('torch.')}\n")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "device": dev, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from fastawq.shapes import SHAPES

    p = subparsers.add_parser("bench", help="prefill/decode tokens per second and memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="quantized checkpoint directory (or fp16 model for --mode fp16)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model of a named shape instead of MODEL")
    p.add_argument("--mode", default="fused-graphs", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--batch-size", default="1", help="batch size, or a comma list of them (one model for all)")
    p.add_argument("--max-len", type=int, default=4096, help="longest prefill (= decode) length")
    p.add_argument("--rounds", type=int, default=None, help="number of lengths 32, 64, ... to run")
    p.add_argument("--lengths", help="explicit comma list of lengths (overrides --max-len/--rounds)")
    p.add_argument("--max-decode", type=int, default=None, help="cap the decode length of each round")
    p.add_argument("--max-seq-len", type=int, default=None, help="fused cache length (default 2 x longest)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="activations and unquantized weights (default: float16 on GPU, float32 on CPU)")
    p.add_argument("--gemm-backend", default=None, help="force the W4 GEMM backend (cuda|triton|cpu|torch)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"fused prefill chunk in tokens over the batch's rows (0: one pass; default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--layout", choices=("awq", "packed", "auto"), default="auto",
                   help="how the W4 layers hold their weights (WQLinear.set_layout; auto: as from_quantized "
                        "picks for this device and, fused, the largest batch size)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --shape: build only this many decoder layers and also report a full-depth estimate")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.set_defaults(func=main)
    return p
