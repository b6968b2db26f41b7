"""Every compiled kernel once on small shapes, for `compute-sanitizer` (GPU only).

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py
    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py --only packed,attention

--only runs some of the sections (gemm: awq_gemm on the AWQ layout; packed: the packed-layout
kernels and their prologue / sums forms; attention: decode attention and its rope form; moe: the
grouped expert kernels; moe_packed / moe_gemv_packed: the tensor-core / CUDA-core one on experts in
the packed layout; route: the compiled router): the whole run takes minutes under memcheck.

Shapes are small (the sanitizer slows kernels ~100x) but cover each kernel's edges: column tiles
cut short, several K splits (split-K workspaces and counters), odd M, bias, fp16 and bf16,
every named kernel that takes the problem.
Results are also checked against the reference, so a clean run is clean and right.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, "tests")
from conftest import assert_close_to_reference, random_awq, random_input  # noqa: E402

from fastawq import _ext, reference  # noqa: E402


@contextlib.contextmanager
def env_set(env: dict[str, str]):
    """The A/B switches the kernels read at each call, set for a block; what the caller set stays."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


SECTIONS = ("gemm", "packed", "attention", "moe", "moe_packed", "moe_gemv_packed", "route")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        ap.error(f"--only {args.only!r}: choose from {', '.join(SECTIONS)}")
    if not _ext.is_loaded():
        raise SystemExit(f"fastawq._C is not loaded: {_ext.status()}")
    ops = torch.ops.fastawq
    n_calls = 0
    for dtype in (torch.float16, torch.bfloat16) if "gemm" in only else ():
        for k, n, g in ((256, 160, 64), (576, 544, 32), (1024, 96, 128)):
            qw, s, qz = random_awq(k, n, g, "cuda", dtype, seed=k + n)
            bias = random_input((n,), "cuda", dtype, seed=2)
            w = ops.awq_dequantize(qw, s, qz, g)
            assert w.shape == (k, n)
            for m in (1, 2, 3, 5, 8, 17, 40):
                x = random_input((m, k), "cuda", dtype, seed=m)
                for kernel in ("auto", "gemv", "gemv_staged", "mma", "dequant_cublas"):
                    if ops.awq_gemm_declines(kernel, m, n, k, g):
                        continue
                    out = ops.awq_gemm(x, qw, s, qz, g, bias, kernel)
                    assert_close_to_reference(out, x, qw, s, qz, g, bias)
                    n_calls += 1
    if "packed" in only and hasattr(ops, "awq_gemm_packed"):
        from fastawq.ops.repack import awq_gemv_repack

        # The three kernels on the packed layout, each up to its largest M; awq_gemm_packed also
        # with every tile and forced K splits (one step a block, and one split).
        for dtype in (torch.float16, torch.bfloat16):
            for k, n, g in ((256, 160, 64), (1024, 392, 128)):
                qw, s, qz = random_awq(k, n, g, "cuda", dtype, seed=k + n)
                wp, sz = awq_gemv_repack(qw, s, qz, g)
                bias = random_input((n,), "cuda", dtype, seed=2)
                calls = [(m, "awq_gemv_packed", ()) for m in (1, 2, 5)]
                calls += [(m, "awq_mma_packed", ()) for m in (3, 12, 32)]
                calls += [(m, "awq_gemm_packed", tile) for m in (1, 17, 70)
                          for tile in ((), (1, 1, 1), (2, 2, k // 32), (4, 1, 3), (1, 2, 0))]
                if hasattr(ops, "awq_wgmma_packed") and not ops.awq_wgmma_packed_declines():
                    calls += [(m, "awq_wgmma_packed", tile) for m in (1, 17, 70, 130)
                              for tile in ((), (32, 1), (64, k // 32), (128, 3))]
                for m, name, tile in calls:
                    x = random_input((m, k), "cuda", dtype, seed=m)
                    out = getattr(ops, name)(x, wp, sz, n, g, bias, *tile)
                    assert_close_to_reference(out, x, qw, s, qz, g, bias)
                    n_calls += 1
                # awq_gemm_packed's weights in row order (session 36) in the per-warp and shared x modes.
                for env in ({}, {"FASTAWQ_GEMM_SHARE_X": "1"}):
                    with env_set(env):
                        for m, tile in ((17, ()), (70, (4, 1, 3)), (24, (1, 2, k // 32))):
                            x = random_input((m, k), "cuda", dtype, seed=m)
                            out = ops.awq_gemm_packed(x, wp, sz, n, g, bias, *tile)
                            assert_close_to_reference(out, x, qw, s, qz, g, bias)
                            n_calls += 1
                if hasattr(ops, "awq_wgmma_packed") and not ops.awq_wgmma_packed_declines():
                    # Its A/B switches (read at each call): one- and two-warpgroup blocks, the 4- and
                    # 8-slot rings, the warp-specialized and plain forms forced, the 16-token tile's
                    # five-block instance, the pairs through the ring at every tile and at none, the
                    # cluster reduction (the default, so in every case above) off and serving 32 splits.
                    for env in ({"FASTAWQ_WGMMA_WARPGROUPS": "1"}, {"FASTAWQ_WGMMA_WARPGROUPS": "2"},
                                {"FASTAWQ_WGMMA_DEPTH": "4"}, {"FASTAWQ_WGMMA_DEPTH": "8"},
                                {"FASTAWQ_WGMMA_FORM": "ws"}, {"FASTAWQ_WGMMA_FORM": "plain"},
                                {"FASTAWQ_WGMMA_OCC": "0"}, {"FASTAWQ_WGMMA_SCALES": "ring"},
                                {"FASTAWQ_WGMMA_SCALES": "0"}, {"FASTAWQ_WGMMA_CLUSTER": "0"},
                                {"FASTAWQ_WGMMA_CLUSTER_PLAN": "32"}):
                        with env_set(env):
                            for m, tile in ((17, ()), (9, (16, 0)), (130, (128, 3)), (70, (64, k // 32)),
                                            (40, (32, min(12, k // 32))), (70, (64, 5))):
                                x = random_input((m, k), "cuda", dtype, seed=m)
                                out = ops.awq_wgmma_packed(x, wp, sz, n, g, bias, *tile)
                                assert_close_to_reference(out, x, qw, s, qz, g, bias)
                                n_calls += 1
                if k == 1024 and hasattr(ops, "awq_wgmma_packed") and not ops.awq_wgmma_packed_declines():
                    # The 64-token plan's one-warpgroup case (session 40): K = 4096, N = 4000, whose
                    # two-warpgroup plan would leave the cluster with ranges of 8-10 steps.
                    qw4, s4, qz4 = random_awq(4096, 4000, g, "cuda", dtype, seed=40)
                    wp4, sz4 = awq_gemv_repack(qw4, s4, qz4, g)
                    bias4 = random_input((4000,), "cuda", dtype, seed=41)
                    for m in (40, 64):
                        x = random_input((m, 4096), "cuda", dtype, seed=m)
                        out = ops.awq_wgmma_packed(x, wp4, sz4, 4000, g, bias4)
                        assert_close_to_reference(out, x, qw4, s4, qz4, g, bias4)
                        n_calls += 1
                if hasattr(ops, "awq_wgmma_packed_sums") and not ops.awq_wgmma_packed_declines():
                    # Adds into the caller's fp32 sums, in the plain form (the default) and the
                    # warp-specialized one (FASTAWQ_WGMMA_FORM=ws, session 38) on every tile.
                    for env, m, tile in [({}, 9, ()), ({}, 16, (16, 1)), ({}, 32, (32, 3)), ({}, 64, ())] + [
                            ({"FASTAWQ_WGMMA_FORM": "ws"}, m, tile)
                            for m, tile in ((16, (16, 3)), (64, ()), (70, (64, k // 32)), (130, (128, 3)))]:
                        x = random_input((m, k), "cuda", dtype, seed=m + 3)
                        sums = torch.zeros(m, n, device="cuda")
                        with env_set(env):
                            ops.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, sums, *tile)
                        assert_close_to_reference(sums, x, qw, s, qz, g, bias)
                        n_calls += 1
                if hasattr(ops, "awq_gemv_packed_act"):
                    for m in (1, 2):  # act(gate) * up staged in shared memory
                        gu = random_input((m, 2 * k), "cuda", dtype, seed=m + 1)
                        out = ops.awq_gemv_packed_act(gu, wp, sz, n, g, bias, "silu")
                        assert_close_to_reference(out, reference.act_mul(gu, "silu"), qw, s, qz, g, bias)
                        n_calls += 1
                if hasattr(ops, "awq_gemv_packed_sums"):
                    for m in (1, 2):  # added into zeroed fp32 sums (FASTAWQ_DENSE_SUMS)
                        x = random_input((m, k), "cuda", dtype, seed=m + 5)
                        sums = torch.zeros(m, n, device="cuda")
                        zero = torch.ones(m, 2 * n, device="cuda")  # a later projection's sums (FASTAWQ_DENSE_GU_SUMS)
                        ops.awq_gemv_packed_sums(x, wp, sz, n, g, bias, sums, zero)
                        assert_close_to_reference(sums.to(dtype), x, qw, s, qz, g, bias)
                        assert not zero.any()
                        gu = random_input((m, 2 * k), "cuda", dtype, seed=m + 6)
                        for gate_up in (gu, gu.float()):  # fp32: gate_up's own sums
                            sums = torch.zeros(m, n, device="cuda")
                            ops.awq_gemv_packed_act_sums(gate_up, wp, sz, n, g, bias, "silu", sums)
                            assert_close_to_reference(sums.to(dtype), reference.act_mul(gu, "silu"), qw, s, qz, g,
                                                      bias)
                        n_calls += 3
                if hasattr(ops, "awq_gemv_packed_norm"):
                    for m in (1, 2):  # add + RMSNorm staged in shared memory
                        x = random_input((m, k), "cuda", dtype, seed=m + 2)
                        r = random_input((m, k), "cuda", dtype, seed=m + 3)
                        nw = random_input((k,), "cuda", dtype, seed=4)
                        out, r_out = ops.awq_gemv_packed_norm(x, r, nw, 1e-6, 0.0, wp, sz, n, g, bias)
                        h, want_r = reference.add_rms_norm(x, r, nw, 1e-6)
                        assert_close_to_reference(out, h, qw, s, qz, g, bias)
                        assert torch.equal(r_out, want_r)
                        n_calls += 1
    if "attention" in only and hasattr(ops, "decode_attention"):
        for dtype in (torch.float16, torch.bfloat16):
            for d, hq, hkv in ((128, 32, 8), (64, 8, 8), (256, 8, 2)):
                b, cap = 2, 300
                q = random_input((b, hq, d), "cuda", dtype, seed=d)
                kc = random_input((b, cap, hkv, d), "cuda", dtype, seed=d + 1)
                vc = random_input((b, cap, hkv, d), "cuda", dtype, seed=d + 2)
                lens = torch.tensor([1, 257], dtype=torch.int32, device="cuda")
                out = ops.decode_attention(q, kc, vc, lens, d ** -0.5)
                assert torch.isfinite(out).all()
                n_calls += 1
                if hasattr(ops, "rope_decode_attention"):
                    # The rope form: new rows at 0 and 256 (split 0 and a later split write them),
                    # with and without the q/k norms; checked against the two-step reference.
                    qkv = random_input((b, 1, (hq + 2 * hkv) * d), "cuda", dtype, seed=d + 3)
                    pos = (lens - 1).reshape(b, 1)
                    ang = torch.arange(cap, device="cuda")[:, None] * 0.01 * torch.arange(d, device="cuda")[None]
                    cos, sin = ang.cos().float().contiguous(), ang.sin().float().contiguous()
                    for norms in ((None, None), tuple(random_input((d,), "cuda", dtype, seed=s) for s in (4, 5))):
                        kw, vw, kr, vr = kc.clone(), vc.clone(), kc.clone(), vc.clone()
                        got = ops.rope_decode_attention(qkv, pos, cos, sin, kw, vw, lens, *norms, 1e-6, hq, d ** -0.5)
                        qr = reference.rope_kv_cache(qkv, pos, cos, sin, kr, vr, hq, hkv, d, *norms, 1e-6)
                        want = reference.decode_attention(qr.reshape(b, hq, d), kr, vr, lens, d ** -0.5)
                        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                        torch.testing.assert_close(kw, kr, rtol=1e-2, atol=1e-2)
                        n_calls += 1
                        # qkv as fp32 sums (FASTAWQ_QKV_SUMS): read as the caches' dtype, exactly.
                        kf, vf = kc.clone(), vc.clone()
                        got_f = ops.rope_decode_attention(qkv.float(), pos, cos, sin, kf, vf, lens, *norms, 1e-6, hq,
                                                          d ** -0.5)
                        assert torch.equal(got_f, got) and torch.equal(kf, kw) and torch.equal(vf, vw)
                        n_calls += 1
    moe_ops = [name for name in ("moe_gemv_w4", "moe_mma_w4") if "moe" in only and hasattr(ops, name)]
    if moe_ops:
        from test_moe_op import check, moe_case

        # (E, H, I, G, k, T): part tiles in w13 (I = 160) and w2 (H = 288), K split (H = 1024), ids
        # outside [0, E), int32 ids; 19 tokens on 3 experts: passes of 8 and of 16 (the tensor-core
        # kernel, both widths); 2,400 ids: the tensor-core kernel's id scans over two batches.
        cases = ((8, 288, 160, 32, 2, 1), (16, 1024, 96, 32, 4, 3), (4, 64, 1024, -1, 2, 2), (4, 128, 96, 32, 3, 19),
                 (16, 256, 128, 64, 8, 300))
        variants = [(name, (), {}) for name in moe_ops]
        if "moe_mma_w4" in moe_ops:
            variants.append(("moe_mma_w4", (16,), {}))
            # The defaults (one id a thread read once for the expert scan and the gather at
            # T * k <= 128; w2's scan, gather and first weight copies before its PDL wait) each
            # off, and both.
            one_round = {"FASTAWQ_MOE_MMA_ONE_ROUND": "0"}
            early = {"FASTAWQ_MOE_MMA_EARLY_W2": "0"}
            variants += [("moe_mma_w4", (8,), one_round), ("moe_mma_w4", (16,), one_round),
                         ("moe_mma_w4", (8,), early), ("moe_mma_w4", (16,), {**early, **one_round})]
            # The persistent form (one launch, ordered work items), with as many blocks as fit and
            # with three taking every item, also claiming items ahead.
            persistent = {"FASTAWQ_MOE_MMA_PERSISTENT": "1"}
            ahead = {**persistent, "FASTAWQ_MOE_MMA_AHEAD": "1"}
            variants += [("moe_mma_w4", (8,), persistent), ("moe_mma_w4", (16,), persistent),
                         ("moe_mma_w4", (8,), {**persistent, "FASTAWQ_MOE_MMA_GRID": "3"}),
                         ("moe_mma_w4", (8,), ahead), ("moe_mma_w4", (16,), {**ahead, "FASTAWQ_MOE_MMA_GRID": "3"})]
        if hasattr(ops, "moe_gemv_w4_sums"):  # fp32 sums, checked once rounded
            variants.append(("moe_gemv_w4_sums", (), {}))
        for name, extra, env in variants:
            op = getattr(ops, name)
            with env_set(env):
                for dtype in (torch.float16, torch.bfloat16):
                    for e, h, i, g, k, t in cases:
                        weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=h + i, dtype=dtype)
                        out = op(x, ids.to(torch.int32), w, *weights, g, "silu", *extra)
                        check(out.to(dtype), x, ids, w, weights, g)
                        bad = ids.clone()
                        bad[0, 0] = e
                        op(x, bad, w, *weights, g, "gelu", *extra)
                        n_calls += 2
    if "moe_packed" in only and hasattr(ops, "moe_mma_packed_w4"):
        from fastawq.ops import repack
        from test_moe_op import check, moe_case

        # moe_mma on the experts in the packed layout: part tiles (I = 160, H = 288), K split
        # (H = 1024), group -1, ids outside [0, E), passes of 8 and 16, w2 early and not.
        # The defaults' w2, two chunks a warp, and w2's wide form (FASTAWQ_MOE_PACKED_W2_WIDE); w2's L2
        # prefetch of the steps past its register ring (FASTAWQ_MOE_PACKED_PREFETCH), early and not.
        for early, chunks, wide, pf in (("0", "4", "0", "0"), ("1", "4", "0", "0"), ("1", "2", "0", "0"),
                                        ("1", "4", "1", "0"), ("1", "4", "0", "4"), ("0", "4", "0", "64")):
            with env_set({"FASTAWQ_MOE_MMA_EARLY_W2": early, "FASTAWQ_MOE_PACKED_CHUNKS": chunks,
                          "FASTAWQ_MOE_PACKED_W2_WIDE": wide, "FASTAWQ_MOE_PACKED_PREFETCH": pf}):
                for dtype in (torch.float16, torch.bfloat16):
                    for e, h, i, g, k, t in ((8, 288, 160, 32, 2, 1), (16, 1024, 96, 32, 4, 3), (4, 64, 1024, -1, 2, 2),
                                             (4, 128, 96, 32, 3, 19), (16, 256, 128, 64, 8, 300)):
                        weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=h + i, dtype=dtype)
                        packed = repack.awq_experts_repack(*weights, g)
                        for rows in (8, 16):
                            out = ops.moe_mma_packed_w4(x, ids.to(torch.int32), w, *packed, g, "silu", rows)
                            check(out, x, ids, w, weights, g)
                            bad = ids.clone()
                            bad[0, 0] = e
                            ops.moe_mma_packed_w4(x, bad, w, *packed, g, "gelu", rows)
                            n_calls += 2
    if "moe_gemv_packed" in only and hasattr(ops, "moe_gemv_packed_w4"):
        from fastawq.ops import repack
        from test_moe_op import check, moe_case

        # The CUDA-core kernel on packed experts: part tiles, w13 split (h_part) and not, w2 split
        # (arrival counters) and top-1 direct writes, the sums form, half2 and fp32 sums, bad ids.
        for h2 in ("0", "1"):
            with env_set({"FASTAWQ_MOE_PACKED_H2": h2}):
                for dtype in (torch.float16, torch.bfloat16):
                    for e, h, i, g, k, t in ((8, 288, 160, 32, 2, 1), (16, 1024, 96, 32, 4, 3), (4, 64, 1024, -1, 2, 2),
                                             (8, 128, 96, 32, 1, 1), (16, 2048, 256, 64, 8, 1)):
                        weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=h + i + 1, dtype=dtype)
                        packed = repack.awq_experts_repack(*weights, g)
                        check(ops.moe_gemv_packed_w4(x, ids.to(torch.int32), w, *packed, g, "silu"), x, ids, w,
                              weights, g)
                        sums = ops.moe_gemv_packed_w4_sums(x, ids, w, *packed, g, "silu")
                        check(sums.to(dtype), x, ids, w, weights, g)
                        bad = ids.clone()
                        bad[0, 0] = e
                        ops.moe_gemv_packed_w4(x, bad, w, *packed, g, "gelu")
                        n_calls += 3
    if "route" in only and hasattr(ops, "moe_route"):
        from test_moe_op import exact_router, unit_norm_inputs

        # (T, H, E, k): 16 parts meeting through the counters, one part, element loads (H % 8 != 0),
        # the most experts; with and without the norm.
        for dtype in (torch.float16, torch.bfloat16):
            for t, h, e, k in ((1, 2048, 128, 8), (3, 4096, 8, 2), (2, 200, 60, 4), (5, 256, 1024, 32)):
                x, rw = exact_router(t, h, e, dtype, seed=h + e)
                xn, res, nw = unit_norm_inputs(t, h, dtype, seed=e)
                want_w, want_ids = reference.route(x, rw, k)
                got_w, got_ids, _, _ = ops.moe_route(x, None, None, 0.0, 0.0, rw, k, True, "softmax", None, 1.0)
                torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
                want_h, want_r = reference.add_rms_norm(xn, res, nw, 0.0, 0.0)
                _, _, got_h, got_r = ops.moe_route(xn, res, nw, 0.0, 0.0, rw, k, False, "sigmoid", None, 1.0)
                assert torch.equal(got_h, want_h) and torch.equal(got_r, want_r)
                n_calls += 2
                if torch.cuda.get_device_capability() == (9, 0) and e <= 128 and h % 8 == 0:
                    # x as fp32 sums (FASTAWQ_MOE_O_SUMS): the cluster form reads them
                    _, _, got_h, got_r = ops.moe_route(xn.float(), res, nw, 0.0, 0.0, rw, k, False, "sigmoid", None,
                                                       1.0)
                    assert torch.equal(got_h, want_h) and torch.equal(got_r, want_r)
                    n_calls += 1
    torch.cuda.synchronize()
    print(f"sanitize ({', '.join(s for s in SECTIONS if s in only)}): {n_calls} kernel calls ran and matched the "
          "reference")


if __name__ == "__main__":
    main()
