"""Programmatic dependent launch: the FASTAWQ_PDL switch, and a chain of dependent decode kernels
(each reads what the one before wrote) that gives the same numbers with and without it, eagerly
and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, random_awq, random_input

pytest.importorskip("triton")
from fastawq import ops, reference  # noqa: E402
from fastawq.triton_kernels import pdl  # noqa: E402

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("value, want", [("", True), ("1", True), ("on", True), ("true", True),
                                         ("0", False), ("off", False), ("false", False)])
def test_switch_reads_fastawq_pdl(monkeypatch, value, want):
    monkeypatch.setenv("FASTAWQ_PDL", value)
    assert pdl.requested() is want


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("FASTAWQ_PDL", "yes please")
    with pytest.raises(ValueError, match="FASTAWQ_PDL must be 1/on/true or 0/off/false, got 'yes please'"):
        pdl.requested()


def test_cpu_and_interpreted_launches_never_use_pdl(monkeypatch):
    monkeypatch.setenv("FASTAWQ_PDL", "1")
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    if HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl.launch_options(torch.device("cuda")) == {"PDL": False}


def _chain(x, res, norm_w, awq, packed):
    """Three rounds of four dependent kernels, in a decoder layer's order: add+RMSNorm, GEMV (AWQ
    layout), act*mul, GEMV (packed layout); then a last add+RMSNorm."""
    qweight, scales, qzeros, g = awq
    wp, szp, g2 = packed
    for _ in range(3):
        h, res = ops.add_rms_norm(x, res, norm_w, 1e-6)
        gu = ops.awq_gemm(h, qweight, scales, qzeros, g)
        a = ops.act_mul(gu)
        x = ops.packed_gemm(a, wp, szp, res.shape[-1], g2)
    return ops.add_rms_norm(x, res, norm_w, 1e-6)


def _reference_chain(x, res, norm_w, awq, packed_awq):
    qweight, scales, qzeros, g = awq
    q2, s2, z2, g2 = packed_awq
    for _ in range(3):
        h, res = reference.add_rms_norm(x, res, norm_w, 1e-6)
        a = reference.act_mul(reference.awq_gemm(h, qweight, scales, qzeros, g))
        x = reference.awq_gemm(a, q2, s2, z2, g2)
    return reference.add_rms_norm(x, res, norm_w, 1e-6)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (PDL)")
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dependent_chain_matches_with_and_without_pdl(monkeypatch, m, dtype):
    h, inter = 1024, 1536
    dev = "cuda"
    # Scales shrunk so each GEMM keeps its output O(1): the residual stays small enough that the
    # fp16/bf16 rounding of three rounds stays within the tolerance below.
    q1, s1, z1 = random_awq(h, 2 * inter, 128, dev, dtype, seed=3)
    awq = (q1, (s1.float() * 0.3).to(dtype), z1, 128)
    q2, s2, z2 = random_awq(inter, h, 128, dev, dtype, seed=4)
    s2 = (s2.float() * 0.05).to(dtype)
    wp, szp = ops.awq_gemv_repack(q2, s2, z2, 128)
    x = random_input((m, h), dev, dtype, seed=5)
    res = random_input((m, h), dev, dtype, seed=6)
    norm_w = (1.0 + 0.1 * random_input((h,), dev, dtype, seed=7)).to(dtype)
    want_y, want_r = _reference_chain(x, res, norm_w, awq, (q2, s2, z2, 128))

    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("FASTAWQ_PDL", setting)
        eager = _chain(x, res, norm_w, awq, (wp, szp, 128))
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        for _ in range(2):  # compile and tune outside the capture
            _chain(static_x, res, norm_w, awq, (wp, szp, 128))
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = _chain(static_x, res, norm_w, awq, (wp, szp, 128))
        out[0].fill_(float("nan"))  # poisoned: the replay must write it
        graph.replay()
        torch.cuda.synchronize()
        results[setting] = (eager, (out[0].clone(), out[1].clone()))
    # Three rounds of rounding in the activation's dtype: bf16 drifts ~0.04 from fp32 here. A launch
    # that read a stale or half-written input would be off by O(1) or NaN.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=5e-2, atol=1e-1)
    for setting, (eager, replayed) in results.items():
        for how, got in (("eager", eager), ("graph", replayed)):
            for name, g, w in (("residual", got[1], want_r), ("output", got[0], want_y)):
                torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}, {how}, FASTAWQ_PDL={setting}: {m}")
    torch.testing.assert_close(results["1"][1][0], results["0"][1][0], **tol)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (PDL)")
@pytest.mark.parametrize("layout", ["awq", "packed"])
def test_weights_written_by_the_kernel_just_before_are_read(layout):
    # The GEMVs fetch weights before their PDL wait: a weight buffer rewritten by the kernel right
    # before (a copy, as a repack or load does) must still be read as rewritten, every time.
    k, n, g, dev = 2048, 4096, 128, "cuda"
    sets = [random_awq(k, n, g, dev, torch.float16, seed=s) for s in (11, 12)]
    x = random_input((1, k), dev, torch.float16, seed=13)
    want = [reference.awq_gemm(x, q, s, z, g) for q, s, z in sets]
    if layout == "packed":
        sets = [(*ops.awq_gemv_repack(q, s, z, g), None) for q, s, z in sets]
    buf = [t.clone() if t is not None else None for t in sets[0]]
    for i in range(6):
        src = sets[i % 2]
        for b, t in reversed(list(zip(buf, src))):  # the packed weights last: right before the GEMV
            if b is not None:
                b.copy_(t)
        if layout == "packed":
            got = ops.packed_gemm(x, buf[0], buf[1], n, g)
        else:
            got = ops.awq_gemm(x, buf[0], buf[1], buf[2], g)
        torch.testing.assert_close(got.float(), want[i % 2].float(), rtol=2e-2, atol=2e-2, msg=f"call {i}")
