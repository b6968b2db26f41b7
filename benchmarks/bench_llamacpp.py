"""llama.cpp on the same SmolLM2 GGUF (Q4_1, 4-bit) as bench_cpu.py, for issue 17's comparison:
batch-1 greedy decode tokens/s at 1 and 2 threads, wall clock, after a prompt of the same length.

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # builds llama.cpp from source
    python benchmarks/bench_llamacpp.py [--gguf PATH] [--threads 1,2] [--new-tokens 64] [--repeats 3]

Decode is timed token by token through Llama.eval (one new token per call, the KV cache kept), so
the figure is the decode phase alone, as bench_cpu.py reports it; the best of --repeats runs.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def decode_tok_s(llm, prompt: list[int], new_tokens: int) -> float:
    llm.reset()
    llm.eval(prompt)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return (new_tokens - 1) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from llama_cpp import Llama

    from bench_cpu import cpu_isa_line, find_gguf

    path = find_gguf(args.gguf)
    print(cpu_isa_line())
    print(f"llama.cpp via llama-cpp-python, {os.path.basename(path)}, load average {os.getloadavg()}")
    for threads in (int(t) for t in args.threads.split(",")):
        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=256, logits_all=True,
                    verbose=False)
        text = ("The Python documentation describes the standard library, the language reference and "
                "tutorials for programmers who want to learn how to write clear and correct code. ") * 8
        prompt = llm.tokenize(text.encode(), add_bos=False)[: args.prompt_tokens]
        decode_tok_s(llm, prompt, 4)  # warm
        best = max(decode_tok_s(llm, prompt, args.new_tokens) for _ in range(args.repeats))
        print(f"llama.cpp decode, {threads} thread{'s' * (threads > 1)}: {best:7.1f} tok/s (wall clock, best of "
              f"{args.repeats}, {args.new_tokens} tokens after {len(prompt)})")
        del llm


if __name__ == "__main__":
    main()
