"""Strict quant config parsing: every key type-checked, no string coerced to a bool or a list,
unknown keys named, AutoAWQ's and transformers' own keys accepted quietly."""
from __future__ import annotations

import logging

import pytest

from fastawq.quantize import QuantConfig

BAD = [
    ("zero_point", "false"), ("zero_point", "true"), ("zero_point", 1), ("zero_point", None),
    ("modules_to_not_convert", "mlp"), ("modules_to_not_convert", ""), ("modules_to_not_convert", [""]),
    ("modules_to_not_convert", ["mlp", 3]), ("modules_to_not_convert", {"mlp": 1}), ("modules_to_not_convert", b"mlp"),
    ("w_bit", "4"), ("w_bit", 4.0), ("w_bit", True), ("w_bit", 5), ("w_bit", 0), ("bits", "4"),
    ("q_group_size", "128"), ("q_group_size", 0), ("q_group_size", -2), ("q_group_size", 12.5), ("q_group_size", False),
    ("group_size", None), ("fallback_group_size", "32"), ("fallback_group_size", 0), ("fallback_group_size", True),
    ("version", "gemv"), ("version", "exllama"), ("version", 1), ("version", None),
    ("quant_method", "gptq"), ("quant_method", None),
]


@pytest.mark.parametrize(("key", "value"), BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_bad_value_is_refused_naming_the_key(key, value):
    name = {"bits": "w_bit", "group_size": "q_group_size", "quant_method": "quant_method"}.get(key, key)
    with pytest.raises(ValueError, match=name):
        QuantConfig.from_dict({key: value})


@pytest.mark.parametrize("value", [["mlp"], ("mlp", "lm_head"), None, []])
def test_modules_to_not_convert_accepts_lists(value):
    assert QuantConfig.from_dict({"modules_to_not_convert": value}).modules_to_not_convert == (
        None if value is None else list(value))


@pytest.mark.parametrize("version", ["gemm", "GEMM", "Gemm"])
def test_version_spellings(version):
    assert QuantConfig.from_dict({"version": version}).version == "gemm"


def test_aliases_and_conflicts():
    qc = QuantConfig.from_dict({"bits": 4, "group_size": 64, "w_bit": 4})
    assert (qc.w_bit, qc.q_group_size) == (4, 64)
    with pytest.raises(ValueError, match="q_group_size twice"):
        QuantConfig.from_dict({"group_size": 64, "q_group_size": 128})


@pytest.mark.parametrize("value", ["w_bit=4", ["w_bit", 4], 4])
def test_non_mapping_config_is_refused(value):
    with pytest.raises(TypeError, match="quant_config must be a dict"):
        QuantConfig.from_dict(value)


def test_unknown_key_warned_known_foreign_keys_quiet(caplog):
    with caplog.at_level(logging.WARNING):
        QuantConfig.from_dict({"bits": 4, "zero_pont": False})
    assert "zero_pont" in caplog.text
    caplog.clear()
    hf = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
          "backend": "autoawq", "do_fuse": False, "fuse_max_seq_len": None, "modules_to_fuse": None,
          "modules_to_not_convert": None, "exllama_config": None}
    with caplog.at_level(logging.WARNING):
        assert QuantConfig.from_dict(hf).q_group_size == 128
    assert caplog.text == ""


def test_from_dict_of_a_config_is_identity():
    qc = QuantConfig(q_group_size=32)
    assert QuantConfig.from_dict(qc) is qc
