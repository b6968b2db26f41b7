"""fastawq's own CPU W4 GEMM (csrc/cpu/, ops fastawq::awq_cpu_repack / awq_cpu_gemm) against
reference.py, on every instruction set this CPU runs (avx512bf16, avx512, avx2, scalar), and the
int8-activation kernel (avx2_int8) against reference.py on the same int8-rounded activations.

Skipped when fastawq._C is absent or predates the CPU kernel; CI builds _C, so they run there.
"""
from __future__ import annotations

import pytest
import torch

from fastawq import cpu as cpu_backend
from fastawq import reference
from conftest import exact_awq_problem, random_awq, random_input, same_dtype_error

pytestmark = pytest.mark.skipif(
    cpu_backend.fast_kernel_available() is not None, reason=f"{cpu_backend.fast_kernel_available()}"
)

ISAS = cpu_backend.fast_kernel_isas()
# (K, N): N straddles the kernel's 64-column block (and AVX2's 32-column halves, 16-lane vectors,
# the 8-column AWQ word); K spans several groups of every size below.
SHAPES = [(384, 8), (256, 72), (768, 136), (640, 192)]
GROUPS = [8, 16, 32, 64, 128, -1]
MS = [1, 3, 16, 17]


def _isas_for(dtype: torch.dtype) -> list[str]:
    """The exact kernels (avx2_int8 rounds the activations: tested on its own below)."""
    return [isa for isa in ISAS if (dtype == torch.bfloat16 or isa != "avx512bf16") and "int8" not in isa]


def _int8_rounded(x: torch.Tensor, g: int) -> torch.Tensor:
    """x as the int8 kernel sees it: blocks of 32 (16, 8: the largest dividing g) rows of K,
    scale max|x| / 127, round half to even."""
    m, k = x.shape
    block = 32 if g % 32 == 0 else 16 if g % 16 == 0 else 8
    xb = x.float().reshape(m, k // block, block)
    scale = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(xb / scale), torch.zeros_like(xb))
    return (q * scale).reshape(m, k)


def _poison_allocator(m: int, n: int) -> None:
    """Leave NaN in freed memory the output may be carved from, so an unwritten element shows."""
    junk = torch.full((m, n), float("nan"), dtype=torch.float32)
    del junk


def _check(out, x, qweight, scales, qzeros, g, bias=None, factor: float = 2.0) -> None:
    """Error against the fp32 oracle within `factor` x that of plain torch in x's dtype (fp32:
    dequantize then matmul; bf16: a bf16 matmul), plus a few fp32 ulps of the output's size."""
    n = scales.shape[1]
    assert out.dtype == x.dtype and out.shape == (x.shape[0], n)
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten?)"
    ref = reference.awq_gemm(x.float(), qweight, scales, qzeros, g, None if bias is None else bias.float())
    err = (out.float() - ref).abs().max().item()
    yard = same_dtype_error(x, qweight, scales, qzeros, g, bias)
    budget = factor * yard + 8 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    assert err <= budget, f"max error {err:.4g} > budget {budget:.4g} (torch {x.dtype} {yard:.4g})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}N{s[1]}")
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", ["exact", "int8"])
def test_gemm_matches_reference(shape, group_size, m, dtype, with_bias, act):
    if act == "int8" and "avx2_int8" not in ISAS:
        pytest.skip("no AVX2 int8-activation kernel on this CPU / build")
    k, n = shape
    g = reference.resolve_group_size(group_size, k)
    qweight, scales, qzeros = random_awq(k, n, g, seed=k + n + g)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, g)
    x = random_input((m, k), dtype=dtype, seed=m)
    bias = random_input((n,), dtype=dtype, seed=7) if with_bias else None
    if act == "exact":
        for isa in _isas_for(dtype):
            _poison_allocator(m, n)
            out = torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, bias, isa)
            _check(out, x, qweight, scales, qzeros, g, bias)
        return
    # The integer dot products are exact: against the fp32 oracle on the int8-rounded x, only
    # the fp32 sums over blocks and the output rounding differ. Against the unrounded x, the
    # error is the activations' rounding (about 0.5% of the output's size on normal x).
    x[0, : k // 3] *= 30.0  # a block of large activations next to small ones
    bias32 = None if bias is None else bias.float()
    for isa in ("avx2_int8", "int8"):
        _poison_allocator(m, n)
        out = torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, bias, isa)
        assert out.dtype == dtype and out.shape == (m, n) and torch.isfinite(out).all()
        ref = reference.awq_gemm(_int8_rounded(x, g), qweight, scales, qzeros, g, bias32)
        top = ref.abs().max().item()
        tol = 2e-6 * top * (k / 128) ** 0.5 if dtype == torch.float32 else 4e-3 * top
        err = (out.float() - ref).abs().max().item()
        assert err <= tol, f"{isa}: max error {err:.4g} > {tol:.4g} against the rounded-x oracle"
        exact = reference.awq_gemm(x.float(), qweight, scales, qzeros, g, bias32)
        rel = float((out.float() - exact).norm() / exact.norm())
        assert rel < 2e-2, f"{isa}: relative error {rel:.3g} against the exact product"


