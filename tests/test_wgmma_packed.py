"""The warpgroup-MMA kernel (awq_wgmma_packed, csrc/gemv/awq_wgmma_packed_sm90.cu, sm_90a only).

CPU: an emulation of the kernel's data flow written from its comments -- the four planes of core
matrices each thread's 16-byte load of x is stored into, the matrix descriptor's addressing of
them (start, LBO, SBO), the A fragments each lane dequantizes from its 16 bytes of the layout, the
wgmma's D layout, and the epilogue's map back to (token, column) -- matches the reference. GPU
(skipped without an sm_90 device and a build for sm_90a): the kernel against reference.awq_gemm
across every tile edge (32 / 64 / 128-token blocks, the 256-column block and 128-column warpgroup
tiles, the 4-column lane chunk), forced K splits down to one step a block, bias, graph replay,
opcheck, bad inputs.
"""
from __future__ import annotations

import pytest
import torch

from conftest import LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input
from fastawq import _ext
from fastawq.ops.repack import awq_gemv_repack
from test_gemm_packed import check_extreme_activations, check_llama_shape, check_weight_errors_are_named
from test_gemv_packed import _poisoned_call as poisoned_call
from test_gemv_packed import _setup, check_graph_replay
from test_mma_packed import MAGIC, _column_pair, _halves


def _declines() -> str:
    if not _ext.has_op("awq_wgmma_packed"):
        return "fastawq._C is not built with awq_wgmma_packed"
    if not torch.cuda.is_available():
        return "needs CUDA"
    return torch.ops.fastawq.awq_wgmma_packed_declines()


requires_kernel = pytest.mark.skipif(bool(_declines()), reason=_declines() or "runs")


@pytest.fixture(autouse=True)
def _plain_form_unless_a_test_names_one(monkeypatch):
    # The op picks its form by tile (warp-specialized on the 64- and 128-token tiles) unless
    # FASTAWQ_WGMMA_FORM forces one: here the plain form, so its tests cover it on every tile; the
    # ws tests set "ws" themselves and test_the_form_follows_the_tile unsets it.
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "plain")


