"""Streaming quantization (one layer in memory) against the in-memory quantize() + save_quantized()."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from fastawq.auto import AutoAWQForCausalLM
from fastawq.quantize.journal import WORK_DIR
from fastawq.quantize.stream import quantize_streaming

ROOT = Path(__file__).resolve().parents[1]
QC = {"q_group_size": 32}


def save_float_model(path: Path, layers: int = 3, hidden: int = 64, inter: int = 128, dtype=torch.float16,
                     tie: bool = True, shard: str = "40KB", seed: int = 0) -> Path:
    """A tiny random Llama saved as several safetensors shards (norms perturbed away from 1)."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(str(path), max_shard_size=shard)
    return path


def calib(n: int = 8, seq: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(seed))


def load_all(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_all(a), load_all(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def in_memory(src: Path, out: Path, ids: torch.Tensor) -> Path:
    m = AutoAWQForCausalLM.from_pretrained(str(src))
    m.quantize(None, quant_config=QC, calib_data=ids, max_calib_seq_len=ids.shape[1])
    m.save_quantized(str(out))
    return out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    src = save_float_model(d / "src")
    ids = calib()
    return src, ids, in_memory(src, d / "ref", ids)


@pytest.mark.parametrize("tie", [True, False])
def test_streaming_is_bit_identical_to_in_memory(tmp_path, tie):
    src = save_float_model(tmp_path / "src", tie=tie)
    assert len(list(src.glob("*.safetensors"))) > 1
    ids = calib()
    ref = in_memory(src, tmp_path / "ref", ids)
    out = quantize_streaming(src, tmp_path / "out", None, QC, ids, max_calib_seq_len=32, shard_size="30KB")
    assert_same_tensors(ref, out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(load_all(out))
    assert not (out / WORK_DIR).exists()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32


def test_streamed_checkpoint_loads_and_generates_like_in_memory(reference_run, tmp_path):
    src, ids, ref = reference_run
    out = quantize_streaming(src, tmp_path / "out", None, QC, ids, max_calib_seq_len=32)
    assert (out / "model.safetensors").exists()  # below the shard size: one file, no index
    x = calib(1, 12, seed=7)
    a = AutoAWQForCausalLM.from_quantized(str(ref), device_map="cpu", fuse_layers=False)
    b = AutoAWQForCausalLM.from_quantized(str(out), device_map="cpu", fuse_layers=False)
    ga = a.generate(x, max_new_tokens=6, do_sample=False)
    gb = b.generate(x, max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, gb)


def test_streaming_refuses_non_empty_output_and_quantized_source(reference_run, tmp_path):
    src, ids, ref = reference_run
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_streaming(src, tmp_path / "busy", None, QC, ids, max_calib_seq_len=32)
    with pytest.raises(ValueError, match="quantization_config"):
        quantize_streaming(ref, tmp_path / "o2", None, QC, ids, max_calib_seq_len=32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        quantize_streaming(tmp_path / "busy", tmp_path / "o3", None, QC, ids, max_calib_seq_len=32)


_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from fastawq.quantize.awq import AwqQuantizer
    from fastawq.quantize.stream import quantize_streaming

    class Small(AwqQuantizer):
        # Memory, not search quality, is under test: a 2-point grid keeps the CPU time small.
        n_grid = 2
        cpu_batch_elems = 1 << 18

    def run(src, out):
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
        quantize_streaming(src, out, None, {"q_group_size": 128}, ids, max_calib_seq_len=16,
                           apply_clip=False, quantizer_cls=Small, shard_size="4MB")

    # A one-layer run first: imports, thread pools and kernel caches are not the streaming's cost.
    run(sys.argv[1], sys.argv[3] + "-warm")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run(sys.argv[2], sys.argv[3])
    print(json.dumps({"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def test_streaming_peak_rss_stays_below_the_model_size(tmp_path):
    """Layers of 16 MB each, 20 of them in fp32 (300 MB): streaming must never hold the model."""
    kw = dict(hidden=512, inter=2048, dtype=torch.float32, shard="64MB")
    warm = save_float_model(tmp_path / "warm", layers=1, **kw)
    src = save_float_model(tmp_path / "src", layers=20, **kw)
    model_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(warm), str(src), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    delta = m["peak"] - m["before"]
    layer_bytes = model_bytes / 20
    # Measured on the CPU machine: 0 bytes, the 20-layer run peaks no higher than the 1-layer warm-up.
    assert delta < model_bytes / 2, (delta / 2**20, model_bytes / 2**20)
    assert delta < 8 * layer_bytes, (delta / 2**20, layer_bytes / 2**20)


def test_prefetch_on_and_off_are_bit_identical(reference_run, tmp_path):
    """The next layer read in a background thread (and the layer output written by another) must
    change nothing: same tensors as with both inline and as the in-memory run."""
    src, ids, ref = reference_run
    on = quantize_streaming(src, tmp_path / "on", None, QC, ids, max_calib_seq_len=32, prefetch=True)
    off = quantize_streaming(src, tmp_path / "off", None, QC, ids, max_calib_seq_len=32, prefetch=False,
                             checkpoint_every=2)
    assert_same_tensors(ref, on)
    assert_same_tensors(ref, off)


def test_source_reader_reads_every_dtype_and_names_a_truncated_file(tmp_path):
    from safetensors.torch import save_file

    from fastawq.quantize.source import SourceCheckpoint

    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(5, 7, generator=gen).half(), "b": torch.randn(3, generator=gen).bfloat16(),
               "c": torch.randint(-9, 9, (2, 2, 2), generator=gen, dtype=torch.int32),
               "d": torch.randn((), generator=gen), "e": torch.empty(0, 4)}
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, str(tmp_path / "m.safetensors"))
    src = SourceCheckpoint(tmp_path)
    for k, v in tensors.items():
        got = src.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"m\.safetensors.*truncated"):
        SourceCheckpoint(tmp_path).get("a")


def test_unknown_search_option_is_named(reference_run, tmp_path):
    src, ids, _ = reference_run
    with pytest.raises(TypeError, match="max_calib_tokens"):
        quantize_streaming(src, tmp_path / "o", None, QC, ids, max_calib_tokens=32)


def test_gpu_budget_keeps_8b_activations_on_the_device():
    """Llama-3-8B under max_memory cuda 6 GiB: 128 x 512 fp16 activations (0.5 GiB, inputs and
    outputs of a layer at once) fit beside a 0.41 GiB layer, so they must not travel to the CPU
    and back every layer; the candidate batch shrinks by what they hold. No GPU is touched."""
    from types import SimpleNamespace

    from fastawq.quantize.stream import _apply_max_memory

    act, layer = 128 * 512 * 4096 * 2, 436_207_616
    q = SimpleNamespace(device=torch.device("cuda", 0), gpu_batch_elems=1 << 28, offload=False)
    _apply_max_memory(q, {"cuda:0": "6GiB", "cpu": "6GiB"}, act, layer)
    assert not q.offload
    assert q.gpu_batch_elems == (6 * 2**30 - 3 * layer - 2 * act) // 24
    q = SimpleNamespace(device=torch.device("cuda", 0), gpu_batch_elems=1 << 28, offload=False)
    _apply_max_memory(q, {0: "3GiB"}, act, layer)
    assert q.offload and q.gpu_batch_elems == (3 * 2**30 - 3 * layer) // 24
