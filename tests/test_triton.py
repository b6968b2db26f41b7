"""Triton kernels against reference.py: on the GPU when there is one, else under the interpreter."""
from __future__ import annotations

import pytest
import torch

from fastawq import ops, reference

from conftest import HAS_CUDA, LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input, requires_cuda

pytest.importorskip("triton")
tk = pytest.importorskip("fastawq.triton_kernels")

DEVICE = "cuda" if HAS_CUDA else "cpu"
# On CPU (interpreter) the shapes keep the divisibility of the real ones but stay small;
# N=200 is a multiple of 8 but not of any tile width, so the column masks are exercised.
SHAPES = LLAMA3_8B_SHAPES if HAS_CUDA else [(256, 128), (512, 200)]
MS = [1, 7, 16, 127, 128, 129, 1024]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}N{s[1]}")
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_matches_reference(shape, group_size, m, dtype):
    k, n = shape
    if not HAS_CUDA and m == 1024 and group_size != 128:
        pytest.skip("interpreter: M=1024 once per shape is enough")
    qweight, scales, qzeros = random_awq(k, n, group_size, DEVICE, dtype, seed=m + k)
    x = random_input((m, k), DEVICE, dtype, seed=m)
    bias = random_input((n,), DEVICE, dtype, seed=7) if m % 2 else None
    out = ops.awq_gemm(x, qweight, scales, qzeros, group_size, bias, backend="triton")
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_reference(out, x, qweight, scales, qzeros, reference.resolve_group_size(group_size, k), bias)


def _all_configs(m, n, k, g):
    from fastawq.triton_kernels.launch import candidate_configs, heuristic_config

    cfgs = candidate_configs(m, n, k, g, sms=132) + [heuristic_config(m, n, k, g, sms=132)]
    return list(dict.fromkeys(cfgs))


