"""The oracle itself: packing order, round trips, quantization and dequant-matmul semantics."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastawq import reference

from conftest import random_awq, random_input


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), words=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(rows, words, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, words * 8), generator=gen, dtype=torch.int32)
    packed = reference.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert torch.equal(reference.unpack_int4(packed), q)


def test_nibble_order_is_awq_interleave():
    # Column c holds value c: nibble i must then hold AWQ_ORDER[i] = [0, 2, 4, 6, 1, 3, 5, 7][i].
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    word = int(reference.pack_int4(q)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]


def test_pack_uses_the_sign_bit():
    q = torch.full((1, 8), 15, dtype=torch.int32)
    assert int(reference.pack_int4(q)[0, 0]) == -1


@pytest.mark.parametrize("bad", [torch.zeros(2, 12, dtype=torch.int32), torch.full((1, 8), 16, dtype=torch.int32)])
def test_pack_rejects_bad_input(bad):
    with pytest.raises(ValueError, match=r"divisible by 8|\[0, 15\]"):
        reference.pack_int4(bad)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [True, False])
def test_quantize_groupwise_error_within_half_step(group_size, zero_point):
    w = random_input((24, 256), dtype=torch.float32)
    q, s, z = reference.quantize_groupwise(w, group_size, 4, zero_point)
    g = reference.resolve_group_size(group_size, 256)
    assert q.min() >= 0 and q.max() <= 15 and s.shape == (24, 256 // g)
    wq = reference.pseudo_quantize(w, group_size, 4, zero_point)
    step = s.repeat_interleave(g, dim=1)
    # Asymmetric RTN: within half a step everywhere; symmetric may clip the -max end by one step.
    limit = 0.5 if zero_point else 1.0
    assert ((w - wq).abs() <= limit * step + 1e-6).all()


def test_pack_awq_matches_dequantize():
    w = random_input((64, 256), dtype=torch.float32)
    qweight, scales, qzeros = reference.quantize_awq(w, 64, dtype=torch.float32)
    assert qweight.shape == (256, 8) and scales.shape == (4, 64) and qzeros.shape == (4, 8)
    deq = reference.dequantize(qweight, scales, qzeros, 64)
    assert torch.allclose(deq.t(), reference.pseudo_quantize(w, 64), atol=1e-6)


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_gemm_matches_float64(group_size):
    qweight, scales, qzeros = random_awq(256, 48, group_size)
    x = random_input((5, 256))
    bias = random_input((48,), seed=3)
    out = reference.awq_gemm(x, qweight, scales, qzeros, group_size, bias)
    q = reference.unpack_int4(qweight).double()
    g = reference.resolve_group_size(group_size, 256)
    z = reference.unpack_int4(qzeros).double().repeat_interleave(g, 0)
    s = scales.double().repeat_interleave(g, 0)
    expect = x.double() @ ((q - z) * s) + bias.double()
    assert out.dtype == x.dtype and out.shape == (5, 48)
    assert torch.allclose(out.double(), expect, rtol=2e-3, atol=2e-3)


def test_shape_errors_name_the_shapes():
    qweight, scales, qzeros = random_awq(256, 64, 64)
    with pytest.raises(ValueError, match=r"K=256.*group_size=96"):
        reference.check_awq_shapes(qweight, scales, qzeros, 96)
    with pytest.raises(ValueError, match=r"scales \(4, 64\).*got scales \(4, 32\)"):
        reference.check_awq_shapes(qweight, scales[:, :32], qzeros, 64)
    with pytest.raises(TypeError, match="int32"):
        reference.check_awq_shapes(qweight.to(torch.int64), scales, qzeros, 64)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        reference.quantize_groupwise(torch.randn(8, 100), 64)