def _x_smem(x: torch.Tensor, tok0: int, s: int, nt: int) -> torch.Tensor:
    """One slot's x region (NT * 64 bytes, as int32 words) as the block's threads store it. Item j is
    token j / 4 (clamped to row M - 1), chunk t' = j % 4; its 16-byte load's word w goes to plane w
    at byte (token / 8) 128 + (token % 8) 16 + 4 t'. Words no item writes stay -1 (NaN halves)."""
    m, _ = x.shape
    words = x.contiguous().view(torch.int32)  # [M, K / 2]
    plane = nt * 16
    smem = torch.full((nt * 16,), -1, dtype=torch.int32)
    written = set()
    for j in range(4 * nt):
        tok, tc = divmod(j, 4)
        row = min(tok0 + tok, m - 1)
        k0 = 32 * s + 8 * tc
        for w in range(4):
            at = w * plane + (tok >> 3) * 128 + (tok & 7) * 16 + 4 * tc
            assert at not in written, "two stores to one word"
            written.add(at)
            smem[at // 4] = words[row, k0 // 2 + w]
    assert len(written) == nt * 16
    return smem


def _b_from_descriptor(smem: torch.Tensor, start: int, lbo: int, sbo: int, nt: int, dtype) -> torch.Tensor:
    """B [16 labels, NT tokens] as a K-major no-swizzle descriptor addresses it: element (label l,
    token n) at byte start + (l // 8) LBO + (n // 8) SBO + (n % 8) 16 + (l % 8) 2."""
    halves = smem.view(dtype).float()
    b = torch.empty(16, nt)
    for n_ in range(nt):
        for l in range(16):
            at = start + (l // 8) * lbo + (n_ // 8) * sbo + (n_ % 8) * 16 + (l % 8) * 2
            b[l, n_] = halves[at // 2]
    return b


def _emulate(x: torch.Tensor, wp: torch.Tensor, sz: torch.Tensor, n: int, g: int, nt: int) -> torch.Tensor:
    """y [M, N] as the kernel computes it, one warpgroup (128 columns) and one wgmma at a time."""
    dtype = x.dtype
    magic_bits, magic = MAGIC[dtype]
    m, k = x.shape
    n4 = n // 4
    words = (wp.view(k // 8, n4, 4).to(torch.int64) & 0xFFFFFFFF).tolist()
    pairs = sz.view(k // g, n4, 4, 2)
    y = torch.full((m, n), float("nan"))
    plane = nt * 16
    for tok0 in range(0, m, nt):
        for c4q in range(0, n4, 32):  # a warpgroup: 4 warps x 8 lanes g
            acc = [torch.zeros(64, nt) for _ in range(2)]  # m-tile i: D rows 16 w + r
            for s in range(k // 32):
                smem = _x_smem(x, tok0, s, nt)
                grp = 32 * s // g
                for h in range(2):
                    b = _b_from_descriptor(smem, 2 * h * plane, plane, 128, nt, dtype)
                    for i in range(2):
                        a = torch.zeros(64, 16)
                        for warp in range(4):
                            for lane in range(32):
                                gq, t = divmod(lane, 4)
                                c4 = c4q + 8 * warp + gq
                                if c4 >= n4:
                                    continue  # the kernel's zero-filled copy
                                w = words[4 * s + t][c4]
                                regs = [(2 * i, w[2 * h]), (2 * i + 1, w[2 * h]),
                                        (2 * i, w[2 * h + 1]), (2 * i + 1, w[2 * h + 1])]
                                for r, (col, word) in enumerate(regs):
                                    scale, zero = pairs[grp, c4, col]
                                    mq = torch.tensor(_halves(_column_pair(word, col, magic_bits), dtype), dtype=dtype)
                                    wv = ((mq - (magic + zero)) * scale).float()
                                    # mma.m16n8k16's A, which wgmma's is per warp: registers 0, 1
                                    # rows g, g + 8 at labels 2t, 2t + 1; registers 2, 3 at 2t + 8, 2t + 9
                                    row = 16 * warp + gq + 8 * (r % 2)
                                    kl = 2 * t + 8 * (r // 2)
                                    a[row, kl : kl + 2] = wv
                        acc[i] += a @ b
            for warp in range(4):
                for lane in range(32):
                    gq, t = divmod(lane, 4)
                    c4 = c4q + 8 * warp + gq
                    if c4 >= n4:
                        continue
                    for j in range(nt // 8):
                        for e in range(2):
                            tok = tok0 + 8 * j + 2 * t + e
                            if tok >= m:
                                continue
                            r0, r8 = 16 * warp + gq, 16 * warp + gq + 8
                            col = 8 * j + 2 * t + e
                            y[tok, 4 * c4 : 4 * c4 + 4] = torch.stack(
                                [acc[0][r0, col], acc[0][r8, col], acc[1][r0, col], acc[1][r8, col]])
    return y.to(dtype)


@pytest.mark.parametrize("m,k,n,g,nt", [(5, 64, 136, 32, 32), (40, 64, 8, 64, 32), (70, 32, 264, 32, 64),
                                        (17, 128, 40, 128, 32), (13, 64, 136, 32, 16), (20, 32, 264, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragments_and_descriptors_as_the_kernel_uses_them(m, k, n, g, nt, dtype):
    # Token tiles past M, a partial warpgroup (N = 8, 40, 136: lanes without columns), two column
    # blocks (N = 264), groups of 32 (a new group every step).
    qw, s, qz = random_awq(k, n, g, dtype=dtype, seed=m + k + n)
    wp, sz = awq_gemv_repack(qw, s, qz, g)
    x = random_input((m, k), dtype=dtype, seed=m)
    assert_close_to_reference(_emulate(x, wp, sz, n, g, nt), x, qw, s, qz, g)


@pytest.mark.parametrize("nt", [16, 32])
def test_x_planes_cover_each_label_once(nt):
    # Each (token, label) of a step is one address, none shared: the descriptor's view of the stores.
    x = torch.arange(nt * 32, dtype=torch.float32).view(nt, 32).to(torch.float16)
    smem = _x_smem(x, 0, 0, nt)
    seen = set()
    for h in range(2):
        b = _b_from_descriptor(smem, 2 * h * nt * 16, nt * 16, 128, nt, torch.float16)
        for n_ in range(nt):
            for l in range(16):
                t, kc, j = (l % 8) // 2, l // 8, l % 2
                assert b[l, n_] == x[n_, 8 * t + 4 * h + 2 * kc + j].float()  # the layout's k labels
                seen.add((n_, 8 * t + 4 * h + 2 * kc + j))
    assert len(seen) == nt * 32


@pytest.mark.parametrize("nt", [16, 32, 64, 128])
def test_ws_producer_items_land_where_the_consumers_read(nt):
    # The warp-specialized form's producer warpgroup (128 threads, pt) copies for the 256 consumer
    # threads (awq_wgmma_ws_kernel): its weight items pt and pt + 128 (row t = i // 64 of the step's 4,
    # chunk c = i % 64 of the tile) land at consumer thread 32 (c // 8) + 4 (c % 8) + t, which in the
    # session-21 form copied row t of chunk 8 warp + g itself; its x items pt + 128 q (q < kXq, those
    # below 4 NT: at NT = 16 the first 64 threads) are the 4 NT items _x_smem stores, each once. (The
    # kernel's index arithmetic, written out.)
    weights = {}
    for pt in range(128):
        c, t0 = pt & 63, pt >> 6
        for jj in range(2):
            i = pt + 128 * jj
            t = t0 + 2 * jj
            assert t == i // 64 and c == i % 64
            consumer = 32 * (c >> 3) + 4 * (c & 7) + t
            assert consumer not in weights
            weights[consumer] = (t, c)
    assert sorted(weights) == list(range(256))
    for tid, (row, chunk) in weights.items():
        warp, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        assert (row, chunk) == (t, 8 * warp + g)
    items_per_step = 4 * nt
    xq = (items_per_step + 127) // 128
    items = [pt + 128 * q for pt in range(128) for q in range(xq) if pt + 128 * q < items_per_step]
    assert sorted(items) == list(range(items_per_step))


class _MBarrier:
    """An mbarrier as the ws form uses it: `count` arrivals complete a phase; try_wait.parity(p)
    passes while the phase in progress has the other parity. `want` is the phase the waiter means:
    the check fails where the parity test would answer for another phase (two phases ahead)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, 0, 0  # phase: the one in progress

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def passes(self, want: int) -> bool:
        hardware = (self.phase & 1) != (want & 1)
        assert self.phase <= want + 1, f"phase {want} waited for after phase {self.phase - 1} completed (parity ABA)"
        assert hardware == (self.phase > want)
        return hardware


def _ws_protocol(p: int, nsteps: int, seed: int, warps: int = 8) -> None:
    """awq_wgmma_ws_kernel's slot protocol, its index arithmetic written out, under a random
    interleaving of the producer warpgroup and the consumer warps: every wait ends (no deadlock),
    a consumer reads a slot's weights and planes only once the producer published that step there,
    and the producer rewrites a slot's weights or planes only after every warp is done with the
    step before (the planes: after the warp's wgmmas of it, which end two steps later)."""
    import random

    d = p - 3  # the producer's lead
    full = [_MBarrier(1) for _ in range(p)]  # the producer's 128 arrivals, as one
    empty = [_MBarrier(warps) for _ in range(p)]
    w_tag, x_tag = [None] * p, [None] * p  # the step whose weights / planes a slot holds
    reading = [set() for _ in range(p)]  # warps whose wgmmas may still read a slot's planes
    done = [-1] * warps  # the last step each warp read the weights of

    def producer():
        for i in range(min(d, nsteps)):  # the prologue: the first D steps' weights (and x)
            w_tag[i % p] = i
            yield None
        for i in range(nsteps):
            ahead = i + d
            if ahead < nsteps:
                slot = ahead % p
                if ahead >= p:
                    yield (empty[slot], (ahead - p) // p)
                assert all(done[w] >= ahead - p for w in range(warps)), "weights rewritten before read"
                w_tag[slot] = ahead
            yield None
            slot = i % p
            assert not reading[slot], f"planes of slot {slot} rewritten under a wgmma"
            x_tag[slot] = i
            full[slot].arrive()
            yield None

    def consumer(w):
        for i in range(nsteps):
            slot = i % p
            yield (full[slot], i // p)
            assert w_tag[slot] == i and x_tag[slot] == i, f"warp {w} read slot {slot} at step {i}"
            done[w] = i
            yield None
            if i >= 2:  # wgmma_wait<1>: step i - 2's wgmmas are over; its slot goes back
                reading[(i - 2) % p].discard(w)
                empty[(i - 2) % p].arrive()
            reading[slot].add(w)  # step i's wgmmas read the planes until step i + 2
            yield None
        for s in range(p):
            reading[s].discard(w)  # wgmma_wait<0>

    rng = random.Random(seed)
    agents = [producer()] + [consumer(w) for w in range(warps)]
    blocked = [None] * len(agents)
    live = set(range(len(agents)))
    while live:
        runnable = [a for a in live if blocked[a] is None or blocked[a][0].passes(blocked[a][1])]
        assert runnable, f"deadlock at P={p}, {nsteps} steps"
        a = rng.choice(runnable)
        blocked[a] = None
        try:
            blocked[a] = next(agents[a])
        except StopIteration:
            live.discard(a)


@pytest.mark.parametrize("p", [4, 8, 12])
def test_ws_slot_protocol_never_deadlocks_or_races(p):
    # The ring depths the ws form instantiates (8, 12) and the least it allows (4), from one step (shorter
    # than the lead) to many laps of the ring (every barrier's parity flips), several interleavings each.
    # (Checked against mutations: a lead of P - 2 or P - 1 deadlocks, a slot released as its wgmmas
    # are issued is rewritten under them, a wait one phase early or late and a skipped wait are all
    # caught; a release one step early is not a race at a lead of P - 3, which leaves that slack.)
    for nsteps in (1, 2, 3, p - 3, p - 1, p, p + 1, 2 * p + 3, 5 * p):
        for seed in range(6):
            _ws_protocol(p, nsteps, seed)


@pytest.mark.skipif(not _ext.has_op("awq_wgmma_packed"), reason="fastawq._C is not built with awq_wgmma_packed")
def test_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(300, 256, dtype=torch.bfloat16)
        wp = torch.empty(32, 136, dtype=torch.int32)
        sz = torch.empty(4, 272, dtype=torch.bfloat16)
        out = torch.ops.fastawq.awq_wgmma_packed(x, wp, sz, 136, 64, None)
        assert tuple(out.shape) == (300, 136) and out.dtype == torch.bfloat16


def test_sums_fake_impl_checks_the_sums():
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not _ext.has_op("awq_wgmma_packed_sums"):
        pytest.skip("fastawq._C without awq_wgmma_packed_sums")
    with FakeTensorMode():
        x = torch.empty(16, 256, dtype=torch.float16)
        wp = torch.empty(32, 136, dtype=torch.int32)
        sz = torch.empty(4, 272, dtype=torch.float16)
        torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, 136, 64, None, torch.empty(16, 136))
        with pytest.raises(Exception, match="sums"):
            torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, 136, 64, None, torch.empty(16, 136).half())


# --- GPU ---

def _set_env(monkeypatch, name: str, value: str | None) -> None:
    """Switch `name` to `value` for the test, or unset it (value None: the default)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _poisoned_call(x, wp, sz, n, g, bias=None, tokens=0, splits=0):
    return poisoned_call(x, wp, sz, n, g, bias, tokens, splits, op="awq_wgmma_packed")


# Edges: N below one 4-column chunk pair, across the 128-column warpgroup and 256-column block
# tiles; K one step, one group, across groups of every size, split K.
GPU_SHAPES = [
    (32, 8, 32), (64, 136, 32), (128, 40, 64), (256, 264, 128), (1024, 1000, 64), (2048, 392, 128),
    (8192, 128, 128), (11008, 520, 32), (4096, 4104, 128),
]
# Across the 16 / 32 / 64 / 128-token blocks and several 128-token blocks.
MS = [1, 9, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 300]


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(k, n, g, m, dtype):
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)
    bias = random_input((n,), "cuda", dtype, seed=7)
    x2 = random_input((m, k), "cuda", dtype, seed=m + 100)  # a second call: the workspace was re-zeroed
    assert_close_to_reference(_poisoned_call(x2, wp, sz, n, g, bias), x2, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("splits", [1, 3, 5, 64])
@pytest.mark.parametrize("m", [5, 70, 200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_tile_and_split(tokens, splits, m, dtype):
    # A forced token tile on any M and forced K splits (64 of 64 steps: one step a block, shorter
    # than the ring; 5: ranges of 13 steps, odd, so the loop's last step runs alone).
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=tokens + splits + m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    bias = random_input((n,), "cuda", dtype, seed=3)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias, tokens, splits), x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("k,n,g", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 17, 33, 65, 129, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_warp_specialized_form_matches_reference(monkeypatch, k, n, g, m, dtype):
    # FASTAWQ_WGMMA_FORM=ws (read at each call): two consumer warpgroups fed through mbarriers by a
    # producer warpgroup, on every edge shape and across the token tiles; a second call with a bias
    # (the split-K workspace was re-zeroed, the producer warpgroup joined the conversion).
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "ws")
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m + 1)
    x = random_input((m, k), "cuda", dtype, seed=m + 1)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g), x, qw, s, qz, g)
    bias = random_input((n,), "cuda", dtype, seed=8)
    x2 = random_input((m, k), "cuda", dtype, seed=m + 101)
    assert_close_to_reference(_poisoned_call(x2, wp, sz, n, g, bias), x2, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_form_follows_the_tile(monkeypatch, dtype):
    # FASTAWQ_WGMMA_FORM unset: the plain kernel on the 16- to 64-token tiles (64 since session 39),
    # the warp-specialized one on the 128-token tile (the automatic tile by M, and forced tiles), each
    # matching the reference; "ws" / "plain" force one on any tile.
    monkeypatch.delenv("FASTAWQ_WGMMA_FORM")
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=11)

    def kernels(m, tokens):
        x = random_input((m, k), "cuda", dtype, seed=m + tokens)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = _poisoned_call(x, wp, sz, n, g, None, tokens)
            torch.cuda.synchronize()
        assert_close_to_reference(out, x, qw, s, qz, g)
        names = {e.name for e in prof.events() if "awq_wgmma" in e.name}
        return {"ws" if "awq_wgmma_ws_kernel" in name else "plain" for name in names}

    assert kernels(12, 0) == kernels(20, 0) == kernels(70, 16) == kernels(40, 32) == {"plain"}
    assert kernels(64, 0) == kernels(20, 64) == {"plain"}
    assert kernels(300, 0) == kernels(20, 128) == {"ws"}

    # The sums form keeps the plain kernel on every tile unless "ws" is forced (session 38).
    def sums_kernels(m):
        x = random_input((m, k), "cuda", dtype, seed=m + 7)
        sums = torch.zeros(m, n, device="cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, None, sums, 0, 0)
            torch.cuda.synchronize()
        assert_close_to_reference(sums, x, qw, s, qz, g)
        names = {e.name for e in prof.events() if "awq_wgmma" in e.name}
        return {"ws" if "awq_wgmma_ws_kernel" in name else "plain" for name in names}

    assert sums_kernels(20) == sums_kernels(64) == sums_kernels(300) == {"plain"}
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "ws")
    assert kernels(12, 0) == sums_kernels(64) == {"ws"}
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "plain")
    assert kernels(300, 0) == {"plain"}


@requires_kernel
@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("splits", [1, 3, 5, 64])
@pytest.mark.parametrize("m", [5, 70, 200])
@pytest.mark.parametrize("depth", ["8", "12"])
def test_warp_specialized_every_tile_and_split(monkeypatch, tokens, splits, m, depth):
    # The ws form on forced tiles and splits, both rings (FASTAWQ_WGMMA_WS_DEPTH, read at each call):
    # 64 of 64 steps is one step a block (shorter than the producer's lead of 5 or 9), 5 gives odd
    # ranges of 13 (the consumers' last step alone), 1 the whole K through the 8- or 12-slot ring
    # many times (every mbarrier phase flips).
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "ws")
    monkeypatch.setenv("FASTAWQ_WGMMA_WS_DEPTH", depth)
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=tokens + splits + m + 1)
    x = random_input((m, k), "cuda", torch.float16, seed=m + 2)
    bias = random_input((n,), "cuda", torch.float16, seed=5)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias, tokens, splits), x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("k,n,g", [(256, 264, 128), (2048, 392, 128), (4096, 4104, 128), (11008, 520, 32)])
@pytest.mark.parametrize("m", [1, 9, 16, 17, 32, 33])
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sums_form_adds_into_the_sums(k, n, g, m, splits, dtype):
    # awq_wgmma_packed_sums: sums (random, not zero: the op adds) + x W + bias in fp32, every split of
    # K adding its part, the bias once; the automatic plan, one split (no split-K in the plain form
    # otherwise) and three; shapes across the 128-column tiles and group sizes, M across the 16- and
    # 32-token tiles. A second call on the same sums (no bias) adds again.
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + n + m + splits)
    x = random_input((m, k), "cuda", dtype, seed=m)
    bias = random_input((n,), "cuda", dtype, seed=9)
    base = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m + n))
    sums = base.clone()
    torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, sums, 0, splits)
    assert_close_to_reference(sums - base, x, qw, s, qz, g, bias)
    first = sums.clone()
    x2 = random_input((m, k), "cuda", dtype, seed=m + 50)
    torch.ops.fastawq.awq_wgmma_packed_sums(x2, wp, sz, n, g, None, sums, 0, splits)
    assert_close_to_reference(sums - first, x2, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("tokens", [16, 64, 128])
@pytest.mark.parametrize("splits", [0, 1, 5, 64])
@pytest.mark.parametrize("m", [5, 70])
@pytest.mark.parametrize("depth", ["8", "12"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_warp_specialized_sums_form(monkeypatch, tokens, splits, m, depth, dtype):
    # awq_wgmma_packed_sums in the warp-specialized form (FASTAWQ_WGMMA_FORM=ws only: the plain form
    # won in the engine, session 38; forced here on every tile with both rings): every split adds its part into random, non-zero sums,
    # the bias once, the producer warpgroup ending with the consumers (no conversion pass); a second
    # call without the bias adds again. 64 splits of 64 steps: one step a block, shorter than the lead.
    monkeypatch.setenv("FASTAWQ_WGMMA_FORM", "ws")
    monkeypatch.setenv("FASTAWQ_WGMMA_WS_DEPTH", depth)
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=tokens + splits + m)
    x = random_input((m, k), "cuda", dtype, seed=m + 3)
    bias = random_input((n,), "cuda", dtype, seed=6)
    base = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m + splits))
    sums = base.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, sums, tokens, splits)
        torch.cuda.synchronize()
    assert any("awq_wgmma_ws_kernel" in e.name for e in prof.events())
    assert_close_to_reference(sums - base, x, qw, s, qz, g, bias)
    first = sums.clone()
    x2 = random_input((m, k), "cuda", dtype, seed=m + 60)
    torch.ops.fastawq.awq_wgmma_packed_sums(x2, wp, sz, n, g, None, sums, tokens, splits)
    assert_close_to_reference(sums - first, x2, qw, s, qz, g)


def _template_args(name: str) -> list[str]:
    """The template arguments of a profiled awq_wgmma_packed_kernel's name, spaces dropped."""
    inner = name.replace(" ", "").split("awq_wgmma_packed_kernel<", 1)[1]
    return inner.split(">", 1)[0].split(",")


def _checked_instances(x, wp, sz, n, g, bias, tokens, splits, qw, s, qz, sums=False) -> list[list[str]]:
    """awq_wgmma_packed on x (output poisoned first), or with `sums` awq_wgmma_packed_sums into zeroed
    fp32 sums, checked against the reference; the template arguments of every awq_wgmma_packed_kernel
    it launched (the last: the cluster reduction's flag)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if sums:
            out = torch.zeros(x.shape[0], n, device="cuda")
            torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, out, tokens, splits)
        else:
            out = _poisoned_call(x, wp, sz, n, g, bias, tokens, splits)
        torch.cuda.synchronize()
    assert_close_to_reference(out, x, qw, s, qz, g, bias)
    args = [_template_args(e.name) for e in prof.events() if "awq_wgmma_packed_kernel<" in e.name]
    assert args, "no awq_wgmma_packed_kernel ran"
    return args


@requires_kernel
@pytest.mark.parametrize("tokens", [16, 32])
@pytest.mark.parametrize("splits", [2, 3, 5, 8, 11, 12, 13])
@pytest.mark.parametrize("m", [5, 40])
@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("variant", ["default", "wg2", "ring", "ldg", "bf16"])
def test_cluster_reduction(monkeypatch, tokens, splits, m, g, variant):
    # FASTAWQ_WGMMA_CLUSTER=1 (read at each call): the plain op's K splits on the 16- and 32-token tiles
    # meet in one cluster a tile where the plan has at most 12 (capped to 8: 11 forced gives 8 ranges
    # of 8 steps; 3 and 5 give ranges that start mid-group and a short last one) and sum through
    # distributed shared memory; 13 keeps the workspace. One or two warpgroups, the pairs through the
    # ring or by __ldg, both dtypes; M across token tiles; a second call with a bias. The kernel's
    # last template argument says which instance ran.
    monkeypatch.setenv("FASTAWQ_WGMMA_CLUSTER", "1")
    monkeypatch.delenv("FASTAWQ_WGMMA_DEPTH", raising=False)
    if variant == "wg2":
        monkeypatch.setenv("FASTAWQ_WGMMA_WARPGROUPS", "2")
    if variant in ("ring", "ldg"):
        monkeypatch.setenv("FASTAWQ_WGMMA_SCALES", "ring" if variant == "ring" else "0")
    dtype = torch.bfloat16 if variant == "bf16" else torch.float16
    k, n = 2048, 392
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=tokens + splits + m + g)
    want = ("1", "true") if splits <= 12 else ("0", "false")
    for seed, bias in ((1, None), (2, random_input((n,), "cuda", dtype, seed=6))):
        x = random_input((m, k), "cuda", dtype, seed=seed + m + 70)
        args = _checked_instances(x, wp, sz, n, g, bias, tokens, splits, qw, s, qz)
        assert all(a[-1] in want for a in args), args


@requires_kernel
@pytest.mark.parametrize("splits", [13, 20, 24, 25, 33])
@pytest.mark.parametrize("tokens", [16, 32])
def test_cluster_reduction_plan_bound(monkeypatch, splits, tokens):
    # FASTAWQ_WGMMA_CLUSTER_PLAN=24 (read at each call) moves the bound on the plans the cluster
    # serves: 13 / 20 / 24 forced splits are capped to 8 ranges of 8 steps, 25 plans 22 ranges of 3
    # steps (also capped), 33 plans 32 of 2 and keeps the workspace. K = 64 steps of group 128.
    monkeypatch.delenv("FASTAWQ_WGMMA_CLUSTER", raising=False)
    monkeypatch.setenv("FASTAWQ_WGMMA_CLUSTER_PLAN", "24")
    k, n, g, m = 2048, 392, 128, 21
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=splits + tokens + 17)
    x = random_input((m, k), "cuda", torch.float16, seed=splits + 19)
    bias = random_input((n,), "cuda", torch.float16, seed=20)
    args = _checked_instances(x, wp, sz, n, g, bias, tokens, splits, qw, s, qz)
    want = ("1", "true") if splits <= 25 else ("0", "false")
    assert all(a[-1] in want for a in args), args


@requires_kernel
@pytest.mark.parametrize("splits", [2, 5, 8, 12, 13])
@pytest.mark.parametrize("m", [33, 70])
@pytest.mark.parametrize("warpgroups", [None, "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cluster_reduction_of_the_64_token_tile(monkeypatch, splits, m, warpgroups, dtype):
    # The 64-token tile (the plain form by default since session 39) meets its K splits in a cluster
    # too: two warpgroups' 64 x 256 fp32 tile fills 64 KB of the 72 KB ring, one warpgroup's 32 KB;
    # 13 splits keep the workspace. M within and past one token tile; without bias, then with it.
    monkeypatch.delenv("FASTAWQ_WGMMA_CLUSTER", raising=False)
    monkeypatch.delenv("FASTAWQ_WGMMA_FORM", raising=False)
    _set_env(monkeypatch, "FASTAWQ_WGMMA_WARPGROUPS", warpgroups)
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=splits + m + 23)
    want = ("1", "true") if splits <= 12 else ("0", "false")
    for seed, bias in ((1, None), (2, random_input((n,), "cuda", dtype, seed=24))):
        x = random_input((m, k), "cuda", dtype, seed=seed + m + 25)
        args = _checked_instances(x, wp, sz, n, g, bias, 0 if m <= 64 else 64, splits, qw, s, qz)
        assert all(a[1] == "64" and a[-1] in want for a in args), args


@requires_kernel
@pytest.mark.parametrize("m", [40, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_warpgroup_where_two_would_leave_the_cluster(monkeypatch, m, dtype):
    # Session 40: the automatic 64-token plan takes one warpgroup where two would cut K into more
    # ranges than the cluster serves, each shorter than 16 steps. K = 4096, N = 4000 (not a whole
    # number of either tile): two warpgroups make 16 column tiles, which sm_90's 114-132 SMs at two
    # blocks each split into 13-16 ranges of 8-10 steps, through the workspace; one warpgroup's 32
    # tiles meet their splits in a cluster. K = 14336 (ranges of 28 steps) keeps two, as do
    # FASTAWQ_WGMMA_ONE_WG=0, FASTAWQ_WGMMA_WARPGROUPS=2 and a forced split count. Every call with a
    # bias, every output (poisoned first) against the reference.
    for name in ("FASTAWQ_WGMMA_CLUSTER", "FASTAWQ_WGMMA_FORM", "FASTAWQ_WGMMA_WARPGROUPS",
                 "FASTAWQ_WGMMA_ONE_WG", "FASTAWQ_WGMMA_CLUSTER_PLAN", "FASTAWQ_WGMMA_MIN_STEPS"):
        monkeypatch.delenv(name, raising=False)
    n, g = 4000, 128

    def instances(k, splits=0, seed=0):
        qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + m + seed)
        bias = random_input((n,), "cuda", dtype, seed=seed + 5)
        x = random_input((m, k), "cuda", dtype, seed=m + seed)
        return {(a[1], a[3], a[-1]) for a in _checked_instances(x, wp, sz, n, g, bias, 0, splits, qw, s, qz)}

    one_in_cluster, two_by_workspace = {("64", "1", "true")}, {("64", "2", "false")}
    assert instances(4096) == one_in_cluster
    assert instances(14336, seed=1) == two_by_workspace  # 16 ranges of 28 steps
    assert instances(4096, splits=16, seed=2) == two_by_workspace  # forced: the plan as asked
    monkeypatch.setenv("FASTAWQ_WGMMA_ONE_WG", "0")
    assert instances(4096, seed=3) == two_by_workspace
    monkeypatch.setenv("FASTAWQ_WGMMA_ONE_WG", "1")
    monkeypatch.setenv("FASTAWQ_WGMMA_WARPGROUPS", "2")
    assert instances(4096, seed=4) == two_by_workspace


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_sums_form_keeps_two_warpgroups(monkeypatch, dtype):
    # awq_wgmma_packed_sums keeps two warpgroups at 64 tokens where the plain op's rule (session 40)
    # takes one (K = 4096, N = 4000): the rule in the sums form measured 0.996x-1.004x in the engine
    # (session 41) and was removed. The sums (zeroed, then a bias on the first K split) against the
    # reference.
    for name in ("FASTAWQ_WGMMA_FORM", "FASTAWQ_WGMMA_WARPGROUPS", "FASTAWQ_WGMMA_ONE_WG",
                 "FASTAWQ_WGMMA_CLUSTER_PLAN", "FASTAWQ_WGMMA_MIN_STEPS"):
        monkeypatch.delenv(name, raising=False)
    n, g, m = 4000, 128, 64

    def warpgroups(k, seed):
        qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=k + seed)
        bias = random_input((n,), "cuda", dtype, seed=seed + 9)
        x = random_input((m, k), "cuda", dtype, seed=seed + 10)
        return {(a[1], a[3]) for a in _checked_instances(x, wp, sz, n, g, bias, 0, 0, qw, s, qz, sums=True)}

    assert warpgroups(4096, 1) == {("64", "2")}
    assert warpgroups(14336, 3) == {("64", "2")}


@requires_kernel
def test_cluster_reduction_off_and_where_it_does_not_serve(monkeypatch):
    # Unset or "1" (the default since session 39): the cluster instance (its last template argument
    # true); "0": the workspace; one split (K of one range) and the sums form keep the plain instance
    # with the switch on, and all still match.
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=12)
    x = random_input((20, k), "cuda", torch.float16, seed=3)

    def last_args(env, splits, sums=False):
        _set_env(monkeypatch, "FASTAWQ_WGMMA_CLUSTER", env)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            if sums:
                acc = torch.zeros(20, n, device="cuda")
                torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, None, acc, 16, splits)
                out = acc
            else:
                out = _poisoned_call(x, wp, sz, n, g, None, 16, splits)
            torch.cuda.synchronize()
        assert_close_to_reference(out, x, qw, s, qz, g)
        found = {_template_args(e.name)[-1] for e in prof.events() if "awq_wgmma_packed_kernel<" in e.name}
        assert found
        return found

    for env in (None, "1"):
        assert last_args(env, 4) <= {"1", "true"}
    assert last_args("0", 4) <= {"0", "false"}
    assert last_args("1", 1) <= {"0", "false"}
    assert last_args("1", 4, sums=True) <= {"0", "false"}
    assert last_args("1", 4) <= {"1", "true"}


@requires_kernel
@pytest.mark.parametrize("min_steps", ["1", "8", "16", "64", "0", "x"])
@pytest.mark.parametrize("m", [9, 40, 70])
def test_min_steps_floor(monkeypatch, min_steps, m):
    # FASTAWQ_WGMMA_MIN_STEPS (read at each call; 1..64, anything else the default: 8 in the op's 16-
    # and 32-token tiles, else 4): the automatic plan's fewest K steps a block, down to one and up to
    # the whole K (64 steps here), for the op and its sums form; ranges that start mid-group (g = 32:
    # one step a group) and end short of K.
    monkeypatch.setenv("FASTAWQ_WGMMA_MIN_STEPS", min_steps)
    k, n, g = 2048, 392, 32
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=m + len(min_steps))
    bias = random_input((n,), "cuda", torch.float16, seed=4)
    x = random_input((m, k), "cuda", torch.float16, seed=m + 9)
    assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias), x, qw, s, qz, g, bias)
    base = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m))
    sums = base.clone()
    torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, sums)
    assert_close_to_reference(sums - base, x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("m", [9, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_ops_floor_at_16_and_32_tokens(monkeypatch, m, dtype):
    # Unset, the op's 16- and 32-token tiles take ranges of at least 8 steps (session 43): Qwen3-30B-A3B's
    # QKV (2048 x 5120) then splits K 8 ways and meets in a cluster (its last template argument true),
    # where a floor of 4 cuts 16 or 13 ranges, past the cluster's 12, through the workspace. Both
    # against the reference, output poisoned first, with a bias.
    for name in ("FASTAWQ_WGMMA_CLUSTER", "FASTAWQ_WGMMA_FORM", "FASTAWQ_WGMMA_WARPGROUPS",
                 "FASTAWQ_WGMMA_CLUSTER_PLAN", "FASTAWQ_WGMMA_MIN_STEPS"):
        monkeypatch.delenv(name, raising=False)
    k, n, g = 2048, 5120, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m + 31)
    bias = random_input((n,), "cuda", dtype, seed=m + 32)
    x = random_input((m, k), "cuda", dtype, seed=m + 33)
    assert {a[-1] for a in _checked_instances(x, wp, sz, n, g, bias, 0, 0, qw, s, qz)} == {"true"}
    monkeypatch.setenv("FASTAWQ_WGMMA_MIN_STEPS", "4")
    assert {a[-1] for a in _checked_instances(x, wp, sz, n, g, bias, 0, 0, qw, s, qz)} == {"false"}


@requires_kernel
def test_sums_form_names_bad_sums():
    k, n, g = 256, 264, 128
    _, _, _, wp, sz = _setup(k, n, g, torch.float16, seed=3)
    x = random_input((16, k), "cuda", torch.float16, seed=1)
    for bad in (torch.zeros(16, n, device="cuda", dtype=torch.float16), torch.zeros(16, n + 8, device="cuda"),
                torch.zeros(n, 16, device="cuda").t()):
        with pytest.raises(RuntimeError, match=r"awq_wgmma_packed_sums: sums must be a contiguous fp32 \[M=16, N=264\]"):
            torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, None, bad)


@requires_kernel
@pytest.mark.parametrize("splits", [0, 1, 3, 5, 64])
@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_six_blocks_an_sm(monkeypatch, splits, m, dtype):
    # FASTAWQ_WGMMA_OCC (on unless "0"; read at each call): the 16-token tile's instance held to 80
    # registers (six blocks an SM), so the automatic plan (splits 0) gives more K splits; forced
    # splits leave K ranges of 64 steps, 22 / 20, 13 / 12 and 1; a second call (the workspace was
    # re-zeroed). The kernel runs the instance the switch names (the profiler shows its fifth template
    # argument, the blocks an SM: 6 by default, 4 with "0").
    monkeypatch.delenv("FASTAWQ_WGMMA_DEPTH", raising=False)
    k, n, g = 2048, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=splits + m + 4)
    bias = random_input((n,), "cuda", dtype, seed=7)
    for occ, instance in ((None, ",16,6,1,6,"), ("0", ",16,6,1,4,")):
        _set_env(monkeypatch, "FASTAWQ_WGMMA_OCC", occ)
        for seed in (1, 2):
            x = random_input((m, k), "cuda", dtype, seed=m + seed)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = _poisoned_call(x, wp, sz, n, g, bias, 16, splits)
                torch.cuda.synchronize()
            assert_close_to_reference(out, x, qw, s, qz, g, bias)
            names = [e.name.replace(" ", "") for e in prof.events() if "awq_wgmma_packed_kernel" in e.name]
            assert names and all(instance in nm for nm in names), names


@requires_kernel
@pytest.mark.parametrize("scales", [None, "ring", "0"])
@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("splits", [0, 3, 5, 64])
@pytest.mark.parametrize("g", [32, 128])
def test_every_form_across_groups_and_splits(monkeypatch, scales, tokens, splits, g):
    # A slot's weights (and the plain form's x copies) in the layout's row order, since session 35,
    # and the plain form's (scale, zero) pairs through the ring (by default at the 16-token tile;
    # FASTAWQ_WGMMA_SCALES, read at each call, forces "ring" at every tile or "0" at none): groups of 1 and 4 steps; K ranges that start mid-group (3 and 5 splits of 64
    # steps) and of one step (64); the plain form (16 and 32 tokens: M past one token tile), the
    # warp-specialized one (64, 128) and the sums form; a second call (the workspace re-zeroed).
    _set_env(monkeypatch, "FASTAWQ_WGMMA_SCALES", scales)
    k, n, m = 2048, 392, min(tokens + 3, 130)
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=tokens + splits + g)
    bias = random_input((n,), "cuda", torch.float16, seed=5)
    for seed in (1, 2):
        x = random_input((m, k), "cuda", torch.float16, seed=seed + g)
        assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, bias, tokens, splits), x, qw, s, qz, g, bias)
    if tokens <= 32:
        base = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m))
        sums = base.clone()
        torch.ops.fastawq.awq_wgmma_packed_sums(x, wp, sz, n, g, bias, sums, tokens, splits)
        assert_close_to_reference(sums - base, x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("depth", ["4", "8"])
@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("splits", [0, 3, 64])
def test_ring_depths(monkeypatch, depth, tokens, splits):
    # FASTAWQ_WGMMA_DEPTH (read at each call): rings of 4 and 8 slots, on every token tile, the
    # automatic split and forced ones down to one step a block (shorter than either ring).
    monkeypatch.setenv("FASTAWQ_WGMMA_DEPTH", depth)
    k, n, g, m = 2048, 392, 128, 150
    qw, s, qz, wp, sz = _setup(k, n, g, torch.bfloat16, seed=tokens + splits)
    for seed in (1, 2):  # a second call: the workspace was re-zeroed
        x = random_input((m, k), "cuda", torch.bfloat16, seed=seed)
        assert_close_to_reference(_poisoned_call(x, wp, sz, n, g, None, tokens, splits), x, qw, s, qz, g)


@requires_kernel
@pytest.mark.parametrize("warpgroups", ["1", "2"])
@pytest.mark.parametrize("tokens", [16, 32, 64, 128])
@pytest.mark.parametrize("splits", [0, 3, 64])
@pytest.mark.parametrize("k,n,g", [(2048, 392, 128), (256, 136, 32)])
def test_forced_warpgroup_blocks(monkeypatch, warpgroups, tokens, splits, k, n, g):
    # FASTAWQ_WGMMA_WARPGROUPS=1 / 2 (read at each call) forces blocks of one warpgroup on 128 columns
    # or two on 256 (the defaults: one at the 32-token tile, two above), at every token tile (N = 392:
    # a partial fourth 128-column tile, a partial second 256-column one; 136: a partial second / first),
    # forced splits.
    monkeypatch.setenv("FASTAWQ_WGMMA_WARPGROUPS", warpgroups)
    if splits > k // 32:
        splits = k // 32
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=tokens + splits + k)
    bias = random_input((n,), "cuda", torch.float16, seed=4)
    for seed in (1, 2):
        x = random_input((150, k), "cuda", torch.float16, seed=seed)
        out = _poisoned_call(x, wp, sz, n, g, bias, tokens, splits)
        assert_close_to_reference(out, x, qw, s, qz, g, bias)


@requires_kernel
@pytest.mark.parametrize("k,n", LLAMA3_8B_SHAPES)
@pytest.mark.parametrize("m", [64, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_llama_shapes(k, n, m, dtype):
    check_llama_shape(_poisoned_call, k, n, m, dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [300.0, 1e-3])
def test_large_and_small_activations(scale, dtype):
    check_extreme_activations(_poisoned_call, scale, dtype)


@requires_kernel
@pytest.mark.parametrize("m", [40, 130])
def test_cuda_graph_replay_with_changed_inputs(m):
    check_graph_replay(torch.ops.fastawq.awq_wgmma_packed, m)


@requires_kernel
@pytest.mark.parametrize("m", [1, 33, 130])
def test_opcheck(m):
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((m, k), "cuda", torch.float16)
    bias = random_input((n,), "cuda", torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_wgmma_packed.default, (x, wp, sz, n, g, bias))
    torch.library.opcheck(torch.ops.fastawq.awq_wgmma_packed.default, (x, wp, sz, n, g, None, 64, 4))


@requires_kernel
def test_bad_inputs_are_named():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    x = random_input((20, k), "cuda", torch.float16)
    op = torch.ops.fastawq.awq_wgmma_packed
    with pytest.raises(RuntimeError, match="tokens must be 16, 32, 64 or 128.*got 48"):
        op(x, wp, sz, n, g, None, 48, 0)
    with pytest.raises(RuntimeError, match="splits must be in 1..K/32.*9"):
        op(x, wp, sz, n, g, None, 0, 9)
    check_weight_errors_are_named(op)


@pytest.mark.skipif(not _ext.has_op("awq_wgmma_packed") or not torch.cuda.is_available()
                    or not _declines().startswith("awq_wgmma_packed runs on sm_90"), reason="a non-Hopper GPU")
def test_other_gpus_are_refused_by_name():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _setup(k, n, g, torch.float16)
    with pytest.raises(RuntimeError, match="runs on sm_90"):
        torch.ops.fastawq.awq_wgmma_packed(random_input((20, k), "cuda", torch.float16), wp, sz, n, g, None)


def test_dispatch_takes_wgmma_above_the_buckets_when_switched_on(monkeypatch):
    # backend.PACKED_WGMMA (on by default): the compiled backend first above the compiled buckets up
    # to PACKED_WGMMA_MAX_M (None: every M), served by awq_wgmma_packed, Triton above, and the fused
    # engine's packed layout up to that batch; off, Triton above the buckets.
    from fastawq import backend
    from fastawq.ops.repack import _compiled_packed_op

    cuda = torch.device("cuda")
    monkeypatch.setattr(backend._ext, "has_op", lambda name: True)
    monkeypatch.setattr(backend, "PACKED_WGMMA", False)
    assert _compiled_packed_op(None) == "awq_gemm_packed"
    assert backend._preference("packed_gemm")[-1] == (None, ("triton", "torch"))
    monkeypatch.setattr(backend, "PACKED_WGMMA", True)
    monkeypatch.setattr(backend, "PACKED_WGMMA_MAX_M", 32)
    assert backend.size_buckets("packed_gemm")[-2:] == [32, None]
    assert backend._preference("packed_gemm")[-2:] == [(32, ("cuda", "triton", "torch")), (None, ("triton", "torch"))]
    assert _compiled_packed_op(32) == _compiled_packed_op(None) == "awq_wgmma_packed"
    assert _compiled_packed_op(backend.PACKED_GEMM_MAX_M) == "awq_gemm_packed"
    assert _compiled_packed_op(backend.PACKED_MMA_MAX_M) == "awq_mma_packed"
    assert backend.packed_fused_max_batch() == 32
    monkeypatch.setattr(backend, "is_sm90", lambda device: True)
    assert [backend.preferred_layout(cuda, b) for b in (17, 32, 33)] == ["packed", "packed", "awq"]
    # Not a Hopper GPU: the op would decline, so the engine's packed layout stops at the other buckets.
    monkeypatch.setattr(backend, "is_sm90", lambda device: False)
    assert backend.packed_fused_max_batch(cuda) == backend.PACKED_GEMM_MAX_M
    assert backend.preferred_layout(cuda, backend.PACKED_GEMM_MAX_M + 1) == "awq"
    monkeypatch.setattr(backend, "PACKED_WGMMA_MAX_M", None)
    assert backend._preference("packed_gemm")[-1] == (None, ("cuda", "triton", "torch"))
    assert backend.packed_fused_max_batch() == 1 << 20
    monkeypatch.setattr(backend._ext, "has_op", lambda name: name != "awq_wgmma_packed")
    assert _compiled_packed_op(None) == "awq_gemm_packed"
    assert backend.packed_fused_max_batch() == backend.PACKED_GEMM_MAX_M


def test_the_bound_is_read_from_the_environment(monkeypatch):
    # FASTAWQ_PACKED_WGMMA_MAX_M (read at import): a positive integer or "none"; anything else is
    # named in the error.
    from fastawq import backend

    for value, bound in (("", 7), ("64", 64), ("none", None), ("None", None), (" 48 ", 48)):
        monkeypatch.setenv("FASTAWQ_PACKED_WGMMA_MAX_M", value)
        assert backend._bound_from_env("FASTAWQ_PACKED_WGMMA_MAX_M", 7) == bound
    for bad in ("0", "-3", "x", "6.5"):
        monkeypatch.setenv("FASTAWQ_PACKED_WGMMA_MAX_M", bad)
        with pytest.raises(ValueError, match=f"FASTAWQ_PACKED_WGMMA_MAX_M={bad!r}"):
            backend._bound_from_env("FASTAWQ_PACKED_WGMMA_MAX_M", 7)


def test_dispatch_takes_the_16_token_tile_on_hopper_only(monkeypatch):
    # backend.PACKED_WGMMA_16 (on by default): awq_gemm_packed's bucket (M = 9 .. 16) is served by
    # awq_wgmma_packed where the device is an sm_90 GPU, by awq_gemm_packed elsewhere (where the op
    # declines) and with no device named; off, by awq_gemm_packed everywhere. The buckets themselves
    # do not move.
    from fastawq import backend
    from fastawq.ops.repack import _compiled_packed_op

    cuda = torch.device("cuda")
    monkeypatch.setattr(backend._ext, "has_op", lambda name: True)
    monkeypatch.setattr(backend, "PACKED_WGMMA", True)
    monkeypatch.setattr(backend, "PACKED_WGMMA_16", True)
    buckets = backend.size_buckets("packed_gemm")
    bucket16 = backend.PACKED_GEMM_MAX_M
    assert bucket16 in buckets and bucket16 > backend.PACKED_MMA_MAX_M
    monkeypatch.setattr(backend, "is_sm90", lambda device: True)
    assert _compiled_packed_op(bucket16, cuda) == "awq_wgmma_packed"
    assert _compiled_packed_op(backend.PACKED_MMA_MAX_M, cuda) == "awq_mma_packed"
    assert _compiled_packed_op(backend.PACKED_GEMV_MAX_M, cuda) == "awq_gemv_packed"
    assert _compiled_packed_op(bucket16) == "awq_gemm_packed"
    monkeypatch.setattr(backend, "is_sm90", lambda device: False)
    assert _compiled_packed_op(bucket16, cuda) == "awq_gemm_packed"
    monkeypatch.setattr(backend, "is_sm90", lambda device: True)
    monkeypatch.setattr(backend, "PACKED_WGMMA_16", False)
    assert _compiled_packed_op(bucket16, cuda) == "awq_gemm_packed"
    monkeypatch.setattr(backend, "PACKED_WGMMA_16", True)
    monkeypatch.setattr(backend, "PACKED_WGMMA", False)
    assert _compiled_packed_op(bucket16, cuda) == "awq_gemm_packed"


@requires_kernel
@pytest.mark.parametrize("m", [9, 12, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_gemm_takes_the_16_token_tile_by_default(monkeypatch, m, dtype):
    # The automatic choice at M = 9 .. 16 on an sm_90 GPU: awq_wgmma_packed (its 16-token tile, the
    # tile's unused rows masked), called once with the whole batch and matching the reference.
    from fastawq import backend, ops

    calls = []
    real = torch.ops.fastawq.awq_wgmma_packed

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.fastawq, "awq_wgmma_packed", spy)
    assert backend.PACKED_WGMMA_16 and backend.PACKED_WGMMA
    k, n, g = 1024, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, dtype, seed=m)
    x = random_input((m, k), "cuda", dtype, seed=m)
    plan = ops.packed_gemm_plan(x, wp, sz, n, g)
    assert_close_to_reference(plan(x), x, qw, s, qz, g)
    assert calls == [m]


@requires_kernel
@pytest.mark.parametrize("m", [17, 64, 300])
def test_packed_gemm_takes_it_when_switched_on(monkeypatch, m):
    from fastawq import backend, ops

    monkeypatch.setattr(backend, "PACKED_WGMMA", True)
    monkeypatch.setattr(backend, "PACKED_WGMMA_MAX_M", None)
    k, n, g = 1024, 392, 128
    qw, s, qz, wp, sz = _setup(k, n, g, torch.float16, seed=m)
    x = random_input((m, k), "cuda", torch.float16, seed=m)
    plan = ops.packed_gemm_plan(x, wp, sz, n, g)
    assert_close_to_reference(plan(x), x, qw, s, qz, g)
