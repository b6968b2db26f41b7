"""The packed W4 layout as a whole: its ops (packed_gemm, packed_dequantize) on every backend against
reference.py, and WQLinear holding it (set_layout, state_dict, save / load, from_quantized).

The oracle is the AWQ-layout reference on the tensors the packed ones were repacked from, and
reference.packed_gemm / dequantize_packed, which read the packed layout by its element formula.
Triton runs under the interpreter on CPU (small shapes), on the real shapes on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, LLAMA3_8B_SHAPES, assert_close_to_reference, random_awq, random_input, requires_cuda
from fastawq import _ext, backend, ops, reference
from fastawq.modules import WQLinear
from fastawq.modules.qlinear import set_layout

pytest.importorskip("triton")

DEVICE = "cuda" if HAS_CUDA else "cpu"
# (K, N, G): on the GPU the Llama-3-8B shapes; N=200 and 136 are multiples of 8 but not of any tile
# width (column masks), and K spans several groups.
GEMM_CASES = [(k, n, 128) for k, n in LLAMA3_8B_SHAPES] + [(512, 200, 32)] if HAS_CUDA else [
    (256, 136, 32), (512, 200, 128)]
SHAPES = [(k, n) for k, n, _ in GEMM_CASES]
MS = [1, 5, 16, 127, 128, 129, 1024] if HAS_CUDA else [1, 5, 16, 33]
DTYPES = [torch.float16, torch.bfloat16]


def _packed(k, n, g, dtype=torch.float16, seed=0, device=DEVICE):
    qw, s, qz = random_awq(k, n, g, device, dtype, seed=seed)
    wp, sz = ops.awq_gemv_repack(qw, s, qz, g)
    return qw, s, qz, wp, sz


def _poisoned(fn):
    """Run fn after filling a freed block with NaN, so outputs a kernel leaves unwritten show."""
    junk = torch.full((1 << 16,), float("nan"), device=DEVICE)
    del junk
    return fn()


@pytest.mark.parametrize("k,n", [(64, 24), (256, 136), (384, 200)])
@pytest.mark.parametrize("g", [8, 32, 64, -1])
def test_reference_reads_the_layout_it_was_repacked_to(k, n, g):
    # Two independent readings: the AWQ reference on the originals, the packed one by its formula.
    if g != -1 and k % g:
        pytest.skip("K not a multiple of G")
    qw, s, qz, wp, sz = _packed(k, n, g, torch.bfloat16, seed=k + n, device="cpu")
    assert torch.equal(reference.dequantize_packed(wp, sz, n, g).view(torch.int16),
                       reference.dequantize(qw, s, qz, g).view(torch.int16))
    x = random_input((3, k), dtype=torch.bfloat16)
    bias = random_input((n,), dtype=torch.bfloat16, seed=4)
    torch.testing.assert_close(reference.packed_gemm(x, wp, sz, n, g, bias),
                               reference.awq_gemm(x, qw, s, qz, g, bias), rtol=0, atol=0)


@pytest.mark.parametrize("k,n,group_size", GEMM_CASES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_gemm_matches_reference(k, n, group_size, m, dtype):
    qw, s, qz, wp, sz = _packed(k, n, group_size, dtype, seed=m + k)
    x = random_input((m, k), DEVICE, dtype, seed=m)
    bias = random_input((n,), DEVICE, dtype, seed=7) if m % 2 else None
    out = _poisoned(lambda: ops.packed_gemm(x, wp, sz, n, group_size, bias, backend="triton"))
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_to_reference(out, x, qw, s, qz, group_size, bias)


@pytest.mark.parametrize("m", [16, 33, 200] if HAS_CUDA else [1, 16, 33, 200])
def test_every_packed_candidate_config_is_correct(m):
    # The tuner may pick any candidate on the GPU (dequantize + cuBLAS included), so each must be right.
    from fastawq.triton_kernels import launch

    k, n, g = (4096, 4096, 128) if HAS_CUDA else (512, 136, 128)
    qw, s, qz, wp, sz = _packed(k, n, g, seed=m)
    x = random_input((m, k), DEVICE, torch.float16, seed=m + 1)
    bias = random_input((n,), DEVICE, torch.float16, seed=5)
    configs = launch.candidate_configs(m, n, k, g, sms=132, packed=True)
    configs = list(dict.fromkeys(configs + [launch.heuristic_config(m, n, k, g, sms=132, packed=True)]))
    assert not any(getattr(c, "gemv", False) for c in configs), "the GEMV kernel reads the AWQ layout only"
    if not HAS_CUDA:
        configs = configs[:: max(1, len(configs) // 3)]
    for cfg in configs:
        out = launch.packed_gemm(x, wp, sz, n, g, bias, config=cfg)
        assert_close_to_reference(out, x, qw, s, qz, g, bias)


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_is_exact(group_size, dtype):
    k, n = SHAPES[-1]
    qw, s, qz, wp, sz = _packed(k, n, group_size, dtype, seed=11)
    expect = reference.dequantize(qw, s, qz, group_size)
    for be in ("torch", "triton"):
        out = _poisoned(lambda: ops.packed_dequantize(wp, sz, n, group_size, backend=be))
        if be == "triton" and dtype == torch.bfloat16 and not HAS_CUDA:
            # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one ulp apart.
            torch.testing.assert_close(out, expect, rtol=2**-7, atol=0)
        else:
            assert torch.equal(out.view(torch.int16), expect.view(torch.int16)), be


@pytest.mark.parametrize("k,n,g", [(64, 24, 8), (200, 40, 40), (96, 264, 96)])
def test_dequantize_takes_any_group_multiple_of_8(k, n, g):
    # Groups that 32 does not divide take the kernel's 8-row tiles.
    qw, s, qz, wp, sz = _packed(k, n, g, seed=k)
    out = _poisoned(lambda: ops.packed_dequantize(wp, sz, n, g, backend="triton"))
    assert torch.equal(out, reference.dequantize(qw, s, qz, g))


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_opcheck(be):
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _packed(k, n, g)
    x = random_input((3, k), DEVICE, torch.float16)
    bias = random_input((n,), DEVICE, torch.float16, seed=2)
    torch.library.opcheck(torch.ops.fastawq.packed_gemm.default, (x, wp, sz, n, g, bias, be))
    torch.library.opcheck(torch.ops.fastawq.packed_gemm.default, (x, wp, sz, n, g, None, be))
    torch.library.opcheck(torch.ops.fastawq.packed_dequantize.default, (wp, sz, n, g, be))


def test_bad_inputs_are_named():
    k, n, g = 256, 136, 64
    _, _, _, wp, sz = _packed(k, n, g, device="cpu")
    x = random_input((2, k))
    with pytest.raises(ValueError, match="must end in K=256"):
        ops.packed_gemm(random_input((2, k + 8)), wp, sz, n, g)
    with pytest.raises(ValueError, match=r"wpacked must be int32 \[K/8, N=128\]"):
        ops.packed_gemm(x, wp, sz, 128, g)
    with pytest.raises(ValueError, match="szpacked must be"):
        ops.packed_gemm(x, wp, sz[:, :8], n, g)
    with pytest.raises(ValueError, match="bias"):
        ops.packed_gemm(x, wp, sz, n, g, random_input((n + 8,)))
    with pytest.raises(ValueError, match="group_size=48"):
        ops.packed_dequantize(wp, sz, n, 48)
    with pytest.raises(backend.BackendUnavailableError, match="cuda"):
        ops.packed_gemm(x, wp, sz, n, g, backend="cuda")


@requires_cuda
def test_dispatch_by_m_on_cuda():
    k, n, g = 4096, 4096, 128
    _, _, _, wp, sz = _packed(k, n, g)
    plan = ops.packed_gemm_plan(random_input((1, k), "cuda"), wp, sz, n, g)
    expect = "cuda/triton" if _ext.has_op("awq_gemv_packed") else "triton"
    assert plan.backend == expect


# --- WQLinear holding the packed layout ---


def _layer(k=256, n=136, g=64, bias=True, dtype=torch.float16, device=DEVICE, seed=3):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return WQLinear.from_linear(lin.to(dtype), g).to(device)


def _bits(sd):
    return {k: v.view(torch.int16) if v.is_floating_point() else v for k, v in sd.items()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dict_is_the_awq_tensors_bit_for_bit(bias, dtype):
    layer = _layer(bias=bias, dtype=dtype, device="cpu")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.set_layout("packed")
    assert layer.layout == "packed" and set(layer._buffers) == {"wpacked", "szpacked"} | ({"bias"} if bias else set())
    after = layer.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(a, b) for a, b in zip(_bits(after).values(), _bits(before).values()))
    layer.set_layout("awq")
    back = layer.state_dict()
    assert list(back) == list(before)
    assert all(torch.equal(a, b) for a, b in zip(_bits(back).values(), _bits(before).values()))


def test_unpack_to_places_a_packed_layers_awq_tensors(monkeypatch):
    # save_quantized unpacks each packed layer to the CPU as it goes (a GPU model never holds a
    # second copy of all its weights); here "meta" stands in for the other device.
    from fastawq import checkpoint
    from fastawq.modules import qlinear

    layer = _layer(bias=True, device="cpu")
    layer.set_layout("packed")
    with qlinear.unpack_to("meta"):
        sd = layer.state_dict()
    assert {k: v.device.type for k, v in sd.items()} == {"qweight": "meta", "qzeros": "meta", "scales": "meta",
                                                          "bias": "cpu"}
    assert all(v.device.type == "cpu" for v in layer.state_dict().values())  # outside it: the layer's device
    seen = []
    unpack = WQLinear._awq_tensors
    monkeypatch.setattr(WQLinear, "_awq_tensors", lambda self: seen.append(qlinear._UNPACK_DEVICE.get()) or unpack(self))
    saved = checkpoint._state_dict_for_save(torch.nn.Sequential(layer))
    assert seen == [torch.device("cpu")]
    assert all(torch.equal(a, b) for a, b in zip(_bits(saved).values(), _bits(layer.state_dict()).values()))


def test_packed_layer_loads_an_awq_state_dict():
    src = _layer(device="cpu", seed=1)
    dst = _layer(device="cpu", seed=2)
    dst.set_layout("packed")
    dst.load_state_dict(src.state_dict())
    assert dst.layout == "packed"
    assert all(torch.equal(a, b) for a, b in zip(_bits(dst.state_dict()).values(), _bits(src.state_dict()).values()))


@pytest.mark.parametrize("m", [1, 5, 33])
def test_forward_is_the_same_in_both_layouts(m):
    layer = _layer()
    x = random_input((2, m, 256), DEVICE)
    qw, s, qz = layer.qweight.clone(), layer.scales.clone(), layer.qzeros.clone()
    awq_out = layer(x)
    layer.set_layout("packed")
    out = layer(x)
    assert out.shape == (2, m, 136)
    assert_close_to_reference(out.reshape(-1, 136), x.reshape(-1, 256), qw, s, qz, 64, layer.bias)
    assert_close_to_reference(awq_out.reshape(-1, 136), x.reshape(-1, 256), qw, s, qz, 64, layer.bias)


def test_packed_layer_names_the_missing_awq_tensor():
    layer = _layer(device="cpu")
    layer.set_layout("packed")
    with pytest.raises(AttributeError, match="packed layout.*set_layout"):
        _ = layer.qweight
    with pytest.raises(ValueError, match="layout must be one of"):
        layer.set_layout("gptq")
    assert "layout=packed" in repr(layer)


def test_auto_layout_follows_the_backend_choice(monkeypatch):
    layer = _layer(device="cpu")
    layer.set_layout("auto")
    assert layer.layout == backend.preferred_layout(torch.device("cpu")) == "awq"
    cuda = torch.device("cuda")
    monkeypatch.setattr(backend._ext, "has_op", lambda name: True)
    # Packed where it was measured to win: the fused engine's decode at batch <= 16.
    top = backend.packed_fused_max_batch(cuda)
    assert [backend.preferred_layout(cuda, b) for b in (1, 4, top, top + 1, None)] == [
        "packed", "packed", "packed", "awq", "awq"]
    assert backend.preferred_layout(torch.device("cpu"), 1) == "awq"
    # Without the tensor-core kernel only the batches the GEMV serves.
    monkeypatch.setattr(backend._ext, "has_op", lambda name: name != "awq_mma_packed")
    assert [backend.preferred_layout(cuda, b) for b in (1, backend.PACKED_GEMV_MAX_M + 1)] == ["packed", "awq"]
    monkeypatch.setattr(backend._ext, "has_op", lambda name: name != "awq_gemv_packed")
    assert backend.preferred_layout(cuda, 1) == "awq"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny quantized Llama saved from the AWQ layout and again after converting to packed."""
    from fastawq.auto import AWQModel
    from fastawq.quantize import QuantConfig, quantize
    from test_models import calib_ids, tiny_model

    model = tiny_model("llama")
    qc = QuantConfig(q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(), max_calib_samples=2, max_calib_seq_len=16)
    ids = calib_ids(1, 8)
    with torch.no_grad():
        want = model(ids).logits
    root = tmp_path_factory.mktemp("packed_layout")
    AWQModel(model, qc).save_quantized(root / "awq")
    assert set_layout(model, "packed") > 0
    AWQModel(model, qc).save_quantized(root / "packed")
    return root, ids, want


