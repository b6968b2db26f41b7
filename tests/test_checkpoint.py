"""AWQ checkpoints: layout, sharding, refusal to overwrite, and clear errors on damage."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.checkpoint import CheckpointError, parse_size
from fastawq.quantize import QuantConfig, quantize
from test_models import calib_ids, tiny_model


@pytest.fixture(scope="module")
def packed():
    model = tiny_model("llama")
    qc = QuantConfig(q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(), max_calib_samples=4, max_calib_seq_len=32)
    return AWQModel(model, qc)


def test_config_and_tensor_layout(packed, tmp_path):
    packed.save_quantized(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None,
    }
    sd = load_file(tmp_path / "model.safetensors")
    k = "model.layers.0.mlp.down_proj"
    assert sd[f"{k}.qweight"].shape == (128, 64 // 8) and sd[f"{k}.qweight"].dtype == torch.int32
    assert sd[f"{k}.qzeros"].shape == (128 // 32, 64 // 8)
    assert sd[f"{k}.scales"].shape == (128 // 32, 64) and sd[f"{k}.scales"].dtype == torch.float16
    assert "lm_head.weight" not in sd  # tied to the embedding


def test_sharded_roundtrip(packed, tmp_path):
    packed.save_quantized(tmp_path, shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = calib_ids(1, 12)
    loaded = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)


def test_refuses_non_empty_directory(packed, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        packed.save_quantized(tmp_path)
    packed.save_quantized(tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "model.safetensors").exists()


def test_missing_shard_names_file(packed, tmp_path):
    packed.save_quantized(tmp_path, shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")


def test_truncated_shard_names_file(packed, tmp_path):
    packed.save_quantized(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")


def test_wrong_shape_names_tensor(packed, tmp_path):
    packed.save_quantized(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    k = "model.layers.1.self_attn.o_proj.qzeros"
    sd[k] = torch.zeros(sd[k].shape[0] + 1, sd[k].shape[1], dtype=torch.int32)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="sha256"):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")
    with pytest.raises(CheckpointError, match=k.replace(".", r"\.")):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", verify="off")


def test_only_safetensors_are_read(packed, tmp_path):
    packed.save_quantized(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    (tmp_path / "fastawq_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="only safetensors"):
        AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu")


def test_autoawq_written_checkpoint_loads(packed, tmp_path):
    """AutoAWQ's files: its own config keys (w_bit/q_group_size spelled as HF's bits/group_size
    plus extra fields) and an index even for one shard."""
    packed.save_quantized(tmp_path)
    (tmp_path / "fastawq_manifest.json").unlink()
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4,
                                  "version": "gemm", "modules_to_not_convert": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    sd = load_file(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in sd}}))
    loaded = AutoAWQForCausalLM.from_quantized(tmp_path, device_map="cpu", use_ipex=True)
    ids = calib_ids(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("20KB") == 20_000 and parse_size(123) == 123
    with pytest.raises(ValueError, match="shard size"):
        parse_size("lots")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_all_finite_at_the_dtype_limits(dtype, bad):
    """A sum of values at the dtype's max must not read as overflow; one NaN / inf must be seen."""
    from fastawq.checkpoint import all_finite

    t = torch.full((4096,), torch.finfo(dtype).max, dtype=dtype)
    t[::2] = -t[::2]
    t[:7] = torch.finfo(dtype).max
    if bad is not None:
        t[1234] = bad
    assert all_finite(t) == (bad is None)


def test_manifest_lists_every_file(packed, tmp_path):
    from fastawq.checkpoint import MANIFEST_NAME

    packed.save_quantized(tmp_path / "c", shard_size="20KB")
    doc = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    assert set(doc["files"]) == {p.name for p in (tmp_path / "c").iterdir()} - {MANIFEST_NAME}
    assert doc["format_version"] == 1 and all(len(e["sha256"]) == 64 for e in doc["files"].values())
