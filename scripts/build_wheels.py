"""Build fastawq wheels, one per (torch, CUDA), plus a CPU-kernels wheel and an sdist.

    python scripts/build_wheels.py [--out dist] [--cpu] [--sdist] [TORCH+CUDA ...]
    python scripts/build_wheels.py --cpu --sdist 2.14.1+cu130 2.9.1+cu128

Each TORCH+CUDA builds fastawq._C (CUDA and CPU kernels) against exactly that torch, in a build
venv under ~/.cache/fastawq/wheel-envs/ (torch from --torch-index, default the PyTorch index for
that CUDA), or in the running Python when its torch is already that build. `--cpu` builds the
CPU kernels only (FASTAWQ_BUILD_KERNELS=cpu) against the running Python's torch.

The wheel's version gets a local label naming its torch and CUDA, e.g.
`fastawq-0.1.0+torch2.14.1.cu130-cp311-cp311-linux_x86_64.whl` (`.cpu` for the CPU-kernels wheel),
and its metadata requires exactly that torch (setup_helpers/torch_pin.py, the build's own pin).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = Path(os.environ.get("FASTAWQ_CACHE", Path.home() / ".cache" / "fastawq")) / "wheel-envs"
BUILD_DEPS = ["scikit-build-core>=0.10", "cmake>=3.26", "ninja", "numpy"]


def sh(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def torch_of(python: str) -> tuple[str, str] | None:
    """(version, "cuXYZ" or "cpu") of the torch importable by `python`, or None."""
    code = "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda or '']))"
    res = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    version, cuda = json.loads(res.stdout.strip().splitlines()[-1])
    return version.split("+")[0], ("cu" + cuda.replace(".", "")) if cuda else "cpu"


def build_python(torch_version: str, cuda: str, index: str) -> str:
    """A Python whose torch is exactly torch_version built for `cuda`."""
    if torch_of(sys.executable) == (torch_version, cuda):
        return sys.executable
    env = ENVS / f"torch{torch_version}.{cuda}"
    py = str(env / "bin" / "python")
    if torch_of(py) != (torch_version, cuda):
        sh([sys.executable, "-m", "venv", str(env)])
        sh([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        sh([py, "-m", "pip", "install", "-q", f"torch=={torch_version}", "--index-url", index.format(cuda=cuda)])
        sh([py, "-m", "pip", "install", "-q", *BUILD_DEPS])
        got = torch_of(py)
        if got != (torch_version, cuda):
            raise SystemExit(f"{env}: wanted torch {torch_version} for {cuda}, got {got}")
    return py


def build_wheel(python: str, out: Path, kernels: str, label: str, archs: str | None) -> Path:
    """Run scikit-build-core's PEP 517 hook in `python`; the build folder persists per label, so a
    rebuild compiles only what changed."""
    tmp = out / f".tmp-{label}"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FASTAWQ_BUILD_KERNELS=kernels)
    if archs:
        env["FASTAWQ_CUDA_ARCHS"] = archs
    code = (
        "import sys; from scikit_build_core.build import build_wheel; "
        f"print(build_wheel(sys.argv[1], {{'build-dir': 'build/wheel-{label}-{{wheel_tag}}'}}))"
    )
    sh([python, "-c", code, str(tmp)], cwd=ROOT, env=env)
    (built,) = sorted(tmp.glob("*.whl"))
    final = relabel(built, label, out)
    built.unlink()
    tmp.rmdir()
    return final


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def relabel(wheel: Path, label: str, out: Path) -> Path:
    """Copy `wheel` with version V -> V+label (dist-info folder, METADATA and RECORD rewritten)."""
    name, version, rest = wheel.name.split("-", 2)
    new_version = f"{version}+{label}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    target = out / f"{name}-{new_version}-{rest}"
    with zipfile.ZipFile(wheel) as src:
        entries = [(i, src.read(i.filename)) for i in src.infolist()]
    files = []
    for info, data in entries:
        fname = info.filename.replace(old_info, new_info, 1) if info.filename.startswith(old_info) else info.filename
        if fname == new_info + "METADATA":
            data = re.sub(rb"(?m)^Version: .*$", f"Version: {new_version}".encode(), data, count=1)
        files.append((info, fname, data))
    record = new_info + "RECORD"
    lines = [f"{f},{_record_hash(d)},{len(d)}" for _, f, d in files if f != record] + [f"{record},,"]
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info, fname, data in files:
            zi = zipfile.ZipInfo(fname, date_time=info.date_time)
            zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            dst.writestr(zi, ("\n".join(lines) + "\n").encode() if fname == record else data)
    return target


def check_wheel(wheel: Path, torch_version: str, with_c: bool) -> None:
    """The wheel holds the shipped data and, with _C, requires exactly the torch it was built with."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    problems = []
    if "fastawq/data_files/calib_default.jsonl.gz" not in names:
        problems.append("no fastawq/data_files/calib_default.jsonl.gz")
    has_c = any(re.match(r"fastawq/_C\..*\.so$", n) for n in names)
    if has_c != with_c:
        problems.append(f"_C present: {has_c}, expected {with_c}")
    if with_c and f"Requires-Dist: torch=={torch_version}" not in meta:
        problems.append(f"METADATA does not pin torch=={torch_version}")
    if problems:
        raise SystemExit(f"{wheel.name}: " + "; ".join(problems))
    print(f"ok {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB; torch=={torch_version} pinned: {with_c})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("combos", nargs="*", metavar="TORCH+CUDA", help="e.g. 2.14.1+cu130")
    ap.add_argument("--out", type=Path, default=ROOT / "dist")
    ap.add_argument("--cpu", action="store_true", help="a CPU-kernels wheel against the running Python's torch")
    ap.add_argument("--sdist", action="store_true")
    ap.add_argument("--cuda-archs", default=None, help="FASTAWQ_CUDA_ARCHS for the CUDA wheels (default: the build's)")
    ap.add_argument("--torch-index", default="https://download.pytorch.org/whl/{cuda}")
    args = ap.parse_args()
    if not (args.combos or args.cpu or args.sdist):
        ap.error("nothing to build: give TORCH+CUDA pairs, --cpu and/or --sdist")
    args.out.mkdir(parents=True, exist_ok=True)
    combos = []
    for c in args.combos:
        m = re.fullmatch(r"(\d+\.\d+\.\d+)\+(cu\d{3,})", c)
        if not m:
            raise SystemExit(f"{c!r}: expected TORCH+CUDA like 2.14.1+cu130")
        combos.append(m.groups())
    for torch_version, cuda in combos:
        py = build_python(torch_version, cuda, args.torch_index)
        wheel = build_wheel(py, args.out, "on", f"torch{torch_version}.{cuda}", args.cuda_archs)
        check_wheel(wheel, torch_version, with_c=True)
    if args.cpu:
        got = torch_of(sys.executable)
        if got is None:
            raise SystemExit(f"--cpu builds against the running Python's torch; {sys.executable} has none")
        wheel = build_wheel(sys.executable, args.out, "cpu", f"torch{got[0]}.cpu", None)
        check_wheel(wheel, got[0], with_c=True)
    if args.sdist:
        code = "import sys; from scikit_build_core.build import build_sdist; print(build_sdist(sys.argv[1]))"
        sh([sys.executable, "-c", code, str(args.out)], cwd=ROOT, env=dict(os.environ, FASTAWQ_BUILD_KERNELS="off"))
    for p in sorted(args.out.iterdir()):
        if p.is_file():
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
