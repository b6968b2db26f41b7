"""Where the fused engine's memory goes: torch.cuda.memory_allocated / max_memory_allocated after
each phase of a batch round on a random-weight model shape (built as `fastawq bench` builds it),
the model's own tensors by kind, and the largest allocations live at each peak (from the
allocator's trace: a model tensor by its kind, anything else by the code that allocated it).

Phases: weights built, layers fused (KV cache, rope tables), layout set, prefill of --prompt
tokens, first decode (CUDA-graph warm-up and capture), --decode more; then the same round again
with the peak reset first, which is what `fastawq bench` and bench_e2e.py report as Memory.

    python benchmarks/profile_memory.py --prompt 2048 --layout packed --out $OUT/memory.json
    python benchmarks/profile_memory.py --device cpu --shape tiny --layers 2   # smoke: RSS only
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from fastawq.commands import bench
from fastawq.generate import stepper_for
from fastawq.shapes import SHAPES

MIB = 2**20


def _ours(filename: str) -> bool:
    if "site-packages/" in filename:  # torch, triton, transformers, or an installed fastawq
        return "site-packages/fastawq/" in filename
    return any(f"/{d}/" in filename for d in ("fastawq", "triton_kernels", "benchmarks"))


def _kind(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if "embed" in name:
        return "embedding"
    if "lm_head" in name:
        return "lm_head"
    return {"qweight": "W4 weights", "wpacked": "W4 weights", "scales": "W4 scales + zeros",
            "qzeros": "W4 scales + zeros", "szpacked": "W4 scales + zeros", "k_cache": "KV cache",
            "v_cache": "KV cache", "rope_cos": "rope tables", "rope_sin": "rope tables"}.get(leaf, "norms, other")


def model_tensors(model: torch.nn.Module) -> dict[int, tuple[str, int]]:
    """storage address -> (kind, bytes) of every tensor the model holds, each storage once (the
    rope tables are plain attributes shared by all layers)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for mname, mod in model.named_modules():
        named += [(f"{mname}.{a}", t) for a in ("rope_cos", "rope_sin")
                  if isinstance(t := mod.__dict__.get(a), torch.Tensor)]
    out: dict[int, tuple[str, int]] = {}
    for name, t in named:
        st = t.untyped_storage()
        out.setdefault(st.data_ptr(), (_kind(name), st.nbytes()))
    return out


def _site(frames: list[dict]) -> str:
    """The innermost frame of this project (and the library call it made) that allocated."""
    if not frames:
        return "no Python frame (C++: cuBLAS workspace, compiled-op scratch)"
    ours = next((f for f in frames if _ours(f["filename"])), None)
    inner = frames[0]
    where = ours or inner
    text = f"{where['name']} ({os.path.basename(where['filename'])}:{where['line']})"
    return text if inner is where else f"{text} > {inner['name']} ({os.path.basename(inner['filename'])})"


def peak_in(trace: list[dict], lo: int, hi: int, tensors: dict[int, tuple[str, int]], top: int) -> dict:
    """Replay the allocator trace: the largest allocated total in entries [lo, hi) and, at that
    moment, the live allocations grouped by model-tensor kind or allocating site."""
    def replay(stop: int):
        live, total, best, at = {}, 0, -1, -1
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = (i, e)
                total += e["size"]
            elif e["action"] == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])[1]["size"]
            else:
                continue
            if i >= lo and total > best:
                best, at = total, i
        return live, best, at

    _, best, at = replay(hi)
    live, _, _ = replay(at + 1)
    # A model tensor is the last allocation at its address (a temporary may have used it before).
    last = {e["addr"]: i for i, e in enumerate(trace) if e["action"] == "alloc" and e["addr"] in tensors}
    groups: dict[str, list[int]] = {}
    for addr, (i, e) in live.items():
        label = tensors[addr][0] if last.get(addr) == i else _site(e.get("frames", []))
        g = groups.setdefault(label, [0, 0, 0])
        g[0], g[1], g[2] = g[0] + e["size"], g[1] + 1, max(g[2], e["size"])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_mib": best / MIB, "trace_index": at,
            "live": [{"what": k, "mib": v[0] / MIB, "count": v[1], "largest_mib": v[2] / MIB} for k, v in rows[:top]],
            "rest_mib": sum(v[0] for _, v in rows[top:]) / MIB}


