"""Public ops: validation, backend dispatch and overrides, and the quantized linear module."""
from __future__ import annotations

import pytest
import torch

from fastawq import _ext, backend, ops, reference
from fastawq.modules import WQLinear

from conftest import assert_close_to_reference, random_awq, random_input


def test_torch_backend_matches_reference():
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input((2, 5, 256))
    out = ops.awq_gemm(x, qweight, scales, qzeros, 64, backend="torch")
    assert out.shape == (2, 5, 64)
    assert torch.equal(out, reference.awq_gemm(x, qweight, scales, qzeros, 64))


def test_auto_backend_on_cpu_is_never_the_interpreter():
    chosen = backend.select_backend("awq_gemm", torch.device("cpu"))
    assert chosen in ("cpu", "torch")


def test_forced_unavailable_backend_is_an_error():
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input((1, 256))
    with pytest.raises(backend.BackendUnavailableError, match="cuda.*CUDA devices"):
        ops.awq_gemm(x, qweight, scales, qzeros, 64, backend="cuda")
    with pytest.raises(backend.BackendUnavailableError, match="unknown backend"):
        ops.awq_gemm(x, qweight, scales, qzeros, 64, backend="tpu")


def test_env_override(monkeypatch):
    monkeypatch.setenv("FASTAWQ_BACKEND", "torch")
    assert backend.select_backend("awq_gemm", torch.device("cpu")) == "torch"
    monkeypatch.setenv("FASTAWQ_BACKEND", "cuda")
    with pytest.raises(backend.BackendUnavailableError):
        backend.select_backend("awq_gemm", torch.device("cpu"))


def test_triton_declines_fp32_activations_with_reason():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qweight, scales, qzeros = random_awq(256, 64, 64, device, dtype=torch.float32)
    x = random_input((1, 256), device, dtype=torch.float32)
    with pytest.raises(backend.BackendUnavailableError, match="fp16 or bf16"):
        ops.awq_gemm(x, qweight, scales, qzeros, 64, backend="triton")


