"""The tensor-core MoE kernels (moe_mma_w4, csrc/moe/moe_mma.cu): each expert read once per call.

CPU: a bit-level emulation of one block's fragments on the AWQ layout (written from the kernel's
comments: which rows and words a lane loads, the byte permute that pairs two rows' nibbles into an
A register, the B registers from x, the C layout, the column of each nibble, and the one
accumulator rescaled at each group's close) matches the reference dequant-matmul, for both
kernels' word pairs (w13: a gate and an up word; w2: two adjacent words), so the labelling is
checked without a GPU. GPU (skipped without CUDA and the compiled op): the op against
reference.moe_w4 for ragged loads (experts with no token, one expert with every token, more
tokens per expert than one pass of 8), K splits, ids outside [0, E), under graph replay.
"""
from __future__ import annotations

import pytest
import torch

from conftest import random_awq, random_input
from fastawq import _ext, backend, reference
from fastawq.ops import moe as ops_moe
from test_mma_packed import MAGIC, _byte_perm, _column_pair, _place_a
from test_moe_op import check, moe_case, poisoned_empty, replay_checks  # noqa: F401 (a fixture)

HAS_KERNEL = torch.cuda.is_available() and _ext.has_op("moe_mma_w4")
requires_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and fastawq._C with moe_mma_w4")

AWQ_COL = [reference.AWQ_ORDER[i] for i in range(8)]  # the kernel's awq_col(i)


def _pair(lo: int, hi: int, b: int, magic: int) -> int:
    """column_pair<T, b>(lo, hi) of the kernel: byte b's low nibble of each word, magic in the mantissa."""
    sel = b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)
    return (_byte_perm(lo, hi, sel) & 0x000F000F) | (magic << 16) | magic


def _unit(s: float) -> float:
    return s if abs(s) >= 2.0**-60 else 2.0**-60  # gemv::fold_unit


def _b_fragment(xf: torch.Tensor, s: int, h: int) -> torch.Tensor:
    """The 16 x 8 B tile of k-step h of step s: lane (gq, t) holds x[token gq][32s + 8t + 4h .. + 3]
    (tokens past M clamped to the last)."""
    b = torch.zeros(16, 8)
    for lane in range(32):
        gq, t = divmod(lane, 4)
        row = min(gq, xf.shape[0] - 1)
        k0 = 32 * s + 8 * t + 4 * h
        b[2 * t : 2 * t + 2, gq] = xf[row, k0 : k0 + 2]
        b[2 * t + 8 : 2 * t + 10, gq] = xf[row, k0 + 2 : k0 + 4]
    return b