def test_saved_checkpoint_is_identical_from_either_layout(tiny_checkpoint):
    from safetensors.torch import load_file

    from fastawq.auto import AutoAWQForCausalLM

    root, ids, want = tiny_checkpoint
    a, b = load_file(root / "awq" / "model.safetensors"), load_file(root / "packed" / "model.safetensors")
    assert list(a) == list(b) and all(torch.equal(_bits(a)[k], _bits(b)[k]) for k in a)
    assert (root / "awq" / "model.safetensors").read_bytes() == (root / "packed" / "model.safetensors").read_bytes()
    loaded = AutoAWQForCausalLM.from_quantized(root / "packed", device_map="cpu", layout="packed",
                                              torch_dtype=torch.float16)
    assert all(m.layout == "packed" for m in loaded.model.modules() if isinstance(m, WQLinear))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits.float(), want.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="layout must be one of"):
        AutoAWQForCausalLM.from_quantized(root / "packed", device_map="cpu", layout="marlin")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cuda" else [torch.float32])
def test_fused_engine_serves_the_packed_layout(tiny_checkpoint, dtype):
    # The engine fuses q/k/v and gate/up by concatenating AWQ tensors; the layout converts after.
    # On a GPU, fp32 runs the reference ops inside the CUDA graph and fp16 the kernels.
    from fastawq.auto import AutoAWQForCausalLM

    root, ids, _ = tiny_checkpoint
    ids = ids.to(DEVICE)
    runs = {}
    for layout in ("awq", "packed"):
        model = AutoAWQForCausalLM.from_quantized(root / "awq", device_map=DEVICE, fuse_layers=True, layout=layout,
                                                  torch_dtype=dtype)
        layers = [m for m in model.model.modules() if isinstance(m, WQLinear)]
        assert layers and all(m.layout == layout for m in layers)
        with torch.no_grad():
            logits = model(ids).logits.float()
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)  # decode at M = 1 (CUDA graphs on GPUs)
        runs[layout] = (logits, tokens)
    torch.testing.assert_close(runs["packed"][0], runs["awq"][0], rtol=2e-2, atol=2e-2)
    assert runs["packed"][1].shape == runs["awq"][1].shape