@pytest.mark.parametrize(
    "x_shape, bias_shape, match",
    [((3, 128), None, r"x \(3, 128\) must end in K=256"), ((3, 256), (32,), r"bias \(32,\) must have shape \(64,\)")],
)
def test_bad_shapes_are_named(x_shape, bias_shape, match):
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input(x_shape)
    bias = None if bias_shape is None else torch.zeros(bias_shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        ops.awq_gemm(x, qweight, scales, qzeros, 64, bias)


def test_mixed_devices_are_named():
    qweight, scales, qzeros = random_awq(256, 64, 64)
    x = random_input((1, 256)).to("meta")
    with pytest.raises(ValueError, match="x on meta"):
        ops.awq_gemm(x, qweight, scales, qzeros, 64)


def test_env_report_lists_every_op():
    report = backend.report(torch.device("cpu"), ("awq_gemm", "awq_dequantize"))
    assert set(report) == {"awq_gemm", "awq_dequantize"}


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("bias", [True, False])
def test_wqlinear_from_linear_is_rtn(group_size, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=bias)
    layer = WQLinear.from_linear(linear, group_size)
    layer.backend = "torch"  # the module's semantics; each backend has its own kernel tests
    assert layer.qweight.shape == (256, 12) and layer.scales.shape == (256 // group_size, 96)
    x = random_input((4, 256), dtype=torch.float16)
    out = layer(x)
    w_hat = reference.pseudo_quantize(linear.weight.data, group_size)
    expect = x.float() @ w_hat.t().float() + (linear.bias.float() if bias else 0)
    assert_close_to_reference(out, x, layer.qweight, layer.scales, layer.qzeros, group_size, layer.bias)
    assert (out.float() - expect).abs().max() < 2e-2


def test_wqlinear_rejects_indivisible_shapes():
    with pytest.raises(ValueError, match="in_features=100 is not divisible by group_size=64"):
        WQLinear(100, 64, 64, bias=False)
    with pytest.raises(ValueError, match="out_features=60"):
        WQLinear(128, 60, 64, bias=False)


# --- the compiled GEMM: kernel names, one owner of the M threshold and of the fit rules -------

HAS_NAMED_GEMM = torch.cuda.is_available() and _ext.has_op("awq_gemm_declines")
needs_named_gemm = pytest.mark.skipif(not HAS_NAMED_GEMM, reason="needs CUDA and fastawq._C with named GEMM kernels")


def test_gemv_threshold_has_one_owner():
    assert backend.size_buckets("awq_gemm") == [*sorted(backend.CUDA_GEMM_KERNEL_BY_M), None]
    assert backend.CUDA_GEMV_MAX_M == max(backend.CUDA_GEMM_KERNEL_BY_M)
    assert [backend.cuda_gemm_kernel(b) for b in backend.size_buckets("awq_gemm")] == ["gemv", "gemv_staged", "auto"]


def test_extension_without_named_kernels_counts_as_unavailable(monkeypatch):
    monkeypatch.setattr(_ext, "has_op", lambda name: name != "awq_gemm_declines")
    assert "predates named GEMM kernels" in ops.cuda_gemm_declines("gemv", 1, 64, 256, 64)


@needs_named_gemm
@pytest.mark.parametrize("m", [1, 2, 3, 16, 127, 128, 129])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forced_cuda_matches_reference_across_m_buckets(m, dtype):
    qweight, scales, qzeros = random_awq(512, 320, 128, "cuda", dtype=dtype)
    bias = torch.randn(320, device="cuda", dtype=dtype)
    x = random_input((m, 512), "cuda", dtype=dtype)
    plan = ops.awq_gemm_plan(x, qweight, scales, qzeros, 128, bias, backend="cuda")
    assert plan.backend == "cuda"
    assert_close_to_reference(plan(x), x, qweight, scales, qzeros, 128, bias)


@needs_named_gemm
@pytest.mark.parametrize("kernel", ["auto", "gemv", "gemv_staged", "mma", "dequant_cublas"])
def test_named_kernels_pass_opcheck(kernel):
    qweight, scales, qzeros = random_awq(256, 128, 64, "cuda")
    m = 2 if kernel.startswith("gemv") else 33
    assert torch.ops.fastawq.awq_gemm_declines(kernel, m, 128, 256, 64) == ""
    x = random_input((m, 256), "cuda")
    bias = torch.randn(128, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.fastawq.awq_gemm.default, (x, qweight, scales, qzeros, 64, bias, kernel))
    out = torch.ops.fastawq.awq_gemm(x, qweight, scales, qzeros, 64, bias, kernel)
    assert_close_to_reference(out, x, qweight, scales, qzeros, 64, bias)


@needs_named_gemm
def test_gemv_declines_shapes_off_its_tiles():
    assert torch.ops.fastawq.awq_gemm_declines("gemv", 1, 128, 96 + 8, 8) != ""
    assert ops.cuda_gemm_declines("gemv", 1, 128, 256, 64) is None


@pytest.mark.skipif(not _ext.has_op("awq_cpu_gemm"), reason="fastawq._C without the CPU kernel")
def test_cpu_ops_pass_opcheck():
    qweight, scales, qzeros = random_awq(256, 128, 64, dtype=torch.float32)
    torch.library.opcheck(torch.ops.fastawq.awq_cpu_repack.default, (qweight, scales, qzeros, 64))
    w, s, z = torch.ops.fastawq.awq_cpu_repack(qweight, scales, qzeros, 64)
    x = random_input((3, 256), dtype=torch.float32)
    torch.library.opcheck(torch.ops.fastawq.awq_cpu_gemm.default, (x, w, s, z, 64, 128, None))


def test_wqlinear_backend_is_forced_and_replanned():
    torch.manual_seed(1)
    layer = WQLinear.from_linear(torch.nn.Linear(128, 64), 64)
    x = random_input((2, 128), dtype=torch.float32)
    layer.set_backend("torch")
    assert torch.equal(layer(x), reference.awq_gemm(x, layer.qweight, layer.scales, layer.qzeros, 64, layer.bias))
    assert layer._plan.backend == "torch"
    layer.set_backend("cuda")
    with pytest.raises(backend.BackendUnavailableError, match="'cuda' cannot run awq_gemm"):
        layer(x)