def _emulate_tile(x, qw, sc, qz, g, tile: int, w13: bool, inter: int = 0, steps_per_warp: int | None = None):
    """The block's tile [M <= 8, 128] as the kernel computes it (w13: 64 gate then 64 up columns)."""
    dtype = x.dtype
    magic_bits, magic = MAGIC[dtype]
    m, k = x.shape
    n8 = qw.shape[1]
    words = (qw.to(torch.int64) & 0xFFFFFFFF).tolist()
    zeros = (qz.to(torch.int64) & 0xFFFFFFFF).tolist()
    scales = sc.float().tolist()
    xf = x.float()

    def lane_words(gq: int) -> tuple[tuple[int, int], tuple[bool, bool]]:
        """The lane's word of each group and whether it exists."""
        if w13:
            p0 = tile * 8 + gq
            return (p0, inter // 8 + p0), (p0 < inter // 8, p0 < inter // 8)
        p0 = tile * 16 + gq
        return (p0, p0 + 8), (p0 < n8, p0 + 8 < n8)

    def tile_col(gq: int, j: int, i: int) -> int:
        return 64 * j + 8 * gq + AWQ_COL[i]

    s_total = k // 32
    steps = steps_per_warp or s_total
    red = torch.zeros(m, 128, dtype=torch.float64)
    for s0 in range(0, s_total, steps):  # one warp per range of steps
        s1 = min(s0 + steps, s_total)
        # acc[j][b]: the 16 x 8 C tile of m-tile (word j, byte b), fp32 as the mma keeps it
        acc = [[torch.zeros(16, 8) for _ in range(4)] for _ in range(2)]
        xs = torch.zeros(16, 8)
        for s in range(s0, s1):
            for h in range(2):
                b_frag = _b_fragment(xf, s, h)
                xs += torch.ones(16, 16) @ b_frag
                for j in range(2):
                    for b in range(4):
                        a = torch.zeros(16, 16)
                        for lane in range(32):
                            gq, t = divmod(lane, 4)
                            pw, ok = lane_words(gq)
                            rows = [32 * s + 8 * t + 4 * h + u for u in range(4)]
                            w = [words[r][pw[j]] if ok[j] else 0 for r in rows]
                            regs = [_pair(w[0], w[1], b, magic_bits), _pair(w[0] >> 4, w[1] >> 4, b, magic_bits),
                                    _pair(w[2], w[3], b, magic_bits), _pair(w[2] >> 4, w[3] >> 4, b, magic_bits)]
                            _place_a(a, gq, t, regs, dtype)
                        acc[j][b] += a @ b_frag
            last = s + 1 == s1
            if (s + 1) * 32 % g == 0 or last:  # close the group: acc = r (acc - zm xs)
                grp = s * 32 // g
                for j in range(2):
                    for b in range(4):
                        for frag_row in range(16):
                            gq, hi = frag_row % 8, frag_row // 8
                            pw, ok = lane_words(gq)
                            word, ok = pw[j], ok[j]
                            i = 2 * b + hi
                            su = _unit(scales[grp][8 * word + AWQ_COL[i]] if ok else 0.0)
                            sn = _unit(scales[grp + 1][8 * word + AWQ_COL[i]] if ok else 0.0) if not last else 1.0
                            zm = magic + (((zeros[grp][word] if ok else 0) >> (4 * i)) & 15)
                            acc[j][b][frag_row] = (su / sn) * (acc[j][b][frag_row] - zm * xs[frag_row])
                xs.zero_()
        for j in range(2):
            for b in range(4):
                for frag_row in range(16):
                    gq, hi = frag_row % 8, frag_row // 8
                    for tok in range(min(m, 8)):
                        red[tok, tile_col(gq, j, 2 * b + hi)] += acc[j][b][frag_row, tok].item()
    return red.float()


@pytest.mark.parametrize("w13", [True, False], ids=["w13", "w2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,g,steps", [(3, 64, 32, None), (8, 128, 64, 3), (1, 96, 32, 2)])
def test_fragments_as_the_kernel_reads_them(w13, dtype, m, k, g, steps):
    inter = 96  # w13: 2I = 192 columns, the block's tile 1 has half its gate/up words past I
    n = 2 * inter if w13 else 160  # w2: tile 1 has words 20..27 of 20 (none) and its first group part-filled
    qw, s, qz = random_awq(k, n, g, "cpu", dtype, seed=m + k)
    s[0, 5] = 0.0  # a zero scale: its group adds nothing, and nothing becomes inf or NaN
    x = random_input((m, k), "cpu", dtype, seed=k)
    ref = x.float() @ reference.dequantize(qw, s.float(), qz, g)  # (q - z) s unrounded, as the kernel
    for tile in range(2):
        got = _emulate_tile(x, qw, s, qz, g, tile, w13, inter, steps)
        assert torch.isfinite(got).all()
        if w13:
            cols = [c for c in range(64) if tile * 64 + c < inter]
            want_gate = ref[:, [tile * 64 + c for c in cols]]
            want_up = ref[:, [inter + tile * 64 + c for c in cols]]
            torch.testing.assert_close(got[:, cols], want_gate, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(got[:, [64 + c for c in cols]], want_up, rtol=1e-4, atol=1e-3)
        else:
            cols = [c for c in range(128) if tile * 128 + c < n]
            torch.testing.assert_close(got[:, cols], ref[:, [tile * 128 + c for c in cols]], rtol=1e-4, atol=1e-3)


def _emulate_tile_packed(x, wp, sz, g, tile: int, w13: bool, n: int, inter: int = 0, steps_per_warp: int | None = None,
                         chunks: int = 4):
    """run_work_packed's tile [M <= 8, 128] from the packed layout (w13: 64 gate then 64 up columns):
    `chunks` chunks of 32 columns a warp (4: all, over steps_per_warp steps of K; 2: half of them,
    over twice as many), lane (gq, t) reading the 16 bytes at (kb = 4s + t, its chunk's c4)."""
    dtype = x.dtype
    magic_bits, magic = MAGIC[dtype]
    m, k = x.shape
    n4 = n // 4
    words = (wp.view(k // 8, n4, 4).to(torch.int64) & 0xFFFFFFFF).tolist()
    pairs = sz.view(k // g, n, 2).float().tolist()
    xf = x.float()

    def chunk_c4(q: int, gq: int) -> tuple[int, bool]:
        """The lane's c4 in the tile's chunk q and whether it exists (moe_mma.cuh's c4, col_ok)."""
        if w13:
            local = tile * 16 + 8 * (q & 1) + gq
            return (0 if q < 2 else inter // 4) + local, local < inter // 4
        c4 = tile * 32 + 8 * q + gq
        return c4, c4 < n4

    s_total = k // 32
    steps = (steps_per_warp or s_total) * (4 // chunks)
    red = torch.zeros(m, 128, dtype=torch.float64)
    warps = [(first, s0) for first in range(0, 4, chunks) for s0 in range(0, s_total, steps)]
    for first, s0 in warps:  # one warp per chunk set and range of steps
        s1 = min(s0 + steps, s_total)
        qs = range(first, first + chunks)  # the tile's chunks the warp takes
        acc = {q: [torch.zeros(16, 8) for _ in range(2)] for q in qs}  # [chunk][m-tile]
        xs = torch.zeros(16, 8)
        for s in range(s0, s1):
            for h in range(2):
                b_frag = _b_fragment(xf, s, h)
                xs += torch.ones(16, 16) @ b_frag
                for q in qs:
                    for i in range(2):
                        a = torch.zeros(16, 16)
                        for lane in range(32):
                            gq, t = divmod(lane, 4)
                            c4, ok = chunk_c4(q, gq)
                            w = words[4 * s + t][c4] if ok else [0, 0, 0, 0]
                            w0, w1 = w[2 * h], w[2 * h + 1]
                            regs = [_column_pair(w0, 2 * i, magic_bits), _column_pair(w0, 2 * i + 1, magic_bits),
                                    _column_pair(w1, 2 * i, magic_bits), _column_pair(w1, 2 * i + 1, magic_bits)]
                            _place_a(a, gq, t, regs, dtype)
                        acc[q][i] += a @ b_frag
            last = s + 1 == s1
            if (s + 1) * 32 % g == 0 or last:  # close the group from the lane's own pairs
                grp = s * 32 // g
                for q in qs:
                    for i in range(2):
                        for frag_row in range(16):
                            gq, hi = frag_row % 8, frag_row // 8
                            c4, ok = chunk_c4(q, gq)
                            col = 4 * c4 + 2 * i + hi
                            su = _unit(pairs[grp][col][0] if ok else 0.0)
                            sn = 1.0 if last else _unit(pairs[grp + 1][col][0] if ok else 0.0)
                            zm = magic + (pairs[grp][col][1] if ok else 0.0)
                            acc[q][i][frag_row] = (su / sn) * (acc[q][i][frag_row] - zm * xs[frag_row])
                xs.zero_()
        for q in qs:
            for i in range(2):
                for frag_row in range(16):
                    gq, hi = frag_row % 8, frag_row // 8
                    for tok in range(min(m, 8)):
                        red[tok, 32 * q + 4 * gq + 2 * i + hi] += acc[q][i][frag_row, tok].item()
    return red.float()


@pytest.mark.parametrize("chunks", [4, 2])
@pytest.mark.parametrize("w13", [True, False], ids=["w13", "w2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,g,steps", [(3, 64, 32, None), (8, 128, 64, 3), (1, 96, 32, 2), (2, 256, 64, 1)])
def test_packed_fragments_as_the_kernel_reads_them(w13, dtype, m, k, g, steps, chunks):
    # moe_mma_packed_w4's index math (moe_mma.cuh, run_work_packed), on the CPU: the same tiles as
    # test_fragments_as_the_kernel_reads_them, from the experts' packed layout.
    from fastawq.ops import repack

    inter = 96
    n = 2 * inter if w13 else 160
    qw, s, qz = random_awq(k, n, g, "cpu", dtype, seed=m + k)
    s[0, 5] = 0.0
    x = random_input((m, k), "cpu", dtype, seed=k)
    wp, sz = repack.awq_gemv_repack(qw, s, qz, g)
    ref = x.float() @ reference.dequantize(qw, s.float(), qz, g)
    for tile in range(2):
        got = _emulate_tile_packed(x, wp, sz, g, tile, w13, n, inter, steps, chunks)
        assert torch.isfinite(got).all()
        if w13:
            cols = [c for c in range(64) if tile * 64 + c < inter]
            torch.testing.assert_close(got[:, cols], ref[:, [tile * 64 + c for c in cols]], rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(got[:, [64 + c for c in cols]], ref[:, [inter + tile * 64 + c for c in cols]],
                                       rtol=1e-4, atol=1e-3)
        else:
            cols = [c for c in range(128) if tile * 128 + c < n]
            torch.testing.assert_close(got[:, cols], ref[:, [tile * 128 + c for c in cols]], rtol=1e-4, atol=1e-3)


def _ring_word(r: int, w: int) -> int:
    """moe_mma.cu's ring_word: where word w (0..15) of step row r (0..31) sits in a ring slot."""
    return 144 * (r >> 3) + 16 * (r & 7) + (w ^ (8 * ((r >> 4) & 1)))


def test_ring_layout_holds_a_step_and_reads_conflict_free():
    slots = {_ring_word(r, w) for r in range(32) for w in range(16)}
    assert len(slots) == 32 * 16 and max(slots) < 4 * 144  # one place per word, inside kSlotWords
    for r in range(32):  # each 16-byte chunk (4 words of a group) stays contiguous and aligned
        for c in range(4):
            pos = [_ring_word(r, 4 * c + d) for d in range(4)]
            assert pos == list(range(pos[0], pos[0] + 4)) and pos[0] % 4 == 0
    for i in range(8):  # a read: lane (g, t) takes word g of group j in row 8t + i
        for j in range(2):
            banks = {_ring_word(8 * t + i, 8 * j + g) % 32 for g in range(8) for t in range(4)}
            assert len(banks) == 32


def _expert_rows(ids: list[int], e: int) -> tuple[list[int], list[int], int, int]:
    """expert_rows of the kernel: the bitmap of valid ids, each word's prefix of set bits, the
    distinct count and whether any id lies outside [0, E)."""
    words = (e + 31) // 32
    present = [0] * 32
    bad = 0
    for i in ids:
        if 0 <= i < e:
            present[i >> 5] |= 1 << (i & 31)
        else:
            bad = 1
    counts = [bin(present[w]).count("1") if w < words else 0 for w in range(32)]
    prefix = [sum(counts[:w]) for w in range(32)]
    return present, prefix, sum(counts), bad


def _row_expert(present: list[int], prefix: list[int], distinct: int, e: int, z: int) -> int:
    """row_expert of the kernel: a binary search for the last word whose prefix is <= z, then the
    (z - prefix)-th set bit of it."""
    if z >= distinct:
        return e
    lo, hi = 0, (e + 31) // 32 - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        lo, hi = (mid, hi) if prefix[mid] <= z else (lo, mid - 1)
    m = present[lo]
    for _ in range(z - prefix[lo]):
        m &= m - 1
    return 32 * lo + (m & -m).bit_length() - 1


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_persistent_schedule_never_deadlocks_and_reads_h_when_final(seed, ahead):
    """moe_mma_persistent_kernel's schedule, run on the CPU: its row list and item arithmetic, and
    blocks that each take the next item from a counter, interleaved at random. A w2 item starts
    only once its row's w13 tiles published (tiles13 publishes: the tile's block with one split,
    else its splits' last arrival), every item runs once, nothing deadlocks with 1 to 9 blocks (also
    when each block claims its next item as soon as its current one no longer waits:
    FASTAWQ_MOE_MMA_AHEAD), and the last block out leaves every counter zeroed."""
    import random

    rnd = random.Random(seed)
    e = rnd.choice([8, 60, 128, 1024])
    n = rnd.choice([1, 5, 64, 300])
    ids = [rnd.randrange(e) for _ in range(n)]
    if seed % 2:
        ids[rnd.randrange(n)] = rnd.choice([-1, e, 10**6])  # a bad id: one more row
    present, prefix, distinct, bad = _expert_rows(ids, e)
    experts = sorted({i for i in ids if 0 <= i < e})
    assert [_row_expert(present, prefix, distinct, e, z) for z in range(distinct + bad)] == experts + [e] * bad
    rows = distinct + bad
    tiles13, splits13, tiles2, splits2 = rnd.randint(1, 5), rnd.randint(1, 3), rnd.randint(1, 5), rnd.randint(1, 2)
    per13, per2 = tiles13 * splits13, tiles2 * splits2
    items13 = rows * per13
    items = items13 + rows * per2
    blocks = rnd.randint(1, 9)
    state = {"next": 0, "exits": 0}
    done13 = [0] * rows
    arrivals = {}
    ran = []

    def block():
        held_ahead = None
        while True:
            if held_ahead is None:
                item = state["next"]
                state["next"] += 1
            else:
                item, held_ahead = held_ahead, None
            if item >= items:
                break
            w13 = item < items13
            local = item if w13 else item - items13
            per = per13 if w13 else per2
            tiles = tiles13 if w13 else tiles2
            z, r = divmod(local, per)
            expert = _row_expert(present, prefix, distinct, e, z)
            tile, split = r % tiles, r // tiles
            real = expert < e
            if not w13 and real:
                while done13[z] < tiles13:
                    yield "wait"
            if ahead:  # the item no longer waits: take the next one now
                held_ahead = state["next"]
                state["next"] += 1
                yield "claimed ahead"
            yield "run"
            ran.append(("w13" if w13 else "w2", z, tile, split))
            if w13 and real:
                if splits13 == 1:
                    done13[z] += 1
                else:
                    key = (z, tile)
                    arrivals[key] = arrivals.get(key, 0) + 1
                    if arrivals[key] == splits13:
                        arrivals[key] = 0
                        done13[z] += 1
            if not w13 and real:
                assert done13[z] == tiles13, "a w2 item ran before its row's h was final"
        state["exits"] += 1
        if state["exits"] == blocks:  # the last block out resets
            done13[:] = [0] * rows
            state["next"] = state["exits"] = 0

    live = [block() for _ in range(blocks)]
    ticks = 0
    while live:
        ticks += 1
        assert ticks < 100_000, "the schedule deadlocked"
        b = rnd.choice(live)
        try:
            next(b)
        except StopIteration:
            live.remove(b)
    assert sorted(ran) == sorted([("w13", z, t, s) for z in range(rows) for s in range(splits13) for t in range(tiles13)]
                                 + [("w2", z, t, s) for z in range(rows) for s in range(splits2) for t in range(tiles2)])
    assert state == {"next": 0, "exits": 0} and done13 == [0] * rows and not any(arrivals.values())


def test_moe_kernel_choice(monkeypatch):
    assert backend.moe_reuse(1, 8, 128) == 1.0
    assert backend.moe_reuse(16, 2, 8) == pytest.approx(32 / (8 * (1 - 0.75**16)))
    assert backend.moe_kernel(1, 8, 128) == "gemv"  # one token: nothing to share, the GEMV
    assert backend.moe_kernel(4, 8, 128) == "gemv"  # Qwen3-30B-A3B: 1.10 assignments per expert reached
    assert backend.moe_kernel(16, 8, 128) == "mma"
    assert backend.moe_kernel(2, 2, 8) == "mma"  # Mixtral: 1.14
    assert backend.moe_kernel(backend.MOE_MMA_MAX_ASSIGN // 8 + 1, 8, 128) == "gemv"  # past the gather's list
    assert backend.moe_kernel(16, 8, backend.MOE_MMA_MAX_EXPERTS + 1) == "gemv"  # past its expert bitmap
    assert backend.moe_pass_rows(16, 8, 128) == 8  # 1.6 assignments per expert reached
    assert backend.moe_pass_rows(256, 8, 128) == 16  # 16
    assert backend.moe_pass_rows(64, 2, 8) == 16 and backend.moe_pass_rows(16, 2, 8) == 8  # Mixtral: 16, 4
    monkeypatch.setattr(backend, "MOE_MMA", False)
    assert backend.moe_kernel(16, 8, 128) == "gemv"


# --- the compiled op ---

# (E, H, I, G, k, T, load): w13 tiles 64 gate columns (I = 96, 160 part tiles), w2 tiles 128
# columns (H = 96, 288 part tiles); few tokens split K, many do not; "one_expert" puts all T
# tokens on expert 0 (passes of 8), "few_experts" leaves most experts without a token.
CASES = [
    (8, 96, 160, 32, 2, 3, "random"),
    (8, 288, 96, 32, 1, 4, "random"),
    (16, 4096, 96, 32, 4, 2, "random"),
    (4, 64, 4096, -1, 2, 5, "random"),
    (8, 128, 96, 32, 2, 33, "one_expert"),
    (8, 128, 96, 32, 3, 19, "few_experts"),
    (128, 2048, 768, 128, 8, 16, "random"),
    (8, 4096, 1024, 128, 2, 16, "random"),
    (8, 256, 320, 64, 2, 47, "one_expert"),  # passes of 16 and 8 both end part-full
    (16, 2048, 768, 128, 8, 64, "random"),  # 32 per expert: no split of K
    # More ids than one batch of the id scans (kIdBatch * 128 = 2,048), the last one part-full.
    (16, 256, 128, 64, 8, 300, "random"),
    (8, 128, 96, 32, 2, 2048, "few_experts"),  # 4,096 ids: the kernel's limit
    (32, 128, 96, 32, 4, 32, "random"),  # 128 ids: one id a thread (FASTAWQ_MOE_MMA_ONE_ROUND)
    (32, 128, 96, 32, 3, 43, "random"),  # 129: one past it
]


def _op(x, ids, w, weights, g, act="silu", pass_rows=8):
    return torch.ops.fastawq.moe_mma_w4(x, ids, w.float().contiguous(), *weights, g, act, pass_rows)


@pytest.fixture(params=["two_launches", "one_round", "early_w2", "default", "persistent", "persistent_ahead"])
def form(request, monkeypatch):
    """The kernel's forms: w13 and w2 as two grids, plain, or with each block reading its ids once
    for the expert scan and the gather where T * k <= 128 (FASTAWQ_MOE_MMA_ONE_ROUND; above, the
    host keeps the usual scans), or with w2's blocks gathering and issuing their first weight copies
    before the PDL wait (FASTAWQ_MOE_MMA_EARLY_W2), or both (the default); or one persistent launch
    whose blocks take both grids' blocks as ordered work items (FASTAWQ_MOE_MMA_PERSISTENT=1), also
    with each block claiming its next item early (FASTAWQ_MOE_MMA_AHEAD=1)."""
    monkeypatch.setenv("FASTAWQ_MOE_MMA_PERSISTENT", "1" if request.param.startswith("persistent") else "0")
    monkeypatch.setenv("FASTAWQ_MOE_MMA_ONE_ROUND", "1" if request.param in ("one_round", "default") else "0")
    monkeypatch.setenv("FASTAWQ_MOE_MMA_EARLY_W2", "1" if request.param in ("early_w2", "default") else "0")
    monkeypatch.setenv("FASTAWQ_MOE_MMA_AHEAD", "1" if request.param == "persistent_ahead" else "0")
    monkeypatch.delenv("FASTAWQ_MOE_MMA_GRID", raising=False)
    return request.param


@requires_kernel
@pytest.mark.parametrize("pass_rows", [8, 16, 24])  # 24: the two launches (the persistent form keeps them)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_kernel_matches_reference(case, dtype, pass_rows, form, poisoned_empty):
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=5 * t + k, dtype=dtype, load=load)
    for _ in range(2):  # the second call finds the workspace and counters the first left zeroed
        check(_op(x, ids, w, weights, g, pass_rows=pass_rows), x, ids, w, weights, g)


def _moe_mma_nts(prof) -> set[str]:
    """The NT template argument (the 5th: n-tiles a pass) of every moe_mma_kernel the profiler saw."""
    return {e.name.replace(" ", "").split("moe_mma_kernel<", 1)[1].split(",")[4]
            for e in prof.events() if "moe_mma_kernel<" in e.name}


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_24_token_passes_by_switch(dtype, monkeypatch, poisoned_empty):
    # FASTAWQ_MOE_MMA_PASS=24 (read at each call) turns the AWQ layout's passes of 16 into passes of 24
    # (three n-tiles, dynamic shared memory), which the profiler names; passes of 8 and the packed
    # layout keep theirs, and the packed op refuses 24 by name. Loads of 0 to 47 tokens an expert:
    # passes that end full and part-full.
    from fastawq.ops import repack

    monkeypatch.delenv("FASTAWQ_MOE_MMA_PERSISTENT", raising=False)
    e, h, i, g, k, t = 8, 256, 320, 64, 2, 47
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=29, dtype=dtype, load="one_expert")
    for env, pass_rows, want in (("24", 16, "3"), ("24", 8, "1"), ("16", 16, "2"), ("", 16, "2"), ("x", 16, "2")):
        monkeypatch.setenv("FASTAWQ_MOE_MMA_PASS", env)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = _op(x, ids, w, weights, g, pass_rows=pass_rows)
            torch.cuda.synchronize()
        check(out, x, ids, w, weights, g)
        assert _moe_mma_nts(prof) == {want}, (env, pass_rows)
    monkeypatch.setenv("FASTAWQ_MOE_MMA_PASS", "24")
    packed = repack.awq_experts_repack(*weights, g)
    check(torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", 16),
          x, ids, w, weights, g)
    with pytest.raises(RuntimeError, match="moe_mma_packed_w4: pass_rows must be 8 or 16, got 24"):
        torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", 24)


# --- the experts in the packed layout (moe_mma_packed_w4; the plan's choice: test_moe_packed.py) ---

HAS_PACKED = HAS_KERNEL and _ext.has_op("moe_mma_packed_w4")
requires_packed = pytest.mark.skipif(not HAS_PACKED, reason="needs CUDA and fastawq._C with moe_mma_packed_w4")


@pytest.mark.parametrize("g", [32, -1])
def test_experts_repack_is_exact_per_expert(g):
    from fastawq.ops import repack

    weights, *_ = moe_case(3, 64, 96, g, 2, 1, seed=21)
    w13p, s13p, w2p, s2p = repack.awq_experts_repack(*weights, g)
    assert w13p.shape == (3, 64 // 8, 2 * 96) and s13p.shape == (3, 64 // (64 if g == -1 else g), 4 * 96)
    assert w2p.shape == (3, 96 // 8, 64) and s2p.shape == (3, 96 // (96 if g == -1 else g), 2 * 64)
    for e in range(3):
        for wp, sp, n, k, (qw, sc, qz) in ((w13p, s13p, 2 * 96, 64, weights[:3]), (w2p, s2p, 64, 96, weights[3:])):
            back = repack.awq_gemv_unpack(wp[e], sp[e], n, k if g == -1 else g)
            assert torch.equal(back[0], qw[e]) and torch.equal(back[1], sc[e]) and torch.equal(back[2], qz[e])


@requires_packed
# chunks: FASTAWQ_MOE_PACKED_CHUNKS; "4w": 4 with w2's wide form (FASTAWQ_MOE_PACKED_W2_WIDE=1: a warp
# a 128-column tile, 4 tiles a block, so H = 96 / 288 leave whole warps past the layer).
@pytest.mark.parametrize("chunks", ["4", "2", "4w"])
@pytest.mark.parametrize("early", ["0", "1"])
@pytest.mark.parametrize("pass_rows", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_packed_kernel_matches_reference(case, dtype, pass_rows, early, chunks, monkeypatch, poisoned_empty):
    from fastawq.ops import repack

    monkeypatch.setenv("FASTAWQ_MOE_MMA_EARLY_W2", early)
    monkeypatch.setenv("FASTAWQ_MOE_PACKED_CHUNKS", chunks[0])
    monkeypatch.setenv("FASTAWQ_MOE_PACKED_W2_WIDE", "1" if chunks == "4w" else "0")
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=7 * t + k, dtype=dtype, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    for _ in range(2):  # the second call finds the workspace and counters the first left zeroed
        out = torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", pass_rows)
        check(out, x, ids, w, weights, g)


@requires_packed
# FASTAWQ_MOE_PACKED_PREFETCH: steps a w2 warp keeps on their way into L2 past its register ring (1; 4,
# Qwen3's whole w2 range at batch 16; 64, past every range here), w2 early and not; the chunk forms it
# does not serve (2 chunks, the wide form) run as they are.
@pytest.mark.parametrize("prefetch", ["1", "4", "64"])
@pytest.mark.parametrize("early", ["0", "1"])
@pytest.mark.parametrize("chunks", ["4", "2", "4w"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_packed_prefetch_by_switch(case, chunks, early, prefetch, monkeypatch, poisoned_empty):
    from fastawq.ops import repack

    monkeypatch.setenv("FASTAWQ_MOE_PACKED_PREFETCH", prefetch)
    monkeypatch.setenv("FASTAWQ_MOE_MMA_EARLY_W2", early)
    monkeypatch.setenv("FASTAWQ_MOE_PACKED_CHUNKS", chunks[0])
    monkeypatch.setenv("FASTAWQ_MOE_PACKED_W2_WIDE", "1" if chunks == "4w" else "0")
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=13 * t + k, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    for pass_rows in (8, 16):
        out = torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", pass_rows)
        check(out, x, ids, w, weights, g)


def _moe_mma_w2_prefetch(prof) -> set[str]:
    """The kPrefetch template argument (the 10th) of every w2 moe_mma_kernel (3rd argument false) the
    profiler saw."""
    args = [e.name.replace(" ", "").split("moe_mma_kernel<", 1)[1].split(">(", 1)[0].split(",")
            for e in prof.events() if "moe_mma_kernel<" in e.name]
    return {a[9] for a in args if a[2] == "false"}


@requires_packed
def test_packed_prefetch_runs_its_own_w2_instance(monkeypatch, poisoned_empty):
    # The switch picks w2's prefetch instances (kPrefetch, named by the profiler) in the tile form at 4
    # chunks a warp only; unset, 0 or out of range it keeps the default instances, as do 2 chunks and
    # the wide form.
    from fastawq.ops import repack

    e, h, i, g, k, t, load = CASES[6]  # Qwen3-30B-A3B's expert shapes at 16 tokens
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=31, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    for pf, chunks, wide, want in (("4", "4", "0", "true"), ("0", "4", "0", "false"), ("", "4", "0", "false"),
                                   ("65", "4", "0", "false"), ("4", "2", "0", "false"), ("4", "4", "1", "false")):
        monkeypatch.setenv("FASTAWQ_MOE_PACKED_PREFETCH", pf)
        monkeypatch.setenv("FASTAWQ_MOE_PACKED_CHUNKS", chunks)
        monkeypatch.setenv("FASTAWQ_MOE_PACKED_W2_WIDE", wide)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", 8)
            torch.cuda.synchronize()
        check(out, x, ids, w, weights, g)
        assert _moe_mma_w2_prefetch(prof) == {want}, (pf, chunks, wide)


@requires_packed
@pytest.mark.parametrize("evict", ["first", "normal"])
@pytest.mark.parametrize("case", [CASES[0], CASES[9], CASES[10]], ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_weights_l2_priority(case, evict, monkeypatch, poisoned_empty):
    # FASTAWQ_MOE_MMA_EVICT (read at each call) forces the weights' L2 priority, each layout's
    # default being the other one for one of the two kernels (AWQ layout: normal, packed: first);
    # both layouts' kernels, the same sums.
    from fastawq.ops import repack

    monkeypatch.setenv("FASTAWQ_MOE_MMA_EVICT", evict)
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=11 * t + k, load=load)
    packed = repack.awq_experts_repack(*weights, g)
    for _ in range(2):
        check(_op(x, ids, w, weights, g, pass_rows=16), x, ids, w, weights, g)
        out = torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float().contiguous(), *packed, g, "silu", 16)
        check(out, x, ids, w, weights, g)


@requires_packed
def test_packed_op_names_the_packed_shapes():
    from fastawq.ops import repack

    weights, x, ids, w = moe_case(8, 128, 96, 32, 2, 4, seed=3)
    w13p, s13p, w2p, s2p = repack.awq_experts_repack(*weights, 32)
    with pytest.raises(RuntimeError, match=r"moe_mma_packed_w4: inconsistent.*w13_wpacked"):
        torch.ops.fastawq.moe_mma_packed_w4(x, ids, w.float(), w13p[:, :, :-8].contiguous(), s13p, w2p, s2p, 32,
                                            "silu", 8)


@requires_kernel
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_other_activations_and_int32_ids(act):
    weights, x, ids, w = moe_case(8, 128, 96, 32, 2, 6, seed=13)
    check(_op(x, ids.to(torch.int32), w, weights, 32, act), x, ids, w, weights, 32, act)


@requires_kernel
@pytest.mark.parametrize("ahead", ["0", "1"])
@pytest.mark.parametrize("blocks", ["1", "3", "7"])
@pytest.mark.parametrize("case", [c for c in CASES if c[5] in (2, 16, 19, 300)],
                         ids=lambda c: "E{}H{}I{}G{}k{}T{}-{}".format(*c))
def test_persistent_form_with_few_blocks(case, blocks, ahead, monkeypatch, poisoned_empty):
    # A few blocks take every item in turn: one block runs all of w13 before its first w2 item, and
    # with three or seven a w2 item waits for w13 tiles that other blocks still hold, also when each
    # block holds its next item claimed ahead (no deadlock, h read only once final). Twice: the last
    # block out left the counters zeroed.
    monkeypatch.setenv("FASTAWQ_MOE_MMA_PERSISTENT", "1")
    monkeypatch.setenv("FASTAWQ_MOE_MMA_AHEAD", ahead)
    monkeypatch.setenv("FASTAWQ_MOE_MMA_GRID", blocks)
    e, h, i, g, k, t, load = case
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=3 * t + k + int(blocks), load=load)
    for pass_rows in (8, 16):
        check(_op(x, ids, w, weights, g, pass_rows=pass_rows), x, ids, w, weights, g)
    monkeypatch.setenv("FASTAWQ_MOE_MMA_PERSISTENT", "0")
    check(_op(x, ids, w, weights, g), x, ids, w, weights, g)  # and the two launches after it


@requires_kernel
@pytest.mark.parametrize("pass_rows", [8, 16])
@pytest.mark.parametrize("h", [128, 4096])  # without and with K splits
def test_ids_out_of_range_add_nothing(h, pass_rows, form):
    e, i, g, k, t = 8, 96, 32, 4, 3
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=14)
    bad = ids.clone()
    bad[0, 1], bad[1, 3], bad[2, 0] = -1, e, 10**6
    keep = (bad >= 0) & (bad < e)
    check(_op(x, bad, w, weights, g, pass_rows=pass_rows), x, ids.where(keep, 0), w * keep, weights, g)
    check(_op(x, ids, w, weights, g, pass_rows=pass_rows), x, ids, w, weights, g)  # the counters came back to zero


@requires_kernel
def test_top1_writes_out_directly_and_zeros_for_bad_ids(form):
    e, h, i, g, k, t = 8, 128, 96, 32, 1, 9
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=15)
    bad = ids.clone()
    bad[3, 0] = -5
    keep = bad >= 0
    check(_op(x, bad, w, weights, g), x, ids.where(keep, 0), w * keep, weights, g)


@requires_kernel
def test_dispatch_and_graph_replay(form):
    e, h, i, g, k, t = 128, 2048, 768, 128, 8, 16
    weights, x, ids, w = moe_case(e, h, i, g, k, t, 61)
    assert backend.moe_kernel(t, k, e) == "mma"
    calls = []
    real = torch.ops.fastawq.moe_mma_w4

    class Spy:
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

    try:
        torch.ops.fastawq.moe_mma_w4 = Spy()
        check(ops_moe.moe_w4(x, ids, w, *weights, g, backend="cuda"), x, ids, w, weights, g)
    finally:
        torch.ops.fastawq.moe_mma_w4 = real
    assert calls, "moe_w4 on the compiled backend did not run the tensor-core kernel at 16 tokens"
    replay_checks(lambda: _op(x, ids, w, weights, g), x, ids, w, weights, g, 3, 71)


@requires_kernel
def test_opcheck_and_errors():
    e, h, i, g, k, t = 4, 64, 64, 32, 2, 3
    weights, x, ids, w = moe_case(e, h, i, g, k, t, seed=91)
    for rows in (8, 16):
        torch.library.opcheck(torch.ops.fastawq.moe_mma_w4.default, (x, ids, w.float(), *weights, g, "silu", rows))
    with pytest.raises(RuntimeError, match="moe_mma_w4: scales must have x's dtype"):
        _op(x.bfloat16(), ids, w, weights, g)
    with pytest.raises(RuntimeError, match=r"moe_mma_w4: .*assignments .* exceed the kernel's 4096"):
        big = torch.zeros(4097, 1, dtype=torch.int64, device="cuda")
        _op(random_input((4097, h), "cuda", x.dtype, seed=1), big, torch.ones(4097, 1, device="cuda"), weights, g)
    with pytest.raises(RuntimeError, match="moe_mma_w4: 1025 experts exceed the kernel's 1024"):
        many = tuple(p[:1].expand(1025, *p.shape[1:]).contiguous() for p in weights)
        _op(x, ids, w, many, g)
    with pytest.raises(RuntimeError, match="moe_mma_w4: x must be 16-byte aligned"):
        wide = random_input((t, h + 4), "cuda", x.dtype, seed=2)
        _op(wide[:, 4:], ids, w, weights, g)
    with pytest.raises(RuntimeError, match="moe_mma_w4: pass_rows must be 8, 16 or 24, got 12"):
        _op(x, ids, w, weights, g, pass_rows=12)


@requires_kernel
@pytest.mark.parametrize("ahead", ["0", "1"])
def test_persistent_form_opcheck(monkeypatch, ahead):
    monkeypatch.setenv("FASTAWQ_MOE_MMA_PERSISTENT", "1")
    monkeypatch.setenv("FASTAWQ_MOE_MMA_AHEAD", ahead)
    weights, x, ids, w = moe_case(8, 128, 96, 32, 2, 5, seed=92)
    for rows in (8, 16):
        torch.library.opcheck(torch.ops.fastawq.moe_mma_w4.default, (x, ids, w.float(), *weights, 32, "silu", rows))
