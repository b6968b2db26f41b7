"""Calibration data in every accepted form, offline."""
from __future__ import annotations

import json

import pytest
import torch

from fastawq.calib import get_calib_dataset
from fastawq.quantize import QuantConfig


class CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}


def test_default_is_offline_text():
    x = get_calib_dataset(None, CharTokenizer(), n_samples=4, max_seq_len=64)
    assert x.shape == (4, 64) and x.dtype == torch.long


def test_list_of_strings_and_eos_separators():
    x = get_calib_dataset(["ab" * 40, "cd" * 40], CharTokenizer(), n_samples=2, max_seq_len=50)
    assert x.shape == (2, 50) and (x == 0).any()


def test_token_id_lists_and_tensor():
    x = get_calib_dataset([[1, 2, 3] * 10, [4] * 40], None, n_samples=3, max_seq_len=20)
    assert x.shape == (3, 20) and x[0, :3].tolist() == [1, 2, 3]
    t = torch.arange(60).view(3, 20)
    assert torch.equal(get_calib_dataset(t, None, n_samples=3, max_seq_len=20), t)


def test_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("first paragraph " * 10 + "\n\n" + "second " * 20)
    assert get_calib_dataset(str(txt), CharTokenizer(), n_samples=2, max_seq_len=64).shape == (2, 64)
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"body": "line %d " % i * 20}) for i in range(5)))
    assert get_calib_dataset(jl, CharTokenizer(), n_samples=3, max_seq_len=64, text_column="body").shape == (3, 64)
    with pytest.raises(KeyError, match="text"):
        get_calib_dataset(jl, CharTokenizer(), n_samples=1, max_seq_len=8)


def test_too_little_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than one block"):
        get_calib_dataset(["tiny"], CharTokenizer(), n_samples=1, max_seq_len=512)
    with pytest.raises(TypeError, match="unsupported calibration data"):
        get_calib_dataset(42, CharTokenizer())


def test_datasets_dataset_when_installed():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["hello world " * 20] * 3})
    assert get_calib_dataset(ds, CharTokenizer(), n_samples=2, max_seq_len=100).shape == (2, 100)


def test_config_validation_and_group_size_errors():
    with pytest.raises(ValueError, match="w_bit"):
        QuantConfig(w_bit=5)
    with pytest.raises(ValueError, match="version"):
        QuantConfig(version="gemv")
    qc = QuantConfig(q_group_size=128)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*576"):
        qc.group_size_for("model.layers.0.self_attn.q_proj", 576)
    assert QuantConfig(q_group_size=128, fallback_group_size=64).group_size_for("x", 576) == 64
    assert QuantConfig.from_dict({"w_bit": 4, "q_group_size": 64, "zero_point": False, "version": "GEMM"}).q_group_size == 64
    assert QuantConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": 32}).to_hf()["group_size"] == 32
