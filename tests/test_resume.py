"""Resume: a streaming run killed (SIGKILL) at a random layer, rerun, equals an uninterrupted run."""
from __future__ import annotations

import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastawq.quantize.journal import WORK_DIR, Journal, ResumeError
from fastawq.quantize.stream import FAULT_ENV, quantize_streaming
from test_stream import QC, assert_same_tensors, calib, save_float_model

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 4


def _cli(src: Path, out: Path, calib_file: Path, *extra: str, fault: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = str(fault)
    cmd = [sys.executable, "-m", "fastawq", "quantize", str(src), str(out), "--stream", "--group-size", "32",
           "--calib", str(calib_file), "--max-calib-samples", "8", "--max-calib-seq-len", "32",
           "--shard-size", "30KB", "--device", "cpu", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    src = save_float_model(d / "src", layers=LAYERS)
    # The CLI calibrates on text: a character-level tokenizer within the tiny model's vocabulary.
    _save_tokenizer(src)
    text = d / "calib.txt"
    words = [" ".join(random.Random(i).choice("abcdefgh") * 3 for _ in range(60)) for i in range(20)]
    text.write_text("\n\n".join(words))
    ref = d / "ref"
    r = _cli(src, ref, text)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, src, text, ref


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>"] + [chr(ord("a") + j) for j in range(26)] + [" "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))


def test_killed_run_resumes_to_identical_checkpoint(job):
    d, src, text, ref = job
    out = d / "killed"
    kill_at = random.Random(os.getpid()).randrange(LAYERS)
    r = _cli(src, out, text, fault=kill_at)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    assert (out / WORK_DIR / "journal.json").exists()
    r = _cli(src, out, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert min(kill_at, 1) <= _layers_done(r.stderr) <= kill_at
    assert_same_tensors(ref, out)
    assert not (out / WORK_DIR).exists()


def _layers_done(log: str) -> int:
    """The resumed run's count of skipped layers. Checkpoints are taken after layer 0 and then as
    often as their writes hide behind the search (almost always every layer for this tiny model,
    but a slow fsync may skip one), so a kill at layer k resumes after 1..k layers."""
    m = re.search(r"(\d+) layer\(s\) already done", log)
    assert m, log[-2000:]
    return int(m.group(1))


def test_twice_killed_run_resumes(job):
    d, src, text, ref = job
    out = d / "killed2"
    assert _cli(src, out, text, fault=1).returncode == -signal.SIGKILL
    assert _cli(src, out, text, fault=2).returncode == -signal.SIGKILL
    r = _cli(src, out, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 1 <= _layers_done(r.stderr) <= 2
    assert_same_tensors(ref, out)


def test_changed_config_refuses_to_mix(job):
    d, src, text, ref = job
    out = d / "changed"
    assert _cli(src, out, text, fault=1).returncode == -signal.SIGKILL
    r = _cli(src, out, text, "--group-size", "64")
    assert r.returncode != 0
    assert "cannot be resumed" in r.stderr and "group_size changed" in r.stderr and "--no-resume" in r.stderr
    # The refused run left the partial work alone; --no-resume starts over and finishes.
    assert (out / WORK_DIR / "journal.json").exists()
    r = _cli(src, out, text, "--no-resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_tensors(ref, out)


def test_changed_source_or_calibration_refuses(tmp_path):
    src = save_float_model(tmp_path / "src", layers=2)
    ids = calib()
    out = tmp_path / "out"
    journal = Journal(out, {"source": {"config.json": {"size": 1}}, "calibration": {"sha256": "x"}})
    journal.start()
    with pytest.raises(ResumeError, match=r"source\.config\.json") as e:
        quantize_streaming(src, out, None, QC, ids, max_calib_seq_len=32)
    assert "calibration.sha256 changed" in str(e.value)
    # resume=False discards a foreign partial run instead of refusing it.
    out2 = tmp_path / "out2"
    Journal(out2, {}).start()
    quantize_streaming(src, out2, None, QC, ids, max_calib_seq_len=32, resume=False)
    assert not (out2 / WORK_DIR).exists() and (out2 / "model.safetensors").exists()


def test_shard_writer_appends_in_place_and_cuts_back_on_resume(tmp_path):
    from safetensors.torch import load_file

    from fastawq.quantize.journal import ShardWriter

    work = tmp_path / WORK_DIR
    work.mkdir()
    gen = torch.Generator().manual_seed(0)
    parts = [{f"p{i}.a": torch.randn(4, 5, generator=gen).half(), f"p{i}.q": torch.randint(0, 9, (3,), dtype=torch.int32),
              f"p{i}.s": torch.randn((), generator=gen).bfloat16()} for i in range(5)]
    w = ShardWriter(tmp_path, work, shard_size=100)
    for p in parts[:3]:
        w.add(p)
    committed = w.commit_state()
    w.add(parts[3])  # appended, never recorded: a kill here loses it
    w = ShardWriter(tmp_path, work, shard_size=100, state=committed)
    for p in parts[3:]:
        w.add(p)
    weight_map = w.finish()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(weight_map.values())) == files
    assert sorted(weight_map) == sorted(k for p in parts for k in p)
    for p in parts:
        for k, v in p.items():
            t = load_file(str(tmp_path / weight_map[k]))[k]
            assert t.dtype == v.dtype and torch.equal(t, v), k
    assert not list(work.glob("*.safetensors"))


_KILLED_CHILD = """
import sys, torch
from fastawq.quantize.stream import quantize_streaming
ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
quantize_streaming(sys.argv[1], sys.argv[2], None, {"q_group_size": 32}, ids, max_calib_seq_len=32,
                   checkpoint_every=int(sys.argv[3]), shard_size="30KB")
"""


def test_kill_between_checkpoints_redoes_the_layers_after_the_last_one(job):
    """With a checkpoint every 3 layers, a kill at layer 2 leaves layers 0-2 appended but only the
    start recorded: the resumed run cuts them off, redoes them and still equals an uninterrupted run."""
    d, src, _, _ = job
    ref = quantize_streaming(src, d / "ref_every", None, QC, calib(), max_calib_seq_len=32, shard_size="30KB")
    out = d / "every3"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **{FAULT_ENV: "2"})
    r = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(src), str(out), "3"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    state = json.loads((out / WORK_DIR / "journal.json").read_text())
    op = state["writer"]["open"]
    files = {p.name: p.stat().st_size for p in (out / WORK_DIR).glob("shard-*.safetensors")}
    counted = {sh["file"] for sh in state["writer"]["shards"]} | {op["file"]}
    # Layers 0-2 were appended (to the open shard or past it) but the journal counts the outer tensors only.
    assert state["layers_done"] == 0 and not state["writer"]["shards"], state
    assert set(files) - counted or files[op["file"]] > 8 + op["reserve"] + op["bytes"], (state, files)
    assert not any(".layers." in k for k in op["entries"]), op["entries"]
    env.pop(FAULT_ENV)
    r = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(src), str(out), "3"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_tensors(ref, out)
    assert not (out / WORK_DIR).exists()


def test_run_killed_while_finishing_the_folder_resumes(tmp_path, monkeypatch):
    """Every layer recorded, the shards already moved to their final names, then a crash before
    the config is written: the rerun has no activations to load and must only finish the folder
    (it raised ResumeError: the activations entering layer n were never saved)."""
    stream = importlib.import_module("fastawq.quantize.stream")  # fastawq.quantize is also a function name

    src = save_float_model(tmp_path / "src", layers=2)
    ids = calib()
    ref = quantize_streaming(src, tmp_path / "ref", None, QC, ids, max_calib_seq_len=32)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(stream, "_save_metadata", crash)
        with pytest.raises(KeyboardInterrupt):
            quantize_streaming(src, tmp_path / "out", None, QC, ids, max_calib_seq_len=32)
    assert json.loads((tmp_path / "out" / WORK_DIR / "journal.json").read_text())["layers_done"] == 2
    out = quantize_streaming(src, tmp_path / "out", None, QC, ids, max_calib_seq_len=32)
    assert_same_tensors(ref, out)
    assert (out / "config.json").exists() and not (out / WORK_DIR).exists()
