"""from_quantized(device_map=..., max_memory=..., offload_folder=...) through accelerate's dispatch:
generation equals the single-device model (CPU + disk offload here; GPUs on the GPU machine)."""
from __future__ import annotations

import pytest
import torch

from fastawq.auto import AutoAWQForCausalLM
from fastawq.modules import WQLinear
from test_stream import QC, calib, in_memory, save_float_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("dmap")
    src = save_float_model(d / "src", layers=3, tie=False)
    return in_memory(src, d / "q", calib())


def _generate(model) -> torch.Tensor:
    return model.generate(calib(2, 10, seed=9), max_new_tokens=8, do_sample=False)


def test_layers_split_over_cpu_and_disk_generate_like_one_device(checkpoint, tmp_path):
    ref = _generate(AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map="cpu", fuse_layers=False))
    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    m = AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map=dmap, offload_folder=str(tmp_path / "off"))
    layer1 = m.model.model.layers[1]
    assert isinstance(layer1.self_attn.q_proj, WQLinear)
    assert layer1.self_attn.q_proj.qweight.device.type == "meta"  # held on disk, loaded per call
    assert any((tmp_path / "off").iterdir())
    assert torch.equal(_generate(m), ref)


def test_auto_map_with_a_memory_budget_offloads(checkpoint, tmp_path):
    ref = _generate(AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map="cpu", fuse_layers=False))
    m = AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map="sequential", max_memory={"cpu": "80KB"},
                                          offload_folder=str(tmp_path / "off"))
    devices = {str(v) for v in m.model.hf_device_map.values()}
    assert "disk" in devices and "cpu" in devices, m.model.hf_device_map
    assert torch.equal(_generate(m), ref)


def test_bad_device_maps_are_named(checkpoint):
    with pytest.raises(ValueError, match="offload_folder"):
        AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map={"model": "cpu", "lm_head": "disk"})
    with pytest.raises(ValueError, match="does not have"):
        AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map={"model.nope": "cpu", "lm_head": "disk"},
                                          offload_folder="x")
    with pytest.raises(ValueError, match="fuse_layers"):
        AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map={"model": "cpu", "lm_head": "disk"},
                                          offload_folder="x", fuse_layers=True)
    with pytest.raises(ValueError, match="layout='packed' needs the whole model on one device"):
        AutoAWQForCausalLM.from_quantized(str(checkpoint), device_map={"model": "cpu", "lm_head": "disk"},
                                          offload_folder="x", layout="packed")
