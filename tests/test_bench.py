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


def _small_moe_shape(monkeypatch, layers: int = 4) -> str:
    cls_name, kw, _ = SHAPES["qwen3-30b-a3b"]
    small = dict(kw, vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                 num_experts_per_tok=2)
    monkeypatch.setitem(SHAPES, "moe-small", (cls_name, small, 64))
    return "moe-small"


def test_bench_moe_shape_with_fewer_layers_reports_measured_and_estimated(monkeypatch, capsys):
    """A random MoE shape through the fused engine, built with 2 of its 4 layers: the table labels
    the measured columns and adds full-depth estimates, which are slower than the measurement."""
    from fastawq.modules.fused import FusedMoE

    name = _small_moe_shape(monkeypatch)
    m = bench.build_model("fused", None, name, "cpu", 32, 1, dtype=torch.float32, num_layers=2)
    assert len(m.model.layers) == 2 and all(isinstance(f.mlp, FusedMoE) for f in m.model.layers)
    del m
    args = _parse(["bench", "--shape", name, "--mode", "fused", "--lengths", "8", "--max-seq-len", "32",
                   "--device", "cpu", "--layers", "2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for col in ("Decode tokens/s (2 layers, measured)", "Decode tokens/s (4 layers, estimated)",
                "Prefill tokens/s (4 layers, estimated)", "2 layers measured"):
        assert col in out, col
    rows = bench.bench(None, name, ["fused"], [8], 1, "cpu", max_seq_len=32, dtype=torch.float32, num_layers=2)
    r = rows[0]
    assert (r.layers, r.full_layers) == (2, 4)
    assert 0 < r.decode_tps_full < r.decode_tps and 0 < r.prefill_tps_full < r.prefill_tps


@pytest.mark.parametrize("mode,fused_batch", [("fused", 3), ("w4", None)])
def test_auto_layout_is_what_from_quantized_picks(monkeypatch, mode, fused_batch):
    """--layout auto (the default of `fastawq bench` and bench_e2e.py): the layout
    backend.preferred_layout gives for the device and, in the fused modes, the batch size, as
    from_quantized asks it; here forced to "packed", which every W4 layer then holds."""
    from fastawq import backend
    from fastawq.modules.qlinear import WQLinear

    asked = []

    def preferred(device, fused_batch=None):
        asked.append((device.type, fused_batch))
        return "packed"

    monkeypatch.setattr(backend, "preferred_layout", preferred)
    name = _small_moe_shape(monkeypatch)
    m = bench.build_model(mode, None, name, "cpu", 32, 3, dtype=torch.float32, layout="auto", num_layers=1)
    layers = [mod for mod in m.modules() if isinstance(mod, WQLinear)]
    assert asked == [("cpu", fused_batch)]
    assert layers and all(mod.layout == "packed" for mod in layers)
    assert _parse(["bench", "--shape", name]).layout == "auto"


def test_full_depth_scales_only_the_layers():
    # 10 ms measured with 8 layers, 2 ms of it the head: 2 + 8 * 48 / 8 = 50 ms at 48 layers.
    assert bench.full_depth(0.010, 0.002, 8, 48) == pytest.approx(0.050)
    assert bench.full_depth(0.001, 0.002, 8, 48) == pytest.approx(0.002)  # noise below the head


@pytest.mark.parametrize("compare", ["pdl", "route", "norm_route", "layout", "gemm16_staged", "gemm16_staged_early",
                                     "wgmma16"])
def test_bench_ab_alternates_one_switch(tmp_path, capsys, compare):
    # benchmarks/bench_ab.py on the tiny shape (CPU): both settings measured, the switches restored.
    import importlib.util
    import json
    import os
    import pathlib

    from fastawq import backend

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ab.py"
    spec = importlib.util.spec_from_file_location("bench_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    pdl_before, route_before = os.environ.get("FASTAWQ_PDL"), backend.ROUTE_FUSED
    envs = ("FASTAWQ_GEMM_STAGE_X", "FASTAWQ_GEMV_EARLY_LOADS")
    envs_before = {name: os.environ.get(name) for name in envs}
    assert ab.main(["--compare", compare, "--shape", "tiny", "--device", "cpu", "--prefill", "4", "--decode", "4",
                    "--max-seq-len", "32", "--out", str(tmp_path)]) == 0
    assert {name: os.environ.get(name) for name in envs} == envs_before
    rows = json.loads((tmp_path / f"ab_{compare}_tiny.json").read_text())["rows"]
    assert sorted(r["on"] for r in rows) == ["0", "1"] and all(r["decode_tps"] > 0 for r in rows)
    assert f"batch 1: {compare} on / off =" in capsys.readouterr().out
    assert backend.ROUTE_FUSED is route_before and os.environ.get("FASTAWQ_PDL") == pdl_before


def test_bench_ab_env_switch(tmp_path, capsys, monkeypatch):
    # --compare env:NAME=OFF,ON: each round sees its value, and the variable is restored after.
    import importlib.util
    import json
    import os
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ab.py"
    spec = importlib.util.spec_from_file_location("bench_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    monkeypatch.setenv("FASTAWQ_TEST_SWITCH", "before")
    seen = []
    real_round = ab.bench.run_round
    monkeypatch.setattr(ab.bench, "run_round",
                        lambda *a, **k: (seen.append(os.environ["FASTAWQ_TEST_SWITCH"]), real_round(*a, **k))[1])
    assert ab.main(["--compare", "env:FASTAWQ_TEST_SWITCH=a,b", "--shape", "tiny", "--device", "cpu", "--prefill",
                    "4", "--decode", "4", "--max-seq-len", "32", "--out", str(tmp_path)]) == 0
    assert seen == ["a", "b", "b", "a"] and os.environ["FASTAWQ_TEST_SWITCH"] == "before"
    rows = json.loads((tmp_path / "ab_env_FASTAWQ_TEST_SWITCH_a_b_tiny.json").read_text())["rows"]
    assert sorted(r["on"] for r in rows) == ["0", "1"] and all(r["decode_tps"] > 0 for r in rows)
    assert "batch 1: env:FASTAWQ_TEST_SWITCH=a,b on / off =" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ab.main(["--compare", "env:FASTAWQ_TEST_SWITCH=a", "--shape", "tiny", "--device", "cpu"])
    with pytest.raises(SystemExit):
        ab.main(["--compare", "nonsense", "--shape", "tiny", "--device", "cpu"])


def test_bench_ab_several_switches_on_one_model(tmp_path, capsys, monkeypatch):
    # --compare given twice: one model build, each switch A/B'd against the starting settings (the
    # other switch at its own), a table and a JSON file each, everything restored after.
    import importlib.util
    import json
    import os
    import pathlib

    from fastawq import backend

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ab.py"
    spec = importlib.util.spec_from_file_location("bench_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    monkeypatch.delenv("FASTAWQ_TEST_SWITCH", raising=False)
    builds, seen = [], []
    real_build, real_round = ab.bench.build_model, ab.bench.run_round
    monkeypatch.setattr(ab.bench, "build_model", lambda *a, **k: (builds.append(1), real_build(*a, **k))[1])
    monkeypatch.setattr(ab.bench, "run_round", lambda *a, **k: (
        seen.append((os.environ.get("FASTAWQ_TEST_SWITCH"), backend.ROUTE_FUSED)), real_round(*a, **k))[1])
    route_before = backend.ROUTE_FUSED
    assert ab.main(["--compare", "env:FASTAWQ_TEST_SWITCH=a,b", "--compare", "route", "--shape", "tiny", "--device",
                    "cpu", "--prefill", "4", "--decode", "4", "--max-seq-len", "32", "--out", str(tmp_path)]) == 0
    assert len(builds) == 1
    assert seen == [("a", route_before), ("b", route_before), ("b", route_before), ("a", route_before),
                    (None, False), (None, True), (None, True), (None, False)]
    assert backend.ROUTE_FUSED is route_before and "FASTAWQ_TEST_SWITCH" not in os.environ
    for tag in ("env_FASTAWQ_TEST_SWITCH_a_b", "route"):
        rows = json.loads((tmp_path / f"ab_{tag}_tiny.json").read_text())["rows"]
        assert sorted(r["on"] for r in rows) == ["0", "1"] and all(r["decode_tps"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "env:FASTAWQ_TEST_SWITCH=a,b on / off =" in out and "route on / off =" in out


def _profile_memory():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_memory.py"
    spec = importlib.util.spec_from_file_location("profile_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_memory_runs_every_phase_on_cpu(tmp_path):
    import json

    pm = _profile_memory()
    out = tmp_path / "m.json"
    assert pm.main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompt", "8", "--decode", "2",
                    "--max-seq-len", "32", "--layout", "packed", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["phase"] for r in res["phases"]][:4] == ["weights", "fused", "layout", "prefill 8"]
    kinds = res["model_tensors_mib"]
    # 2 layers x (K, V) x 32 positions x 2 KV heads x 32 dims, fp32 on the CPU
    assert kinds["KV cache"] * 2**20 == 2 * 2 * 32 * 2 * 32 * 4 and kinds["W4 weights"] > 0


def test_profile_memory_finds_the_peak_in_a_trace():
    pm = _profile_memory()
    ours = [{"filename": "/x/fastawq/modules/fused.py", "line": 9, "name": "prefill"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": []},           # a model tensor
             {"action": "alloc", "addr": 2, "size": 50, "frames": ours},
             {"action": "free_requested", "addr": 2, "size": 50},
             {"action": "alloc", "addr": 3, "size": 30, "frames": ours},          # the window's peak
             {"action": "alloc", "addr": 4, "size": 10, "frames": ours},
             {"action": "free_requested", "addr": 3, "size": 30}]
    p = pm.peak_in(trace, 3, len(trace), {1: ("lm_head", 100)}, top=1)
    assert p["peak_mib"] * 2**20 == 140 and p["trace_index"] == 4
    assert p["live"] == [{"what": "lm_head", "mib": 100 / 2**20, "count": 1, "largest_mib": 100 / 2**20}]
    assert p["rest_mib"] * 2**20 == 40
    assert pm.peak_in(trace, 0, 3, {}, top=5)["peak_mib"] * 2**20 == 150
    # Phase ends are the marker allocations (the first one fell off the trace's ring buffer).
    phases = pm.Phases(torch.device("cpu"))
    phases.rows = [{"phase": "a"}, {"phase": "b"}]
    mark = {"action": "alloc", "frames": [{"filename": "/b/profile_memory.py", "line": 1, "name": "_marker"}]}
    assert phases.ends(trace + [mark]) == [None, len(trace)]


def test_bench_route_table():
    # benchmarks/bench_route.py prints its rows as a markdown table (the numbers RESULTS.md takes).
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_route.py"
    spec = importlib.util.spec_from_file_location("bench_route", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.table([{"shape": "qwen3-30b-a3b", "T": 1, "cuda route": 5.456, "triton route": 6.42},
                      {"shape": "mixtral-8x7b", "T": 16, "cuda route": 2.96, "triton route": 2.82}])
    assert text.splitlines() == [
        "| router, tokens | cuda route | triton route |",
        "|---|---|---|",
        "| qwen3-30b-a3b, 1 | 5.46 | 6.42 |",
        "| mixtral-8x7b, 16 | 2.96 | 2.82 |",
    ]


def test_ncu_stalls_summarizes_a_source_page(tmp_path, capsys):
    # benchmarks/ncu_stalls.py reads ncu's source page (SASS, CSV: a kernel line, then the header) and
    # ranks the instructions and opcodes by their share of the stall samples.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_stalls.py"
    spec = importlib.util.spec_from_file_location("ncu_stalls", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    csv_text = "\n".join([
        '"Kernel Name","awq_wgmma_packed_kernel<__half, 16, 6, 1, 4>"',
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"0x100","LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64] ;","10","8"',
        '"0x110","@!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;","1,200","1,100"',
        '"0x120","HGMMA.64x16x16.F32 R24, R88, gdesc[UR8], R24 ;","30","20"',
        '"0x130","WARPGROUP.DEPBAR.LE gsb0, 0x1 ;","600","590"',
        '"0x140","HGMMA.64x16x16.F32 R24, R92, gdesc[UR12], R24 ;","160","150"',
    ])
    f = tmp_path / "r.sass.csv"
    f.write_text(csv_text)
    mod.main([str(f), "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "5 instructions, 2000 samples (Warp Stall Sampling (All Samples))"
    assert out[3] == "| 0x110 | 60.0 % | `@!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;` |"
    assert out[4].startswith("| 0x130 | 30.0 % |") and out[5].startswith("| 0x140 | 8.0 % |")
    assert "| BAR.SYNC | 60.0 % |" in out and "| HGMMA.64x16x16 | 9.5 % |" in out
    assert mod.opcode("@P1 LDGSTS.E.BYPASS.128 [R3] ;") == "LDGSTS.E"
    two = tmp_path / "two.csv"
    two.write_text(csv_text + "\n" + csv_text.replace("16, 6, 1, 4", "32, 6, 1, 4"))
    mod.main([str(two), "--top", "1"])
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("###")] == [
        '### "Kernel Name","awq_wgmma_packed_kernel<__half, 16, 6, 1, 4>"',
        '### "Kernel Name","awq_wgmma_packed_kernel<__half, 32, 6, 1, 4>"']
    assert out.count("5 instructions, 2000 samples (Warp Stall Sampling (All Samples))") == 2
    bad = tmp_path / "bad.csv"
    bad.write_text('"a","b"\n"1","2"\n')
    with pytest.raises(SystemExit, match="no header"):
        mod.main([str(bad)])
    # With the source counters' memory columns: totals, the excess share, the worst instructions.
    mem = tmp_path / "mem.csv"
    mem.write_text("\n".join([
        '"Kernel Name","k"',
        '"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared",'
        '"L1 Wavefronts Shared Excessive","L2 Theoretical Sectors Global","L2 Theoretical Sectors Global Excessive"',
        '"0x100","LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64] ;","10","3,200","2,800","3,200","1,600"',
        '"0x110","LDS.128 R4, [R2] ;","5","400","0","0","0"',
        '"0x120","STS [R5], R8 ;","5","400","200","0","0"',
    ]))
    mod.main([str(mem), "--top", "2"])
    out = capsys.readouterr().out.splitlines()
    assert "shared wavefronts: 4000, 3000 excess (75 %)" in out
    assert "L2 sectors (global): 3200, 1600 excess (50 %)" in out
    at = out.index("| shared wavefronts: excess | total | SASS |")
    assert out[at + 2] == "| 2800 | 3200 | `LDGSTS.E.BYPASS.128 [R3], desc[UR4][R10.64] ;` |"
    assert out[at + 3] == "| 200 | 400 | `STS [R5], R8 ;` |"
    assert all("LDS.128" not in line for line in out[at:])
