"""awq_wgmma_packed at one M over forced K-split counts (GPU, sm_90a): how a block's time depends on
how many blocks share an SM.

    python benchmarks/sweep_wgmma_splits.py [--m 16] [--shapes 4096x28672,14336x4096] [--splits 0,1,2,3]

Split 0 is the host's own one-wave plan. For each count it prints the grid's blocks, the blocks an
SM that gives (over the SMs, before the occupancy limit), the steps a block streams, the time (CUDA
graph over 16 weight copies, as gemm_table.py times) and the time a block-step: if a block's step
time stays flat as the blocks an SM grow, the kernel is bound by each block's own latency chain and
a fuller grid (stream-K) would pay in proportion; if it grows in step, they contend for a shared
resource.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
from conftest import random_awq, random_input  # noqa: E402
from timing import time_graph, w4_bytes  # noqa: E402

from fastawq import _ext, ops  # noqa: E402

COPIES = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--shapes", default="4096x28672,14336x4096")
    ap.add_argument("--splits", default="0,1,2,3")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--hot", action="store_true",
                    help="also time each call on one weight copy (L2-resident where it fits: 50 MB on an H100) "
                         "beside the 16 copies: a step bound by the weights' DRAM latency runs faster hot")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not _ext.is_loaded():
        raise SystemExit(f"needs a GPU and fastawq._C: {_ext.status()}")
    op = torch.ops.fastawq.awq_wgmma_packed
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = 16 if args.m <= 16 else 32 if args.m <= 32 else 64 if args.m <= 64 else 128
    # A block's columns: 128 a warpgroup; FASTAWQ_WGMMA_WARPGROUPS forces the count (the host's
    # wgmma_warpgroups: one up to 32 tokens, two above; the ws form of the 128-token tile has two).
    forced = os.environ.get("FASTAWQ_WGMMA_WARPGROUPS", "")
    warpgroups = int(forced) if forced in ("1", "2") and tokens < 128 else (1 if tokens <= 32 else 2)
    tile_cols = 128 * warpgroups
    print(f"M = {args.m}: {tokens}-token tile, {warpgroups} warpgroup(s), {tile_cols} columns a block")
    g = args.group_size
    hot_head = " hot us |" if args.hot else ""
    print(f"| K x N | splits | blocks | blocks / SM | steps / block | us | GB/s | us / block-step |{hot_head}")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.hot else ""))
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        copies = [ops.awq_gemv_repack(*random_awq(k, n, g, "cuda", torch.float16, seed=k + n + i), g)
                  for i in range(COPIES)]
        x = random_input((args.m, k), "cuda", torch.float16)
        steps = k // 32
        col_tiles = (n + tile_cols - 1) // tile_cols
        ref = None
        for splits in (int(v) for v in args.splits.split(",")):
            if splits > steps:
                continue
            y = op(x, *copies[0], n, g, None, tokens, splits)
            if ref is None:
                ref = y.float()
            else:  # every split count sums the same products: a wrong grid shows here
                err = (y.float() - ref).abs().max().item()
                scale = ref.abs().max().item() + 1e-6
                if err > 2e-2 * scale:
                    raise SystemExit(f"{shape} splits={splits}: max |diff| {err} against split 0 (max {scale})")
            us = time_graph(lambda i, s=splits: op(x, *copies[i], n, g, None, tokens, s), COPIES)
            hot = ""
            if args.hot:
                hot = f" {time_graph(lambda i, s=splits: op(x, *copies[0], n, g, None, tokens, s), COPIES):.1f} |"
            # the grid the op launched: a forced count rounds to whole steps a block
            want = splits if splits else None
            if want is None:
                label, spb, z = "auto", None, None
            else:
                spb = -(-steps // want)
                z = -(-steps // spb)
                label = str(splits)
            if spb is None:
                print(f"| {k} x {n} | {label} | – | – | – | {us:.1f} | {w4_bytes(args.m, k, n, g) / us / 1e3:.0f} | – |{hot}")
                continue
            blocks = col_tiles * z
            print(f"| {k} x {n} | {label} | {blocks} | {blocks / sms:.2f} | {spb} | {us:.1f} | "
                  f"{w4_bytes(args.m, k, n, g) / us / 1e3:.0f} | {us / spb:.3f} |{hot}")
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
