"""quantize(): a model is float or fully quantized; bad arguments fail before any layer is
searched; Ctrl-C or a kill mid-run never yields a half-packed model that saves or loads."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.checkpoint import save_quantized
from fastawq.modules import WQLinear
from fastawq.quantize import AwqQuantizer, QuantConfig
from relhelp import assert_intact, run_forked, snapshot
from test_models import VOCAB, calib_ids, tiny_model

QC = {"q_group_size": 32}


def _awq(model=None) -> AWQModel:
    m = AWQModel(model if model is not None else tiny_model("llama"))
    m.model.fastawq_state = "float"
    return m


class _StopAtLayer(AwqQuantizer):
    """Interrupts the search of decoder layer `stop` (after the earlier layers are packed)."""

    stop = 1
    how = "int"

    def search_best_scale(self, layer, name, *args, **kwargs):
        if name.endswith(f".{self.stop}"):
            if self.how == "int":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGKILL)
        return super().search_best_scale(layer, name, *args, **kwargs)


def _quantize(m: AWQModel, **kw):
    kw = {"quant_config": QC, "calib_data": calib_ids(2, 16), "max_calib_samples": 2, "max_calib_seq_len": 16} | kw
    m.quantize(None, **kw)


def test_interrupted_quantize_is_partial_and_refused(tmp_path):
    m = _awq()
    with pytest.raises(KeyboardInterrupt):
        _quantize(m, quantizer_cls=_StopAtLayer)
    assert m.model.fastawq_state == "partial"
    assert isinstance(m.model.model.layers[0].mlp.down_proj, WQLinear)  # half-packed indeed
    with pytest.raises(ValueError, match="partially quantized"):
        m.save_quantized(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(RuntimeError, match="interrupted"):
        _quantize(m)
    with pytest.raises(RuntimeError, match="partially"):
        m.pack()
    # Without the state flag (a model quantized by hand), the layer scan still sees it.
    del m.model.fastawq_state
    with pytest.raises(ValueError, match="partially quantized"):
        save_quantized(m.model, tmp_path / "out", m.quant_config)


@pytest.mark.parametrize("how", ["kill", "int"])
def test_killed_quantize_keeps_the_output_folder(saved, tmp_path, how):
    """A process quantizing (to later save over an old checkpoint) is stopped in layer 1."""
    target = tmp_path / "out"
    import shutil

    shutil.copytree(saved["old"], target)
    snap = snapshot(target)

    def job():
        m = _awq()
        _StopAtLayer.how = how
        try:
            _quantize(m, quantizer_cls=_StopAtLayer)
        except KeyboardInterrupt:
            assert m.model.fastawq_state == "partial"
            try:
                m.save_quantized(target, overwrite=True)
            except ValueError:
                raise KeyboardInterrupt from None
            raise SystemExit(9)  # saved a partial model: the test fails on the exit code
        m.save_quantized(target, overwrite=True)

    res = run_forked(job, {}, timeout=300)
    assert res == (("signal", signal.SIGKILL) if how == "kill" else ("exit", 3))
    assert_intact(target, snap)


def test_quantize_twice_is_a_clear_error(saved):
    loaded = AutoAWQForCausalLM.from_quantized(saved["one"], device_map="cpu")
    with pytest.raises(RuntimeError, match="already quantized"):
        _quantize(loaded)


def _bad_calib():
    return {
        "float-tensor": (torch.rand(2, 16), "integer token ids"),
        "1d-tensor": (torch.arange(16), "integer token ids"),
        "empty-tensor": (torch.zeros(0, 16, dtype=torch.long), "non-empty"),
        "id-too-big": (torch.full((2, 16), VOCAB), f"token id {VOCAB}"),
        "id-negative": (torch.full((2, 16), -1), "token id -1"),
        "empty-list": ([], "empty list"),
        "blank-strings": (["", "  "], "only empty strings"),
        "text-no-tokenizer": (["some text"], "needs a tokenizer"),
        "default-no-tokenizer": (None, "needs a tokenizer"),
        "mixed-list": ([[1, 2, 3], "text"], r"calib_data\[1\]"),
        "list-id-too-big": ([[1, 2, 999]], "999"),
        "list-bool": ([[1, True]], "True"),
        "missing-file": ("./no/such/calib.txt", "does not exist"),
        "missing-path": (Path("no-such-calib.jsonl"), "does not exist"),
    }


@pytest.mark.parametrize("case", list(_bad_calib()))
def test_bad_calibration_fails_before_work(case):
    data, match = _bad_calib()[case]
    m = _awq()
    t = time.perf_counter()
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        _quantize(m, calib_data=data)
    assert time.perf_counter() - t < 5.0
    assert m.model.fastawq_state == "float" and not any(isinstance(x, WQLinear) for x in m.model.modules())


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_calib_samples": 0}, "max_calib_samples"),
    ({"max_calib_seq_len": -1}, "max_calib_seq_len"),
    ({"max_calib_samples": "8"}, "max_calib_samples"),
    ({"quant_config": {"q_group_size": 32, "modules_to_not_convert": ["layers"]}}, "excludes every linear"),
    ({"quant_config": {"q_group_size": 32, "modules_to_not_convert": "mlp"}}, "modules_to_not_convert"),
    ({"quant_config": {"q_group_size": 32, "zero_point": "false"}}, "zero_point"),
    ({"quant_config": {"q_group_size": 48}}, "not divisible by group_size=48"),
    ({"quant_config": {"q_group_size": 32, "w_bit": 4.0}}, "w_bit"),
    ({"quant_config": "w_bit=4"}, "quant_config must be a dict"),
    ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "tpu"}, "device"),
])
def test_bad_arguments_fail_before_work(kw, match):
    m = _awq()
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        _quantize(m, **kw)
    assert m.model.fastawq_state == "float"


def test_unpackable_layer_named_before_work():
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(64, 128, bias=False)  # not a decoder layer: never quantized
    layer = model.model.layers[0].mlp
    layer.down_proj = torch.nn.Linear(128, 60, bias=False)
    layer.down_proj.out_features = 60
    m = _awq(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: out_features=60"):
        _quantize(m)


def test_fp32_weights_that_overflow_fp16_scales():
    """fp16 scales of inf gave NaN logits: refused before work, naming the layer."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = 1e6
    m = _awq(model)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj"):
        _quantize(m)
