"""Session fixtures of the reliability suite: one tiny quantized model, built once, and the
checkpoints saved from it; tests copy them."""
from __future__ import annotations

import copy
import shutil
import signal

import pytest
import torch

from fastawq.auto import AWQModel
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig, quantize
from test_models import calib_ids, tiny_model


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal: a shell starts background jobs (CI steps
    among them) with SIGINT ignored, and Python then keeps it ignored."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


@pytest.fixture(scope="session")
def packed() -> AWQModel:
    model = tiny_model("llama")
    qc = QuantConfig(q_group_size=32)
    quantize(model, None, qc, calib=calib_ids(2, 16), max_calib_samples=2, max_calib_seq_len=16)
    model.fastawq_state = "quantized"
    return AWQModel(model, qc)


@pytest.fixture(scope="session")
def other(packed) -> AWQModel:
    """A second, different packed model: the checkpoint a failed save must not lose."""
    m = copy.deepcopy(packed.model)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, WQLinear):
                mod.scales.mul_(1.25)
    return AWQModel(m, packed.quant_config)


@pytest.fixture(scope="session")
def saved(packed, other, tmp_path_factory):
    """name -> folder: 'one' (one shard), 'sharded' (four shards), 'old' (the other model)."""
    root = tmp_path_factory.mktemp("ckpts")
    packed.save_quantized(root / "one")
    packed.save_quantized(root / "sharded", shard_size="20KB")
    other.save_quantized(root / "old", shard_size="20KB")
    return {"one": root / "one", "sharded": root / "sharded", "old": root / "old"}


@pytest.fixture
def copy_of(saved, tmp_path):
    def make(name: str, dest_name: str = "ckpt"):
        dest = tmp_path / dest_name
        shutil.rmtree(dest, ignore_errors=True)  # hypothesis runs one test function many times
        shutil.copytree(saved[name], dest)
        return dest

    return make


@pytest.fixture(scope="session")
def ids() -> torch.Tensor:
    return calib_ids(1, 8, seed=5)


@pytest.fixture(scope="session")
def float_dir(tmp_path_factory):
    """A float model folder, as from_pretrained reads it (no tokenizer)."""
    d = tmp_path_factory.mktemp("float") / "tiny-llama"
    tiny_model("llama").save_pretrained(d)
    return d
