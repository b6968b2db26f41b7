"""Load-time checks of every tensor (dtype, shape, finiteness, where it is stored), what a save
refuses before touching the disk, and a really full disk."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastawq.auto import AWQModel, AutoAWQForCausalLM
from fastawq.checkpoint import CheckpointError, load_quantized, write_manifest
from fastawq.modules import WQLinear
from fastawq.quantize import QuantConfig
from relhelp import assert_intact, debris, snapshot

L = "model.layers.1.mlp.down_proj"  # [128 -> 64], group 32


def _edit(d: Path, fn) -> None:
    """Rewrite model.safetensors through fn(state_dict) and re-sign the folder, so that only
    the tensor checks (not the manifest) can object."""
    sd = load_file(d / "model.safetensors")
    fn(sd)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "fastawq_manifest.json").unlink()
    write_manifest(d)


def _set(key, value):
    def fn(sd):
        sd[key] = value(sd[key]) if callable(value) else value
    return fn


def _nan_at(key, v=float("nan")):
    def fn(sd):
        t = sd[key].clone()
        t.view(-1)[3] = v
        sd[key] = t
    return fn


TENSOR_CASES = {
    "qweight-int64": (_set(f"{L}.qweight", lambda t: t.long()), f"{L}.qweight"),
    "qweight-float": (_set(f"{L}.qweight", lambda t: t.float()), f"{L}.qweight"),
    "qzeros-fp16": (_set(f"{L}.qzeros", lambda t: t.half()), f"{L}.qzeros"),
    "scales-int32": (_set(f"{L}.scales", lambda t: t.int()), f"{L}.scales"),
    "qweight-shape": (_set(f"{L}.qweight", lambda t: t[:, :4].contiguous()), f"{L}.qweight"),
    "scales-groups": (_set(f"{L}.scales", lambda t: t.repeat(2, 1)), "group size 16"),
    "qzeros-shape": (_set(f"{L}.qzeros", lambda t: t.repeat(2, 1)), f"{L}.qzeros"),
    "scales-nan": (_nan_at(f"{L}.scales"), f"{L}.scales"),
    "scales-inf": (_nan_at(f"{L}.scales", float("inf")), f"{L}.scales"),
    "embed-nan": (_nan_at("model.embed_tokens.weight"), "model.embed_tokens.weight"),
    "norm-int": (_set("model.norm.weight", lambda t: t.int()), "model.norm.weight"),
    "no-qzeros": (lambda sd: sd.pop(f"{L}.qzeros"), f"{L}.qzeros"),
    "no-scales": (lambda sd: sd.pop(f"{L}.scales"), f"{L}.scales"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_bad_tensor_is_named_at_load(copy_of, case):
    fn, needle = TENSOR_CASES[case]
    d = copy_of("one")
    _edit(d, fn)
    with pytest.raises(CheckpointError) as e:
        load_quantized(d)
    assert needle in str(e.value) and ("model.safetensors" in str(e.value) or "group" in needle)


def _shards(d):
    return sorted(d.glob("model-*.safetensors"))


def test_tensor_in_two_shards_is_refused(copy_of):
    d = copy_of("sharded")
    a, b = _shards(d)[:2]
    sa, sb = load_file(a), load_file(b)
    k = next(iter(sa))
    sb[k] = sa[k]
    save_file(sb, b, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stored in both"):
        load_quantized(d, verify="off")


@pytest.mark.parametrize("edit", ["wrong-shard", "absent", "unlisted", "outside"])
def test_index_weight_map_is_honoured(copy_of, edit):
    d = copy_of("sharded")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    k = sorted(wm)[0]
    names = sorted(set(wm.values()))
    if edit == "wrong-shard":
        wm[k] = next(n for n in names if n != wm[k])
    elif edit == "absent":
        wm["model.layers.9.ghost"] = names[0]
    elif edit == "unlisted":
        del wm[k]
    else:
        wm[k] = "../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="index"):
        load_quantized(d, verify="off")


def test_stray_shard_does_not_belong(copy_of):
    d = copy_of("one")
    shutil.copy(d / "model.safetensors", d / "model-extra.safetensors")
    with pytest.raises(CheckpointError, match="model-extra.safetensors is not in fastawq_manifest.json"):
        load_quantized(d)


def test_newer_manifest_format_refused(copy_of):
    d = copy_of("one")
    m = d / "fastawq_manifest.json"
    doc = json.loads(m.read_text())
    doc["format_version"] = 99
    m.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="newer"):
        load_quantized(d)


@pytest.mark.parametrize("mode", ["full", "size", "off"])
def test_verify_env_and_argument(copy_of, monkeypatch, mode):
    d = copy_of("one")
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 1  # a data bit: only the hash sees it
    (d / "model.safetensors").write_bytes(bytes(raw))
    monkeypatch.setenv("FASTAWQ_VERIFY", mode)
    if mode == "full":
        with pytest.raises(CheckpointError, match="sha256"):
            load_quantized(d)
    else:
        load_quantized(d)
    with pytest.raises(CheckpointError, match="sha256"):
        load_quantized(d, verify="full")
    with pytest.raises(ValueError, match="verify must be"):
        load_quantized(d, verify="fast")


# ---------------------------------------------------------------- what a save refuses
def _refusals(packed):
    float_model = AWQModel(type(packed.model)(packed.model.config), packed.quant_config)
    nan = AWQModel(__import__("copy").deepcopy(packed.model), packed.quant_config)
    next(m for m in nan.model.modules() if isinstance(m, WQLinear)).scales[0, 0] = float("nan")
    w3 = AWQModel(packed.model, QuantConfig(w_bit=3, q_group_size=32))
    return {
        "shard-size-word": (packed, dict(shard_size="lots"), ValueError, "shard size"),
        "shard-size-zero": (packed, dict(shard_size=0), ValueError, "positive"),
        "shard-size-negative": (packed, dict(shard_size="-5MB"), ValueError, "shard size"),
        "shard-size-bool": (packed, dict(shard_size=True), ValueError, "shard_size"),
        "float-model": (float_model, {}, ValueError, "no packed layers"),
        "three-bit": (w3, {}, ValueError, "w_bit=3"),
        "nan-scales": (nan, {}, ValueError, "NaN"),
    }


@pytest.mark.parametrize("case", ["shard-size-word", "shard-size-zero", "shard-size-negative", "shard-size-bool",
                                  "float-model", "three-bit", "nan-scales"])
def test_refused_save_keeps_old_checkpoint(packed, copy_of, tmp_path, case):
    model, kw, exc, match = _refusals(packed)[case]
    target = copy_of("old")
    snap = snapshot(target)
    with pytest.raises(exc, match=match):
        model.save_quantized(target, overwrite=True, **kw)
    assert_intact(target, snap)
    assert debris(tmp_path) == []


def test_overwrite_replaces_checkpoint_files_keeps_users(packed, copy_of, tmp_path, ids):
    target = copy_of("old")
    (target / "tokenizer.json").write_text("{}")  # an old tokenizer must not pair with new weights
    (target / "notes.txt").write_text("mine")
    (target / "runs").mkdir()
    (target / "runs" / "log.txt").write_text("mine too")
    packed.save_quantized(target, overwrite=True)
    names = {p.name for p in target.iterdir()}
    assert "tokenizer.json" not in names and not any(n.startswith("model-") for n in names)
    assert (target / "notes.txt").read_text() == "mine" and (target / "runs" / "log.txt").read_text() == "mine too"
    loaded = AutoAWQForCausalLM.from_quantized(target, device_map="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)


def test_non_empty_without_overwrite_and_file_target(packed, copy_of, tmp_path):
    target = copy_of("old")
    snap = snapshot(target)
    with pytest.raises(FileExistsError, match="not empty"):
        packed.save_quantized(target)
    assert_intact(target, snap)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError):
        packed.save_quantized(tmp_path / "afile", overwrite=True)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_refuses_to_save_over_its_source(copy_of, where):
    src = copy_of("one", "src/ckpt")
    snap = snapshot(src)
    model = AutoAWQForCausalLM.from_quantized(src, device_map="cpu")
    target = {"same": src, "inside": src / "awq", "parent": src.parent}[where]
    with pytest.raises(ValueError, match="loaded from"):
        model.save_quantized(target, overwrite=True)
    assert_intact(src, snap)


# ---------------------------------------------------------------- a real full disk
@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_keeps_old_checkpoint(packed, saved, small_disk):
    target = small_disk / "ckpt"
    shutil.copytree(saved["old"], target)
    snap = snapshot(target)
    with pytest.raises(OSError) as e:
        packed.save_quantized(target, shard_size="20KB", overwrite=True)
    assert "No space" in str(e.value) or e.value.errno == 28
    assert_intact(target, snap)
    assert debris(small_disk) == []
    # With the old one gone, the same save fits.
    shutil.rmtree(target)
    packed.save_quantized(target, shard_size="20KB")
    assert load_quantized(target)[0] is not None
