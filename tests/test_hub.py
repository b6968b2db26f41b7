"""Hub ids through a hand-built Hugging Face cache: offline resolution, fast clear errors, and
strings that look like paths never reaching the Hub."""
from __future__ import annotations

import time

import pytest
import torch

from fastawq import hub
from fastawq.auto import AutoAWQForCausalLM, AWQModel
from fastawq.quantize import QuantConfig, pack_model
from test_models import calib_ids, tiny_model

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF_HOME whose hub cache is what snapshot_download reads, offline."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home / "hub"


def _cache_repo(cache, repo_id: str, files: dict[str, bytes] | None = None, rev: str = REV):
    """Lay out a cached snapshot as huggingface_hub does: models--org--name/{refs/main, snapshots/<rev>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for name, data in (files or {"config.json": b"{}"}).items():
        (snap / name).write_bytes(data)
    return snap


def test_resolves_cached_id_offline(hf_cache):
    snap = _cache_repo(hf_cache, "org/name")
    assert hub.resolve("org/name") == snap
    assert hub.resolve("org/name", revision=REV) == snap


def test_missing_id_offline_is_fast_and_names_id_and_cache(hf_cache):
    _cache_repo(hf_cache, "org/other")
    t = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        hub.resolve("org/missing")
    assert time.perf_counter() - t < 5  # no network attempt: HF_HUB_OFFLINE is honoured
    msg = str(e.value)
    assert "org/missing" in msg and str(hf_cache) in msg and "HF_HUB_OFFLINE" in msg


@pytest.mark.parametrize("name", ["./missing", "../missing", "/no/such/dir", "~/no-such-model", "a/b/c", "org name/x"])
def test_path_like_strings_never_reach_the_hub(hf_cache, monkeypatch, name):
    monkeypatch.setattr(hub, "_download", lambda *a, **k: pytest.fail(f"{name!r} went to the Hub"))
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        hub.resolve(name)


def test_existing_local_folder_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.setattr(hub, "_download", lambda *a, **k: pytest.fail("a local folder went to the Hub"))
    assert hub.resolve("org/name") == (tmp_path / "org" / "name").relative_to(tmp_path)
    assert hub.resolve(tmp_path) == tmp_path


def test_from_quantized_and_from_pretrained_take_hub_ids(hf_cache, tmp_path):
    model = tiny_model("llama")
    ids = calib_ids(1, 10)
    float_dir = _cache_repo(hf_cache, "org/float", {})
    model.save_pretrained(float_dir)
    with torch.no_grad():
        loaded = AutoAWQForCausalLM.from_pretrained("org/float", torch_dtype=torch.float32)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    qc = QuantConfig(q_group_size=32)
    pack_model(model, qc)
    quant_dir = _cache_repo(hf_cache, "org/awq", {})
    AWQModel(model, qc).save_quantized(quant_dir, overwrite=True)
    with torch.no_grad():
        q = AutoAWQForCausalLM.from_quantized("org/awq", device_map="cpu", torch_dtype=torch.float32)
        torch.testing.assert_close(q(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)
    with pytest.raises(FileNotFoundError, match="org/nothing"):
        AutoAWQForCausalLM.from_quantized("org/nothing", device_map="cpu")
