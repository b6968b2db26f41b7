"""What the compiled extension will be built with: torch, the CUDA toolkit, the arch list.

Two decisions: whether fastawq._C is built at all (`build`: torch is importable and kernels are
not switched off; _C then always holds the CPU kernels of csrc/cpu/) and whether it also holds
the CUDA kernels (`cuda`: torch is a CUDA build and nvcc exists).

Used only by the build: CMakeLists.txt runs it as a script (``--cmake OUT``) to get the torch
paths and the resolved toolchain, and torch_pin.py imports it to decide whether the wheel pins
torch. One decision, two readers: they cannot disagree about whether kernels are built.

Environment:
  FASTAWQ_BUILD_KERNELS  auto (default) | on | cpu | off. ``on`` turns a missing CUDA toolchain
                         into an error; ``auto`` then builds the CPU kernels only; ``cpu`` builds
                         the CPU kernels only even where CUDA is there; ``off`` builds no _C.
  FASTAWQ_CUDA_ARCHS     e.g. "8.0;9.0a". Default: the visible GPU's arch, else DEFAULT_ARCHS.
  CUDA_HOME / CUDA_PATH  where the toolkit lives, when nvcc on PATH is not the one to use.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

# Ampere, Ada, Hopper (with its arch-specific wgmma features). nvcc 13 dropped sm_50..sm_70.
DEFAULT_ARCHS = ("8.0", "8.6", "8.9", "9.0a")
_EXEC_RE = re.compile(r"exec\s+\"?([^\s\"]+/nvcc)\b")


def build_mode() -> str:
    mode = os.environ.get("FASTAWQ_BUILD_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "cpu", "off"):
        raise SystemExit(f"FASTAWQ_BUILD_KERNELS={mode!r}: expected auto, on, cpu or off")
    return mode


def _real_nvcc(path: Path) -> Path:
    """Follow symlinks and `exec .../nvcc "$@"` wrapper scripts to the compiler binary."""
    for _ in range(4):
        path = path.resolve()
        try:
            head = path.read_bytes()[:4096]
        except OSError:
            return path
        if head.startswith(b"\x7fELF"):
            return path
        m = _EXEC_RE.search(head.decode("utf-8", "replace"))
        if not m:
            return path
        path = Path(m.group(1))
    return path


def find_nvcc() -> Path | None:
    candidates = []
    for var in ("CUDACXX",):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in candidates:
        if c.exists():
            real = _real_nvcc(c)
            if real.exists():
                return real
    return None


def _torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    return torch


def _nvrtc_library(torch_dir: Path) -> str | None:
    """torch's CUDA wheels ship nvrtc under site-packages/nvidia/*/lib; a bare toolkit may not."""
    site = torch_dir.parent
    for pattern in ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
        hits = sorted(p for p in site.glob(pattern) if "builtins" not in p.name and ".alt." not in p.name)
        if hits:
            return str(hits[0])
    return None


def _extra_includes(torch_dir: Path, cuda_root: Path) -> list[str]:
    """ATen's CUDA headers include cuSPARSE/cuBLAS headers; a bare toolkit may lack them, and
    torch's nvidia wheels ship them. Searched after the toolkit's own headers."""
    if (cuda_root / "include" / "cusparse.h").exists():
        return []
    site = torch_dir.parent
    return [str(p.parent) for p in sorted(site.glob("nvidia/*/include/cusparse.h"))[:1]]


def default_archs(torch) -> list[str]:
    try:
        if torch is not None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return [f"{major}.{minor}{'a' if major >= 9 else ''}"]
    except Exception:  # noqa: BLE001 - a broken driver must not break the build
        pass
    return list(DEFAULT_ARCHS)


def parse_archs(text: str) -> list[str]:
    archs = [a.strip() for a in re.split(r"[;, ]+", text) if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d+\.\d+[af]?", a):
            raise SystemExit(f"FASTAWQ_CUDA_ARCHS: {a!r} is not an arch like 8.0 or 9.0a")
    return archs


def probe() -> dict:
    """Everything the build needs to know, plus `build` and `cuda` (bool) and, when they are
    False, `reason` and `cuda_reason`."""
    mode = build_mode()
    info: dict = {"mode": mode, "build": False, "reason": "", "cuda": False, "cuda_reason": ""}
    if mode == "off":
        info["reason"] = info["cuda_reason"] = "FASTAWQ_BUILD_KERNELS=off"
        return info
    torch = _torch()
    if torch is None:
        info["reason"] = info["cuda_reason"] = (
            "torch is not importable in the build environment (use --no-build-isolation)")
        return info
    torch_dir = Path(torch.__file__).parent
    info.update(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda or "",
        torch_dir=str(torch_dir),
        cxx11_abi=int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))),
        build=True,
        archs=[],
    )
    if mode == "cpu":
        info["cuda_reason"] = "FASTAWQ_BUILD_KERNELS=cpu"
        return info
    if not torch.version.cuda:
        info["cuda_reason"] = f"torch {torch.__version__} is not a CUDA build"
        return info
    nvcc = find_nvcc()
    if nvcc is None:
        info["cuda_reason"] = "no CUDA compiler (nvcc) found; set CUDA_HOME or CUDACXX"
        return info
    env_archs = os.environ.get("FASTAWQ_CUDA_ARCHS", "").strip()
    info.update(
        nvcc=str(nvcc),
        cuda_root=str(nvcc.parent.parent),
        nvrtc=_nvrtc_library(torch_dir) or "",
        extra_includes=_extra_includes(torch_dir, nvcc.parent.parent),
        archs=parse_archs(env_archs) if env_archs else default_archs(torch),
        cuda=True,
    )
    return info


def _cmake_list(values) -> str:
    return ";".join(str(v) for v in values)


def write_cmake(info: dict, out: Path) -> None:
    lines = [f'set(FASTAWQ_BUILD {"ON" if info["build"] else "OFF"})',
             f'set(FASTAWQ_WITH_CUDA {"ON" if info["cuda"] else "OFF"})',
             f'set(FASTAWQ_MODE "{info["mode"]}")',
             f'set(FASTAWQ_SKIP_REASON "{info["reason"]}")',
             f'set(FASTAWQ_CUDA_SKIP_REASON "{info["cuda_reason"]}")',
             f'set(FASTAWQ_ARCHS "{_cmake_list(info.get("archs", []))}")']
    if info["build"]:
        lines += [
            f'set(FASTAWQ_TORCH_VERSION "{info["torch_version"]}")',
            f'set(FASTAWQ_TORCH_DIR "{info["torch_dir"]}")',
            f'set(FASTAWQ_CXX11_ABI {info["cxx11_abi"]})',
        ]
    if info["cuda"]:
        lines += [
            f'set(FASTAWQ_NVCC "{info["nvcc"]}")',
            f'set(FASTAWQ_CUDA_ROOT "{info["cuda_root"]}")',
            f'set(FASTAWQ_NVRTC "{info["nvrtc"]}")',
            f'set(FASTAWQ_EXTRA_INCLUDES "{_cmake_list(info["extra_includes"])}")',
        ]
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--cmake":
        write_cmake(probe(), Path(sys.argv[2]))
    else:
        json.dump(probe(), sys.stdout, indent=2)
        print()