class Phases:
    """Allocated / peak-in-phase / reserved after each phase (on the CPU: the process's RSS)."""

    def __init__(self, device: torch.device):
        self.device, self.rows = device, []
        self.cuda = device.type == "cuda"

    def __call__(self, name: str) -> None:
        row = {"phase": name}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            row.update(allocated_mib=torch.cuda.memory_allocated(self.device) / MIB,
                       peak_mib=torch.cuda.max_memory_allocated(self.device) / MIB,
                       reserved_mib=torch.cuda.memory_reserved(self.device) / MIB)
            self._marker()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            row["rss_mib"] = (bench._resident_gib() or 0.0) * 1024
        self.rows.append(row)
        print("  ".join(f"{k} {v:,.1f}" if isinstance(v, float) else f"{v}" for k, v in row.items()), flush=True)

    def _marker(self) -> None:
        """An allocation the trace shows with this frame: where the phase ends (no snapshot per phase)."""
        torch.empty(1, device=self.device)

    def ends(self, trace: list[dict]) -> list[int | None]:
        """The trace index at which each phase ended (None where the ring buffer dropped it)."""
        marks = [i for i, e in enumerate(trace) if e["action"] == "alloc"
                 and any(f["name"] == "_marker" and f["filename"].endswith("profile_memory.py")
                         for f in e.get("frames", []))]
        return [None] * (len(self.rows) - len(marks)) + marks[-len(self.rows):]


def _table(title: str, rows: list[tuple[str, float, str]]) -> None:
    print(f"\n{title}\n| what | MiB | |\n|---|---:|---|")
    for what, mib, note in rows:
        print(f"| {what} | {mib:,.1f} | {note} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="build this many decoder layers")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layout", choices=("awq", "packed"), default="awq")
    ap.add_argument("--prefill-chunk", type=int, default=bench.DEFAULT_PREFILL_CHUNK,
                    help="tokens over the batch's rows a chunk (0: one pass; default: the engine's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=12, help="rows of the live-allocation tables")
    ap.add_argument("--max-entries", type=int, default=1_000_000, help="allocator trace length (a few KB each)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries, context="alloc", stacks="python")
    phase = Phases(device)
    # On the CPU, fp32 activations as `fastawq bench` runs them there.
    dtype = torch.float16 if cuda else torch.float32
    model = bench.build_model("fused-graphs", None, args.shape, str(device), args.max_seq_len, args.batch,
                              prefill_chunk=args.prefill_chunk or None, dtype=dtype, layout=args.layout,
                              num_layers=args.layers, on_phase=phase)
    step = stepper_for(model)
    step.check(args.batch, args.prompt + args.decode + 1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def round_(label: str) -> None:
        tok = step.prefill(ids).argmax(-1)
        phase(f"{label}prefill {args.prompt}")
        tok = step.decode(tok).argmax(-1)
        phase(f"{label}decode 1" + ("" if label else " (graph warm-up + capture)" if cuda else ""))
        for _ in range(args.decode):
            tok = step.decode(tok).argmax(-1)
        phase(f"{label}decode {args.decode} more")

    round_("")
    round_("round 2 (bench): ")
    tensors = model_tensors(model)
    kinds: dict[str, float] = {}
    for kind, nbytes in tensors.values():
        kinds[kind] = kinds.get(kind, 0.0) + nbytes / MIB
    held = sum(kinds.values())
    rows = [(k, v, "") for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])] + [("model tensors", held, "sum")]
    result = {"args": vars(args), "phases": phase.rows, "model_tensors_mib": kinds}
    if cuda:
        alloc = torch.cuda.memory_allocated(device) / MIB
        rows.append(("allocated, not model tensors", alloc - held, "workspaces, graph outputs, cuBLAS"))
        result["gpu"] = torch.cuda.get_device_name(device)
        trace = torch.cuda.memory._snapshot(device)["device_traces"][device.index]
        if len(trace) >= args.max_entries:
            print(f"warning: the trace filled --max-entries={args.max_entries}; the peak tables miss its start")
        ends = phase.ends(trace)
        r2 = next(i for i, r in enumerate(phase.rows) if r["phase"].startswith("round 2"))
        result["peaks"] = {"whole run": peak_in(trace, 0, len(trace), tensors, args.top),
                           "round 2 (bench)": peak_in(trace, ends[r2 - 1] or 0, len(trace), tensors, args.top)}
        torch.cuda.memory._record_memory_history(enabled=None)
    _table(f"{args.shape} ({args.layers or 'all'} layers), {args.layout} layout, max_seq_len {args.max_seq_len}, "
           f"batch {args.batch}: tensors the model holds", rows)
    for name, p in result.get("peaks", {}).items():
        _table(f"live at the {name} peak ({p['peak_mib']:,.1f} MiB allocated)",
               [(r["what"], r["mib"], f"{r['count']} allocations, largest {r['largest_mib']:,.1f} MiB")
                for r in p["live"]]
               + [("the rest", p["rest_mib"], "")])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