needs_int8 = pytest.mark.skipif("avx2_int8" not in ISAS, reason="no AVX2 int8-activation kernel on this CPU / build")


@needs_int8
def test_int8_kernel_zero_and_tiny_blocks():
    # An all-zero block has scale 0 (q = 0, no division by zero); a row of zeros gives the bias.
    k, n, g = 256, 72, 64
    qweight, scales, qzeros = random_awq(k, n, g, seed=21)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, g)
    x = random_input((3, k), dtype=torch.float32, seed=22)
    x[0] = 0.0
    x[1, 32:96] = 0.0
    x[2, :32] *= 1e-30
    bias = random_input((n,), dtype=torch.float32, seed=23)
    out = torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, bias, "int8")
    assert torch.equal(out[0], bias)
    ref = reference.awq_gemm(_int8_rounded(x, g), qweight, scales, qzeros, g, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_repack_and_kernel_are_exact(scale_dtype, dtype):
    x, qweight, s, qzeros, g = exact_awq_problem(256, 200, 64, 5, scale_dtype, dtype)
    n = s.shape[1]
    w, sc, z = torch.ops.fastawq.awq_cpu_repack(qweight, s, qzeros, g)
    ref = reference.awq_gemm(x, qweight, s, qzeros, g)
    for isa in _isas_for(dtype):
        out = torch.ops.fastawq.awq_cpu_gemm(x, w, sc, z, g, n, None, isa)
        assert torch.equal(out, ref), f"{isa}: max diff {(out.float() - ref.float()).abs().max().item()}"


def test_repack_layout():
    # Row 8*o + r of column c lands in nibble [0, 4, 1, 5, 2, 6, 3, 7][r] of w[c // 64, o, c % 64].
    k, n, g = 64, 136, 32
    qweight, scales, qzeros = random_awq(k, n, g, seed=9)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, g)
    assert w.shape == (3, k // 8, 64) and s.shape == z.shape == (3, k // g, 64)
    q = reference.unpack_int4(qweight)
    nib = (0, 4, 1, 5, 2, 6, 3, 7)
    for kk, c in [(0, 0), (13, 70), (63, 135), (42, 64)]:
        got = (int(w[c // 64, kk // 8, c % 64]) >> (4 * nib[kk % 8])) & 0xF
        word = int(qweight[kk, c // 8]) & 0xFFFFFFFF
        want = (word >> (4 * reference.AWQ_REVERSE_ORDER[c % 8])) & 0xF
        assert got == want == int(q[kk, c]), (kk, c)
    assert torch.equal(s[2, :, : n - 128], scales[:, 128:].float()) and not s[2, :, n - 128:].any()
    zw = (qzeros[1, 70 // 8] >> (4 * reference.AWQ_REVERSE_ORDER[70 % 8])) & 0xF
    assert int(z[1, 1, 6]) == 16 + int(zw)


def test_strided_rows_and_inference_mode():
    k, n, g = 256, 72, 32
    qweight, scales, qzeros = random_awq(k, n, g, seed=4)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, g)
    with torch.inference_mode():
        wide = random_input((6, 2 * k), dtype=torch.float32)
        x = wide[::2, :k]  # rows 2K apart
        out = torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, None)
    _check(out, x.contiguous(), qweight, scales, qzeros, g)
    xt = random_input((k, 5), dtype=torch.bfloat16).t()  # unit stride along M, not K
    _check(torch.ops.fastawq.awq_cpu_gemm(xt, w, s, z, g, n, None), xt, qweight, scales, qzeros, g)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_agree(threads):
    k, n, g = 512, 1024, 128
    qweight, scales, qzeros = random_awq(k, n, g, seed=6)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, g)
    x = random_input((2, k), dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, torch.ops.fastawq.awq_cpu_gemm(x, w, s, z, g, n, None))
    _check(out, x, qweight, scales, qzeros, g)


def test_empty_rows():
    qweight, scales, qzeros = random_awq(64, 64, 32)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, 32)
    assert torch.ops.fastawq.awq_cpu_gemm(torch.empty(0, 64), w, s, z, 32, 64, None).shape == (0, 64)


def test_bad_inputs_name_shapes_and_dtypes():
    qweight, scales, qzeros = random_awq(128, 64, 32)
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, 32)
    x = random_input((3, 128), dtype=torch.float32)
    gemm = torch.ops.fastawq.awq_cpu_gemm
    with pytest.raises(RuntimeError, match=r"x \[3, 64\] has K=64 but w \[1, 16, 64\] has K=128"):
        gemm(x[:, :64], w, s, z, 32, 64, None)
    with pytest.raises(RuntimeError, match=r"x must be fp32 or bf16, got Half"):
        gemm(x.half(), w, s, z, 32, 64, None)
    with pytest.raises(RuntimeError, match=r"bias \[32\] must be \[64\]"):
        gemm(x, w, s, z, 32, 64, torch.zeros(32))
    with pytest.raises(RuntimeError, match=r"N=100 does not match w \[1, 16, 64\]"):
        gemm(x, w, s, z, 32, 100, None)
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous CPU fp32 \[1, 4, 64\]"):
        gemm(x, w, s.half(), z, 32, 64, None)
    with pytest.raises(RuntimeError, match="the avx512bf16 kernel takes bf16 activations"):
        gemm(x, w, s, z, 32, 64, None, "avx512bf16")
    with pytest.raises(RuntimeError, match="isa must be auto, avx512bf16, avx512, avx2, scalar, int8 or avx2_int8"):
        gemm(x, w, s, z, 32, 64, None, "sse9")
    with pytest.raises(RuntimeError, match=r"group_size=12 must be a positive multiple of 8 that divides K=128"):
        torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, 12)
    with pytest.raises(RuntimeError, match=r"expected scales \[2, 64\] and qzeros \[2, 8\], got scales \[3, 64\]"):
        torch.ops.fastawq.awq_cpu_repack(qweight, scales[:3], qzeros[:3], 64)
    with pytest.raises(RuntimeError, match="qweight and qzeros must be int32, got Float"):
        torch.ops.fastawq.awq_cpu_repack(qweight.float(), scales, qzeros, 32)


def test_opcheck():
    # The compiled ops' fake impls live in fastawq.ops (its import registers them); run alone, this
    # file imported nothing that imports it and opcheck found no fake impl.
    import fastawq.ops  # noqa: F401

    qweight, scales, qzeros = random_awq(128, 72, 32)
    torch.library.opcheck(torch.ops.fastawq.awq_cpu_repack.default, (qweight, scales, qzeros, 32))
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, 32)
    x = random_input((3, 128), dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fastawq.awq_cpu_gemm.default, (x, w, s, z, 32, 72, None, "auto"))
    if "avx2_int8" in ISAS:
        torch.library.opcheck(torch.ops.fastawq.awq_cpu_gemm.default, (x.float(), w, s, z, 32, 72, None, "int8"))
