"""Decode attention on the GPU: the compiled kernel (csrc/attention) vs Triton vs torch SDPA.

One query token per row over a KV cache of fixed capacity, Llama-3-8B heads by default. Each
timing captures `reps` calls in one CUDA graph, call i on its own cache copy (so no call is
served from L2: 4x L2 of K/V bytes per graph), and reports replay time / reps, median of 20
replays. GB/s counts the K and V bytes that must be read (lens x HKV x D x 2 tensors x dtype
size per row). Run from the repository root (it imports benchmarks/timing.py).

    python benchmarks/bench_attention.py [--lens 128,512,1024,2048,4096] [--capacity 4096]
        [--batch 1] [--heads 32,8] [--head-dim 128] [--dtype fp16] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from fastawq import _ext
from timing import time_graph

L2_BYTES = 60e6


def cache_copies(copies: int, batch: int, n: int, capacity: int, hkv: int, d: int, dtype) -> list[torch.Tensor]:
    """`copies` caches of shape [B, capacity, HKV, D] whose first n positions per row are disjoint
    memory (what a call reads) and whose tails overlap (never read): capacity-sized caches for
    the kernels' grids, without capacity-sized memory per copy."""
    row = n * hkv * d
    buf = torch.randn((copies * batch + 1) * row + capacity * hkv * d, device="cuda", dtype=dtype)
    shape, strides = (batch, capacity, hkv, d), (row, hkv * d, d, 1)
    return [buf.as_strided(shape, strides, i * batch * row) for i in range(copies)]


def bench(batch: int, hq: int, hkv: int, d: int, capacity: int, lens_list: list[int], dtype) -> list[dict]:
    from fastawq.triton_kernels.attention import decode_attention as triton_decode

    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5
    has_cuda = _ext.has_op("decode_attention")
    rows = []
    for n in lens_list:
        lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * batch * n * hkv * d * torch.finfo(dtype).bits // 8
        copies = max(2, min(1024, math.ceil(4 * L2_BYTES / kv_bytes)))
        ks = cache_copies(copies, batch, n, capacity, hkv, d, dtype)
        vs = cache_copies(copies, batch, n, capacity, hkv, d, dtype)
        # GQA as a short query block: q [B, HKV, group, D] against k, v [B, HKV, n, D] (strided
        # views of the cache, no copies), so every SDPA backend takes it.
        qg = q.view(batch, hkv, hq // hkv, d)

        def sdpa(i):
            k, v = ks[i][:, :n].transpose(1, 2), vs[i][:, :n].transpose(1, 2)
            return F.scaled_dot_product_attention(qg, k, v, scale=scale)

        variants = {"sdpa": sdpa, "triton": lambda i: triton_decode(q, ks[i], vs[i], lens, scale, out=out)}
        if has_cuda:
            variants["cuda"] = lambda i: torch.ops.fastawq.decode_attention_out(q, ks[i], vs[i], lens, scale, out)
        want = sdpa(0).reshape(batch, hq, d).float()
        row = {"lens": n, "kv_MB": kv_bytes / 1e6}
        for name, fn in variants.items():
            got = fn(0)
            got = (got if name == "sdpa" else out).reshape(batch, hq, d).float()
            row[f"{name}_err"] = (got - want).abs().max().item()
            t = time_graph(fn, copies, replays=20)
            row[f"{name}_us"] = t
            row[f"{name}_GBs"] = kv_bytes / (t * 1e-6) / 1e9
        rows.append(row)
        del ks, vs
    return rows


def table(rows: list[dict], title: str) -> str:
    names = [n for n in ("cuda", "triton", "sdpa") if f"{n}_us" in rows[0]]
    head = "| lens | K+V MB | " + " | ".join(f"{n} µs | {n} GB/s" for n in names)
    if "cuda" in names:
        head += " | cuda vs triton | cuda vs sdpa"
    lines = [f"### {title}", "", head + " |", "|" + "---|" * (head.count("|"))]
    for r in rows:
        cells = [str(r["lens"]), f"{r['kv_MB']:.2f}"]
        for n in names:
            cells += [f"{r[f'{n}_us']:.2f}", f"{r[f'{n}_GBs']:.0f}"]
        if "cuda" in names:
            cells += [f"{r['triton_us'] / r['cuda_us']:.2f}x", f"{r['sdpa_us'] / r['cuda_us']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    errs = ", ".join(f"{n} {max(r[f'{n}_err'] for r in rows):.2g}" for n in names if n != "sdpa")
    lines += ["", f"Max abs difference from SDPA: {errs}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", default="128,512,1024,2048,4096")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="32,8", help="HQ,HKV")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--out", help="directory to write attention.md into")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    lens = [int(x) for x in args.lens.split(",")]
    if max(lens) > args.capacity:
        raise SystemExit(f"--lens {max(lens)} exceeds --capacity {args.capacity}")
    if not _ext.has_op("decode_attention"):
        print(f"note: no compiled decode_attention ({_ext.status()['reason'] or 'op not in _C'}); timing Triton and SDPA")
    rows = bench(args.batch, hq, hkv, args.head_dim, args.capacity, lens, dtype)
    title = (f"Decode attention, B={args.batch}, HQ={hq}, HKV={hkv}, D={args.head_dim}, {args.dtype}, "
             f"cache capacity {args.capacity} ({torch.cuda.get_device_name()})")
    text = table(rows, title)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