def test_bench_runs_the_packed_layout():
    from fastawq.commands import bench

    rows = bench.bench(None, "tiny", ["w4", "fused"], [8], 1, "cpu", dtype=torch.float32, layout="packed")
    assert [r.mode for r in rows] == ["w4", "fused"] and all(r.decode_tps and r.decode_tps > 0 for r in rows)


@pytest.mark.parametrize("g", [32, -1])
def test_set_layout_in_slices_of_k_is_exact(monkeypatch, g):
    # One Llama-3-8B gate/up converted in one piece held 0.9 GiB of int32 nibbles above the weights;
    # set_layout now converts K in slices of whole groups, which must give the same bits both ways.
    from fastawq.modules import qlinear

    k, n = 256, 136
    qw, s, qz = random_awq(k, n, g, "cpu", torch.float16, seed=4)
    wp, sz = ops.awq_gemv_repack(qw, s, qz, g)
    monkeypatch.setattr(qlinear, "_CONVERT_BYTES", 4 * n * 64)  # 64 rows of K a slice
    assert len(qlinear._row_slices(k, n, 32)) == 4 and len(qlinear._row_slices(k, n, k)) == 1
    layer = WQLinear(k, n, g, False, device="cpu")
    layer.qweight.copy_(qw), layer.scales.copy_(s), layer.qzeros.copy_(qz)
    layer.set_layout("packed")
    assert torch.equal(layer.wpacked, wp) and torch.equal(layer.szpacked.view(torch.int16), sz.view(torch.int16))
    layer.set_layout("awq")
    assert torch.equal(layer.qweight, qw) and torch.equal(layer.qzeros, qz)
    assert torch.equal(layer.scales.view(torch.int16), s.view(torch.int16))
