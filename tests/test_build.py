"""The build's torch pin and the loader's fallback. CPU-only, no compiled code needed."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "setup_helpers"))

import build_env  # noqa: E402


@pytest.fixture
def fake_build(monkeypatch):
    """Point fastawq._ext at a fake _build_info and a fake _C import; returns the list of modules
    the loader tried to import."""
    from fastawq import _ext

    imported: list[str] = []

    def install(build_info: types.SimpleNamespace | None, c_error: Exception | None):
        def import_module(name):
            imported.append(name)
            if c_error is not None:
                raise c_error
            return types.SimpleNamespace()

        monkeypatch.setattr(_ext, "_build_info", lambda: build_info)
        monkeypatch.setattr(_ext.importlib, "import_module", import_module)
        _ext._load.cache_clear()
        return _ext

    yield install, imported
    _ext._load.cache_clear()


def _load_twice(ext):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = ext.is_loaded()
        ext.is_loaded()
    return loaded, [str(w.message) for w in caught]


def test_mismatched_torch_warns_once_and_falls_back(fake_build):
    install, imported = fake_build
    # A mismatched _C must never be opened: that is where "undefined symbol" crashes come from.
    ext = install(types.SimpleNamespace(TORCH_VERSION="1.0.0+fake", CUDA_ARCHS=["9.0a"]),
                  ImportError("undefined symbol: _ZN3c10fake"))
    loaded, msgs = _load_twice(ext)
    assert loaded is False and len(msgs) == 1 and imported == []
    assert "1.0.0+fake" in msgs[0] and torch.__version__ in msgs[0] and "pip install" in msgs[0]
    assert ext.status()["built_torch"] == "1.0.0+fake" and ext.status()["loaded"] is False
    assert not ext.supports_device(torch.device("cuda", 0))


def test_failing_extension_warns_and_falls_back(fake_build):
    install, imported = fake_build
    ext = install(types.SimpleNamespace(TORCH_VERSION=torch.__version__, CUDA_ARCHS=["8.0"]),
                  OSError("libcudart.so.13: cannot open shared object file"))
    loaded, msgs = _load_twice(ext)
    assert loaded is False and len(msgs) == 1 and imported == ["fastawq._C"]
    assert "libcudart" in msgs[0] and torch.__version__ in msgs[0] and "rebuild" in msgs[0]


def test_cpu_only_build_loads_without_archs(fake_build):
    # A _C built without CUDA (CPU kernels only) records CUDA_ARCHS = "".split(";") == [""].
    install, imported = fake_build
    ext = install(types.SimpleNamespace(TORCH_VERSION=torch.__version__, CUDA_ARCHS=[""]), None)
    loaded, msgs = _load_twice(ext)
    assert loaded is True and msgs == [] and imported == ["fastawq._C"]
    assert ext.built_archs() == [] and ext.status()["archs"] == []
    assert not ext.supports_device(torch.device("cpu"))


def test_no_kernels_is_silent(fake_build):
    install, _ = fake_build
    ext = install(None, None)
    loaded, msgs = _load_twice(ext)
    assert loaded is False and msgs == []
    assert "without compiled kernels" in ext.status()["reason"]


def test_matching_build_loads(fake_build):
    install, imported = fake_build
    ext = install(types.SimpleNamespace(TORCH_VERSION=torch.__version__, CUDA_ARCHS=["8.0", "9.0a"]), None)
    loaded, msgs = _load_twice(ext)
    assert loaded is True and msgs == [] and imported == ["fastawq._C"]
    assert ext.built_archs() == ["8.0", "9.0a"]


@pytest.mark.parametrize(
    "arch, cap, runs",
    [("8.0", (8, 0), True), ("8.0", (8, 6), True), ("8.6", (8, 0), False), ("9.0a", (9, 0), True),
     ("9.0a", (10, 0), False), ("8.0", (9, 0), False), ("10.0f", (10, 0), True)],
)
def test_arch_compatibility(arch, cap, runs):
    from fastawq import _ext

    assert _ext._arch_runs_on(arch, *cap) is runs


def test_build_env_modes(monkeypatch):
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "off")
    info = build_env.probe()
    assert info["build"] is False and "off" in info["reason"]
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "sometimes")
    with pytest.raises(SystemExit, match="auto, on, cpu or off"):
        build_env.probe()


def test_build_env_cpu_only(monkeypatch):
    # Without a CUDA toolchain (or with FASTAWQ_BUILD_KERNELS=cpu) _C still holds the CPU kernels.
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "auto")
    monkeypatch.setattr(build_env, "find_nvcc", lambda: None)
    # A CUDA build of torch without nvcc, then a CPU build of torch (whatever torch is installed).
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    info = build_env.probe()
    assert info["build"] is True and info["cuda"] is False and "nvcc" in info["cuda_reason"]
    assert info["torch_version"] == torch.__version__ and info["archs"] == []
    monkeypatch.setattr(torch.version, "cuda", None)
    info = build_env.probe()
    assert info["build"] is True and info["cuda"] is False and "not a CUDA build" in info["cuda_reason"]
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "cpu")
    info = build_env.probe()
    assert info["build"] is True and info["cuda"] is False and "cpu" in info["cuda_reason"]


def test_cmake_probe_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "cpu")
    out = tmp_path / "probe.cmake"
    build_env.write_cmake(build_env.probe(), out)
    text = out.read_text()
    assert "set(FASTAWQ_BUILD ON)" in text and "set(FASTAWQ_WITH_CUDA OFF)" in text
    assert 'set(FASTAWQ_ARCHS "")' in text and "FASTAWQ_NVCC" not in text


def test_build_env_archs(monkeypatch):
    assert build_env.parse_archs("8.0;9.0a, 8.6") == ["8.0", "9.0a", "8.6"]
    with pytest.raises(SystemExit, match="sm_90"):
        build_env.parse_archs("sm_90")


def test_nvcc_wrapper_is_resolved(tmp_path):
    real = tmp_path / "cuda" / "bin" / "nvcc"
    real.parent.mkdir(parents=True)
    real.write_bytes(b"\x7fELF fake compiler")
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    assert build_env._real_nvcc(wrapper) == real.resolve()


def test_torch_pin_matches_build_decision(monkeypatch):
    torch_pin = importlib.import_module("torch_pin")
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "off")
    assert torch_pin.dynamic_metadata("dependencies", {}) == []
    monkeypatch.setenv("FASTAWQ_BUILD_KERNELS", "auto")
    info = build_env.probe()
    expected = [f"torch=={info['torch_version'].split('+')[0]}"] if info["build"] else []
    assert torch_pin.dynamic_metadata("dependencies", {}) == expected
    base = ["torch>=2.4", "numpy"]
    pinned = [f"torch=={info['torch_version'].split('+')[0]}", "numpy"] if info["build"] else base
    assert torch_pin.dynamic_metadata("dependencies", {"base": base}) == pinned


@pytest.mark.skipif(not importlib.util.find_spec("fastawq._C"), reason="fastawq._C is not built")
def test_cuda_op_set():
    # Runs on CPU wherever _C is built with CUDA (CI compiles it): the kernels are chosen by name,
    # and the fit rules are callable without a GPU.
    from fastawq import _ext

    if not _ext.has_op("awq_gemm"):
        pytest.skip(f"fastawq._C has no CUDA ops: {_ext.status()['reason'] or 'CPU-only build'}")
    for op in ("awq_gemm_declines", "awq_dequantize", "decode_attention", "decode_attention_out", "rope_decode_attention"):
        assert _ext.has_op(op), op
    for gone in ("awq_gemm_config", "awq_repack_tiled", "awq_gemm_tiled"):
        assert not _ext.has_op(gone), gone
    schema = str(torch.ops.fastawq.awq_gemm.default._schema)
    assert 'str kernel="auto"' in schema, schema
    assert torch.ops.fastawq.awq_gemm_declines("gemv_staged", 2, 4096, 4096, 128) == ""
    assert "M <= 2" in torch.ops.fastawq.awq_gemm_declines("gemv", 16, 4096, 4096, 128)
