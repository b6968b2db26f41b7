"""AutoAWQ's gemv / gemv_fast / marlin layouts: exact repacks to GEMM, checked against the layout
descriptions element by element, and end to end through a checkpoint load."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import random_awq
from fastawq import layouts, reference
from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.checkpoint import CheckpointError
from fastawq.quantize import QuantConfig, pack_model
from test_models import CONFIGS, calib_ids

# (K, N, G): group 32 / 64 / 128 / whole row, K // G not a multiple of 8 (padding), N straddling 64.
SHAPES = [(128, 64, 32), (192, 128, 64), (256, 192, 128), (512, 64, 128), (128, 256, -1), (1024, 64, 64)]


def _symmetric(qweight, scales, qzeros):
    return qweight, scales, reference.pack_int4(torch.full(reference.unpack_int4(qzeros).shape, 8, dtype=torch.int32))


def _gemm(k, n, g, layout, seed=0):
    qweight, scales, qzeros = random_awq(k, n, g, seed=seed)
    if layout == "marlin":
        qweight, scales, qzeros = _symmetric(qweight, scales, qzeros)
    return qweight, qzeros, scales


@pytest.mark.parametrize("layout", list(layouts.LAYOUTS))
@pytest.mark.parametrize("k,n,g", SHAPES)
def test_round_trip_is_bit_identical(layout, k, n, g):
    qweight, qzeros, scales = _gemm(k, n, g, layout, seed=k + n)
    lay = layouts.get_layout(layout)
    packed = lay.from_gemm(qweight, qzeros, scales, g)
    assert set(packed) == set(lay.names)
    q2, z2, s2 = lay.to_gemm(packed, g)
    assert torch.equal(q2, qweight) and torch.equal(z2, qzeros) and torch.equal(s2, scales)
    assert torch.equal(reference.dequantize(q2, s2, z2, g), reference.dequantize(qweight, scales, qzeros, g))


def _ints(qweight, qzeros, scales, g):
    return reference.unpack_int4(qweight), reference.unpack_int4(qzeros), scales


def test_gemv_matches_description():
    k, n, g = 192, 64, 64  # 3 groups: scales padded to 16 columns, zeros to 2 words
    qweight, qzeros, scales = _gemm(k, n, g, "gemv", seed=3)
    q, z, s = _ints(qweight, qzeros, scales, g)
    t = layouts.gemv_from_gemm(qweight, qzeros, scales, g)
    assert t["qweight"].shape == (n, k // 8) and t["qzeros"].shape == (n, 2) and t["scales"].shape == (n, 16)
    gen = torch.Generator().manual_seed(0)
    for kk, nn in torch.randint(0, 64, (200, 2), generator=gen).tolist():
        kk = kk * 3
        assert (int(t["qweight"][nn, kk // 8]) >> 4 * (kk % 8)) & 0xF == q[kk, nn]
    for grp in range(k // g):
        for nn in range(n):
            assert (int(t["qzeros"][nn, grp // 8]) >> 4 * (grp % 8)) & 0xF == z[grp, nn]
            assert t["scales"][nn, grp] == s[grp, nn]
    assert not t["scales"][:, 3:].any() and not (t["qzeros"][:, 0] >> 12).any() and not t["qzeros"][:, 1].any()


def _fast_position(kk: int, nn: int) -> tuple[int, int, int]:
    """Where AutoAWQ's gemv_fast puts q[kk, nn]: (row, int16 column, nibble), worked out by hand from
    pack_intweight's steps: channel o = 8a + 2b + c of each 32 goes to 8b + 4c + a, then the 4 rows
    x 64 channels block is read row after row, 4 nibbles per int16."""
    o = kk % 32
    j = (kk % 64) // 32 * 32 + ((o // 2) % 4) * 8 + (o % 2) * 4 + o // 8
    flat = (nn % 4) * 64 + j
    return nn // 4, kk // 64 * 64 + flat // 4, flat % 4


def test_gemv_fast_matches_description():
    k, n, g = 256, 64, 128
    qweight, qzeros, scales = _gemm(k, n, g, "gemv_fast", seed=4)
    q, z, s = _ints(qweight, qzeros, scales, g)
    t = layouts.gemv_fast_from_gemm(qweight, qzeros, scales, g)
    assert t["qweight"].dtype == torch.int16 and t["qweight"].shape == (n // 4, k)
    assert t["scales"].shape == t["qzeros"].shape == (8, n)
    for kk in range(k):
        for nn in range(0, n, 5):
            row, col, nib = _fast_position(kk, nn)
            assert (int(t["qweight"][row, col]) & 0xFFFF) >> 4 * nib & 0xF == q[kk, nn]
    assert torch.equal(t["scales"][:2], s)
    assert torch.equal(t["qzeros"][:2], -(s.float() * z).half())
    assert not t["scales"][2:].any() and not t["qzeros"][2:].any()


def test_gemv_fast_scaled_zeros_off_the_grid(caplog):
    """A scaled zero that is not -s * integer is rounded to the nearest zero point, with a warning;
    one that no zero point in [0, 15] explains is an error."""
    k, n, g = 128, 64, 64
    qweight, qzeros, scales = _gemm(k, n, g, "gemv_fast", seed=8)
    t = layouts.gemv_fast_from_gemm(qweight, qzeros, scales, g)
    t["qzeros"][0, 0] = t["qzeros"][0, 0] - 0.1 * t["scales"][0, 0]
    with caplog.at_level("WARNING", logger="fastawq.layouts"):
        _, z2, _ = layouts.gemv_fast_to_gemm(t, g)
    assert "1 scaled zero" in caplog.text and torch.equal(z2, qzeros)
    t["qzeros"][1, 3] = -17 * t["scales"][1, 3]
    with pytest.raises(layouts.LayoutError, match="integer z in"):
        layouts.gemv_fast_to_gemm(t, g)


def test_marlin_matches_description():
    k, n, g = 256, 128, 128
    qweight, qzeros, scales = _gemm(k, n, g, "marlin", seed=5)
    q, _, s = _ints(qweight, qzeros, scales, g)
    t = layouts.marlin_from_gemm(qweight, qzeros, scales, g)
    assert t["qweight"].shape == (k // 16, 2 * n)
    # Word 0 is thread 0's mma fragment of the first 16x16 tile: rows 0, 1, 8, 9 of columns 0 and
    # 8, nibbles in the (0, 2, 4, 6, 1, 3, 5, 7) order; word 1 the same fragment one tile right.
    frag = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]
    for word, dn in ((0, 0), (1, 16)):
        w = int(t["qweight"][0, word])
        assert [(w >> 4 * i) & 0xF for i in range(8)] == [int(q[r, c + dn]) for r, c in frag]
    # Thread 1 (word 4): rows 2, 3, 10, 11.
    w = int(t["qweight"][0, 4])
    assert [(w >> 4 * i) & 0xF for i in range(8)] == [int(q[r + 2, c]) for r, c in frag]
    # Scales: within each 64 values, position 8i + j holds value i + 8j (an 8x8 transpose).
    flat, orig = t["scales"].reshape(-1), s.reshape(-1)
    for m in (0, 1, 9, 63, 64 + 10):
        base, r = divmod(m, 64)
        assert flat[m] == orig[base * 64 + (r // 8) + 8 * (r % 8)]


def test_marlin_single_group_scale_order():
    k, n = 128, 64
    qweight, qzeros, scales = _gemm(k, n, -1, "marlin", seed=6)
    t = layouts.marlin_from_gemm(qweight, qzeros, scales, -1)
    order = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    assert torch.equal(t["scales"].reshape(-1, 32), scales.reshape(-1, 32)[:, order])


def test_marlin_refuses_zero_points():
    qweight, scales, qzeros = random_awq(128, 64, 128, seed=7)
    with pytest.raises(layouts.LayoutError, match="symmetric"):
        layouts.marlin_from_gemm(qweight, qzeros, scales, 128)


def test_bad_shapes_name_tensors():
    with pytest.raises(layouts.LayoutError, match=r"qweight \(64, 16\)"):
        layouts.gemv_to_gemm({"qweight": torch.zeros(64, 16, dtype=torch.int32),
                              "qzeros": torch.zeros(64, 1, dtype=torch.int32),
                              "scales": torch.zeros(64, 1, dtype=torch.float16)}, 64)
    with pytest.raises(layouts.LayoutError, match="int16"):
        layouts.gemv_fast_to_gemm({"qweight": torch.zeros(16, 128, dtype=torch.int32),
                                   "qzeros": torch.zeros(8, 64, dtype=torch.float16),
                                   "scales": torch.zeros(8, 64, dtype=torch.float16)}, 128)
    with pytest.raises(layouts.LayoutError, match="unknown AWQ layout"):
        layouts.get_layout("exllama")


# ------------------------------------------------------------ end to end through a checkpoint
def _tiny_checkpoint(tmp_path, zero_point: bool):
    cls_name, kwargs = CONFIGS["llama"]
    # k/v with 64 outputs: marlin needs N % 64 == 0
    config = getattr(transformers, cls_name)(**dict(kwargs, num_key_value_heads=4))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    qc = QuantConfig(q_group_size=32, zero_point=zero_point)
    pack_model(model, qc)  # round-to-nearest: the layouts only move the packed numbers around
    d = tmp_path / "gemm"
    AWQModel(model, qc).save_quantized(d)
    return d


def _rewrite(src, dst, layout: str, g: int):
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    out = {}
    for name, t in sd.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            for k, v in layouts.get_layout(layout).from_gemm(t, sd[f"{p}.qzeros"], sd[f"{p}.scales"], g).items():
                out[f"{p}.{k}"] = v
        elif not name.endswith((".qzeros", ".scales")):
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["version"] = layout
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("zero_point,names", [(True, ("gemv", "gemv_fast")), (False, tuple(layouts.LAYOUTS))])
def test_layout_checkpoints_load_like_gemm(tmp_path, zero_point, names):
    src = _tiny_checkpoint(tmp_path, zero_point)
    ids = calib_ids(1, 12, seed=5)
    with torch.no_grad():
        ref = AutoAWQForCausalLM.from_quantized(src, device_map="cpu")(ids).logits
        for layout in names:
            dst = tmp_path / layout
            _rewrite(src, dst, layout, 32)
            keys = load_file(dst / "model.safetensors").keys()
            assert any(k.endswith(".qzeros") for k in keys) == (layout != "marlin")
            model = AutoAWQForCausalLM.from_quantized(dst, device_map="cpu")
            assert model.quant_config.version == "gemm"
            assert torch.equal(model(ids).logits, ref), layout


def test_unknown_version_is_a_clear_error(tmp_path):
    src = _tiny_checkpoint(tmp_path, True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["version"] = "exllama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="exllama"):
        AutoAWQForCausalLM.from_quantized(src, device_map="cpu")