@pytest.mark.parametrize("m", [1, 16, 33, 200])
def test_every_candidate_config_is_correct(m):
    # The tuner may pick any candidate on the GPU, so each must be right, split-K ones included.
    k, n, g = (4096, 4096, 128) if HAS_CUDA else (512, 136, 128)
    qweight, scales, qzeros = random_awq(k, n, g, DEVICE, torch.float16, seed=m)
    x = random_input((m, k), DEVICE, torch.float16, seed=m + 1)
    bias = random_input((n,), DEVICE, torch.float16, seed=5)
    configs = _all_configs(m, n, k, g)
    if not HAS_CUDA:
        configs = configs[:: max(1, len(configs) // 4)]
    for cfg in configs:
        out = tk.awq_gemm(x, qweight, scales, qzeros, g, bias, config=cfg)
        assert_close_to_reference(out, x, qweight, scales, qzeros, g, bias)


def test_split_k_counters_rearm_across_calls():
    # A stale arrival counter would make a later call reduce before all partials have landed.
    from fastawq.triton_kernels.launch import GemmConfig

    k, n, g = 1024, 256, 128
    cfg = GemmConfig(16, 128, 128, split_k=4)
    for seed in range(3):
        qweight, scales, qzeros = random_awq(k, n, g, DEVICE, torch.float16, seed=seed)
        x = random_input((3, k), DEVICE, torch.float16, seed=seed)
        out = tk.awq_gemm(x, qweight, scales, qzeros, g, None, config=cfg)
        assert_close_to_reference(out, x, qweight, scales, qzeros, g)


def test_one_workspace_serves_gemm_and_attention():
    from fastawq.triton_kernels import attention, launch
    from fastawq.triton_kernels.workspace import WORKSPACE, Workspace

    assert launch._WORKSPACE is WORKSPACE and attention.WORKSPACE is WORKSPACE
    ws = Workspace()
    a = ws.get(torch.device("cpu"), "counters", 10, torch.int32, zeroed=True, minimum=16)
    assert a.numel() == 16 and not a.any()
    a.fill_(7)  # a kernel that failed to re-arm
    assert ws.get(torch.device("cpu"), "counters", 16, torch.int32, zeroed=True) is a
    b = ws.get(torch.device("cpu"), "counters", 17, torch.int32, zeroed=True)
    # Grown and zeroed; no capture saw the outgrown buffer, so nothing holds it any more.
    assert b.numel() == 17 and not b.any() and not ws.retired
    assert ws.buffers[torch.device("cpu")] == (b,)


def test_workspace_keeps_what_a_graph_captured(monkeypatch):
    # The GEMM tuner's split-K candidates grew the partials to 64 MiB (plus every outgrown size,
    # kept) for the life of the process; only buffers a CUDA-graph capture saw need to outlive use.
    from fastawq.triton_kernels import workspace

    ws = workspace.Workspace()
    cpu = torch.device("cpu")
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    a = ws.get(cpu, "partials", 8, torch.float32, zeroed=False)
    monkeypatch.setattr(workspace, "_capturing", lambda device: False)
    ws.release(cpu, "partials")
    assert ws.get(cpu, "partials", 8, torch.float32, zeroed=False) is a  # a graph holds it
    b = ws.get(cpu, "partials", 9, torch.float32, zeroed=False)
    assert b is not a and any(t is a for t in ws.retired)
    ws.release(cpu, "partials")
    assert cpu not in ws.buffers and not any(t is b for t in ws.retired)
    c = ws.get(cpu, "partials", 4, torch.float32, zeroed=False, minimum=6)
    assert c.numel() == 6 and ws.buffers[cpu] == (c,)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_is_exact(group_size, dtype):
    k, n = SHAPES[-1]
    qweight, scales, qzeros = random_awq(k, n, group_size, DEVICE, dtype, seed=11)
    out = ops.awq_dequantize(qweight, scales, qzeros, group_size, backend="triton")
    expect = reference.dequantize(qweight, scales, qzeros, group_size)
    if dtype == torch.bfloat16 and not HAS_CUDA:
        # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one ulp apart.
        torch.testing.assert_close(out, expect, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, expect)


def test_gemm_handles_strided_and_3d_input():
    k, n, g = 256, 64, 64
    qweight, scales, qzeros = random_awq(k, n, g, DEVICE, torch.float16)
    x = random_input((2, 3, 2 * k), DEVICE, torch.float16)[..., ::2]
    out = ops.awq_gemm(x, qweight, scales, qzeros, g, backend="triton")
    assert out.shape == (2, 3, n)
    assert_close_to_reference(out.reshape(6, n), x.reshape(6, k), qweight, scales, qzeros, g)


def test_gemm_takes_strided_weights_and_bias():
    # Strided scales/qzeros/bias were once indexed as if dense: silently wrong results.
    k, n, g = 256, 64, 64
    qweight, scales, qzeros = random_awq(k, 2 * n, g, DEVICE, torch.float16)
    qw, s, qz = qweight[:, ::2], scales[:, ::2], qzeros[:, ::2]
    bias = random_input((2 * n,), DEVICE, torch.float16, seed=9)[::2]
    x = random_input((3, k), DEVICE, torch.float16)
    # Views along N are not valid AWQ packings (columns interleave within a word), but the
    # kernel must compute what the reference computes on the same tensors.
    out = ops.awq_gemm(x, qw, s, qz, g, bias, backend="triton")
    assert_close_to_reference(out, x, qw.contiguous(), s.contiguous(), qz.contiguous(), g, bias.contiguous())
    deq = ops.awq_dequantize(qw, s, qz, g, backend="triton")
    expect = reference.dequantize(qw.contiguous(), s.contiguous(), qz.contiguous(), g)
    torch.testing.assert_close(deq, expect, rtol=0, atol=0)


@requires_cuda
def test_gemm_under_cuda_graph_replay():
    k, n, g = 4096, 4096, 128
    qweight, scales, qzeros = random_awq(k, n, g, "cuda", torch.float16)
    x = random_input((1, k), "cuda", torch.float16)
    ops.awq_gemm(x, qweight, scales, qzeros, g, backend="triton")  # tune and compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.awq_gemm(x, qweight, scales, qzeros, g, backend="triton")
    for seed in range(3):
        x.copy_(random_input((1, k), "cuda", torch.float16, seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        assert_close_to_reference(out, x, qweight, scales, qzeros, g)
