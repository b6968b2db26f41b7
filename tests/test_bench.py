"""`fastawq bench` smoke tests on the tiny random shape (CPU), and random-shape construction."""
import argparse

import pytest
import torch

from fastawq.commands import bench
from fastawq.modules.qlinear import WQLinear
from fastawq.shapes import SHAPES, build_random_model, shape_config


def _parse(argv):
    p = argparse.ArgumentParser()
    bench.add_parser(p.add_subparsers())
    return p.parse_args(argv)


def test_bench_smoke_prints_the_table(capsys, tmp_path):
    args = _parse(["bench", "--shape", "tiny", "--mode", "w4,fused", "--lengths", "8",
                   "--max-seq-len", "32", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for col in ("Batch Size", "Prefill Length", "Decode Length", "Prefill tokens/s", "Decode tokens/s", "Memory (VRAM)"):
        assert col in out
    assert out.count("| fused |") == 1 and out.count("| w4 |") == 1
    assert (tmp_path / "r.json").exists()


def test_bench_marks_oom_and_goes_on(monkeypatch):
    from fastawq.generate import FusedStepper

    calls = {"n": 0}
    real = FusedStepper.prefill

    def flaky(self, ids):
        calls["n"] += 1
        if ids.shape[1] == 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(self, ids)

    monkeypatch.setattr(FusedStepper, "prefill", flaky)
    rows = bench.bench(None, "tiny", ["fused"], [16, 8], 1, "cpu", max_seq_len=32)
    assert [r.note for r in rows] == ["OOM", ""]
    assert rows[1].decode_tps > 0
    rows = bench.bench(None, "tiny", ["fused"], [32], 1, "cpu", max_seq_len=32)
    assert rows[0].note == "exceeds cache"
    assert "OOM" in bench.format_table([bench.Row("fused", 1, 16, 16, note="OOM")])


def test_lengths_double_from_32():
    assert bench.lengths_for(4096, None) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert bench.lengths_for(4096, 3) == [32, 64, 128]
    assert bench.lengths_for(100, None) == [32, 64]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_named_shapes_are_valid_w4_layouts(name):
    cfg = shape_config(name)
    g = SHAPES[name][2]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for k in (cfg.hidden_size, cfg.intermediate_size):
        assert k % g == 0
    assert (cfg.num_attention_heads * head_dim) % 8 == 0 and (cfg.num_key_value_heads * head_dim) % 8 == 0


def test_random_w4_model_is_packed_and_finite():
    model = build_random_model("tiny", device="cpu")
    lin = model.model.layers[0].mlp.down_proj
    assert isinstance(lin, WQLinear) and lin.qweight.dtype == torch.int32
    nibbles = torch.stack([(lin.qweight >> (4 * i)) & 15 for i in range(8)])
    assert nibbles.unique().numel() == 16  # random over every nibble, not zeros
    with torch.inference_mode():
        logits = model(torch.randint(0, 512, (1, 12))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0
