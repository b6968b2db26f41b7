"""ops.l2_prefetch (fastawq::l2_prefetch, csrc/common/l2_prefetch.cu) and the decode step's use of it
(FASTAWQ_L2_PREFETCH, modules/fused.py l2_prefetch_mlp).

The op is a hint with no result: what can be checked is that it validates its inputs, launches its
kernel where it should (sm_90), leaves every byte it touches as it was, and that a decode with it
matches one without.
"""
from __future__ import annotations

import pytest
import torch

from fastawq import _ext, ops
from fastawq.modules.fused import l2_prefetch_mlp

CUDA = torch.cuda.is_available()
HAS_OP = _ext.has_op("l2_prefetch")
needs_op = pytest.mark.skipif(not (CUDA and HAS_OP), reason="needs a CUDA device and fastawq._C with l2_prefetch")


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("0", None), ("0:0", None), ("3:2", (3, 2)), ("8:0", (8, 0)), ("0:5", (0, 5)),
    ("9:1", None), ("3", None), ("a:b", None), ("3:2:1", None), ("-1:2", None),
])
def test_the_switch_reads_two_eighths(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FASTAWQ_L2_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("FASTAWQ_L2_PREFETCH", value)
    assert l2_prefetch_mlp() == expected


def test_bad_arguments_name_the_tensor():
    t = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"hot \(1\) and period \(2\).*2 tensors"):
        ops.l2_prefetch([t, t], [1], [8, 8])
    with pytest.raises(ValueError, match="tensor 1 needs 0 <= hot <= period.*hot 9, period 8"):
        ops.l2_prefetch([t, t], [1, 9], [8, 8])
    with pytest.raises(ValueError, match="tensor 0 .*period 0"):
        ops.l2_prefetch([t], [0], [0])


def test_off_cuda_nothing_is_launched():
    t = torch.randn(16, 8)
    assert ops.l2_prefetch([t], [1], [2]) is False
    assert ops.l2_prefetch([], [], []) is False


def _kernel_launches(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "l2_prefetch_kernel" in e.name)


@needs_op
@pytest.mark.parametrize("hot, period", [(1, 1), (3, 8), (8, 8), (1, 3), (0, 8)])
def test_the_op_leaves_its_tensors_as_they_were(hot, period):
    # Rows of 64 KB + 16 bytes (two prefetch chunks, the second one 16 bytes), of 16 bytes, and a row
    # count that leaves a short last period; the prefetched memory is byte for byte what it was.
    g = torch.Generator(device="cuda").manual_seed(hot * 10 + period)
    tensors = [
        torch.randint(-2**31, 2**31 - 1, (21, 16388), dtype=torch.int32, device="cuda", generator=g),
        torch.randn(37, 8, device="cuda", generator=g).half(),
        torch.randn(5, 4, 4, device="cuda", generator=g),
    ]
    before = [t.clone() for t in tensors]
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    launches = _kernel_launches(lambda: ops.l2_prefetch(tensors, [hot] * 3, [period] * 3))
    assert launches == (1 if sm90 and hot > 0 else 0)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


@needs_op
def test_the_op_refuses_rows_it_cannot_fetch():
    odd = torch.zeros(8, 3, dtype=torch.int16, device="cuda")  # 6-byte rows
    with pytest.raises(RuntimeError, match="tensor 0 needs 16-byte rows.*6 bytes"):
        torch.ops.fastawq.l2_prefetch([odd], [1], [1])
    strided = torch.zeros(8, 16, dtype=torch.int32, device="cuda")[:, ::2]
    with pytest.raises(RuntimeError, match="tensor 0 must be contiguous"):
        torch.ops.fastawq.l2_prefetch([strided], [1], [1])
    if torch.cuda.device_count() > 1:
        a, b = torch.zeros(4, 4, device="cuda:0"), torch.zeros(4, 4, device="cuda:1")
        with pytest.raises(RuntimeError, match="tensor 1 is on cuda:1"):
            torch.ops.fastawq.l2_prefetch([a, b], [1, 1], [1, 1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_op)])
def test_decode_with_the_prefetch_matches_unfused(monkeypatch, device):
    # A decode step with FASTAWQ_L2_PREFETCH=3:2 (3/8 of gate/up, 2/8 of down asked into L2 after each
    # QKV projection) still matches transformers, with CUDA graphs on the GPU, where each layer's
    # step launched one prefetch (the hint itself does nothing on the CPU).
    from test_fused import _match_over_decode

    monkeypatch.setenv("FASTAWQ_L2_PREFETCH", "3:2")
    calls = []
    if device == "cuda":
        real = torch.ops.fastawq.l2_prefetch

        def spy(tensors, hot, period):
            calls.append((len(tensors), tuple(hot)))
            return real(tensors, hot, period)

        monkeypatch.setattr(torch.ops.fastawq, "l2_prefetch", spy)
    _match_over_decode("llama", None, 6 if device == "cpu" else 12, device=device, graphs=device == "cuda",
                       batch=1, layout="packed" if device == "cuda" else None)
    if device == "cuda":
        assert calls and all(c == (4, (3, 3, 2, 2)) for c in calls)
