"""Crash-safe folders: a folder written beside its target and swapped in by one rename, a content
manifest (sizes and sha256) written last and checked on read, and fault points that let tests stop
a write at any step. Standard library only: any writer of a folder can use it."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

MANIFEST_NAME = "fastawq_manifest.json"
FORMAT_VERSION = 1
VERIFY_MODES = ("full", "size", "off")
INDEX_NAME = "model.safetensors.index.json"
# What a save writes or replaces. Anything else in a folder overwritten with overwrite=True (notes,
# a README, .git) belongs to the user and is carried into the new folder.
CHECKPOINT_FILES = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json", "config.json",
    "generation_config.json", MANIFEST_NAME, "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab.*", "merges.txt", "spiece.model", "*.tiktoken", "chat_template.*", "preprocessor_config.json",
)


class CheckpointError(ValueError):
    pass


# ---------------------------------------------------------------- fault injection (tests)
def fault_point(step: str) -> None:
    """FASTAWQ_FAULT_AT=<step> stops a save at that step, the way a crash would:
    FASTAWQ_FAULT_ACTION = kill (SIGKILL, default) | int (SIGINT) | enospc (a full disk) | raise."""
    if os.environ.get("FASTAWQ_FAULT_AT") != step:
        return
    action = os.environ.get("FASTAWQ_FAULT_ACTION", "kill")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "int":
        signal.raise_signal(signal.SIGINT)
        return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {step})")
    raise RuntimeError(f"injected fault at {step}")


# ---------------------------------------------------------------- atomic folders
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(d: Path) -> None:
    for root, dirs, files in os.walk(d):
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                _fsync(Path(root, f))
        _fsync(Path(root))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if sys.platform != "linux":
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _siblings(target: Path, kind: str) -> list[Path]:
    return sorted(target.parent.glob(f".{_glob_escape(target.name)}.fastawq-{kind}-*"), key=lambda p: p.stat().st_mtime)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def recover(target: Path) -> bool:
    """A save killed between its two renames (where one-step exchange is unsupported) leaves the
    old checkpoint beside the missing target: put it back."""
    if target.exists() or not target.parent.is_dir():
        return False
    backups = _siblings(target, "old")
    if not backups:
        return False
    os.rename(backups[-1], target)
    log.warning("%s: restored the checkpoint an interrupted save had moved aside", target)
    return True


def _carry_user_files(old: Path, new: Path) -> None:
    for p in old.iterdir():
        if any(fnmatch.fnmatch(p.name, pat) for pat in CHECKPOINT_FILES) or (new / p.name).exists():
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(p), str(new / p.name))


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)  # same file system by construction: no bytes copied
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target` to write a checkpoint into. When the block
    ends, the user's own files of an old `target` are carried over, everything is fsynced and the
    folder replaces `target` in one rename. On any error, Ctrl-C included, `target` is untouched
    and the temporary folder removed; a kill leaves at most a hidden `.NAME.fastawq-tmp-*` folder,
    which the next save to `target` removes."""
    target = Path(target).expanduser().absolute()
    recover(target)
    if target.exists():
        if not target.is_dir():
            raise NotADirectoryError(f"{target} is a file, not a folder")
        if any(target.iterdir()) and not overwrite:
            raise FileExistsError(f"{target} is not empty; pass overwrite=True to replace its checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Leftovers of killed saves: unfinished folders, and old checkpoints already replaced.
    for stale in _siblings(target, "tmp") + (_siblings(target, "old") if target.exists() else []):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.fastawq-tmp-", dir=target.parent))
    try:
        fault_point("save:tmpdir")
        yield tmp
        if target.is_dir():
            _carry_user_files(target, tmp)
        fault_point("save:carry")
        _fsync_tree(tmp)
        fault_point("save:swap")
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        _fsync(target.parent)
        fault_point("save:swapped")
        return
    if _exchange(tmp, target):
        _fsync(target.parent)
        fault_point("save:swapped")
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint now
        return
    backup = tmp.with_name(tmp.name.replace("-tmp-", "-old-"))
    os.rename(target, backup)
    try:
        fault_point("save:between-renames")
        os.rename(tmp, target)
    except BaseException:
        os.rename(backup, target)
        raise
    _fsync(target.parent)
    try:
        fault_point("save:swapped")
    finally:
        shutil.rmtree(backup, ignore_errors=True)


# ---------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large blocks: shards hash in parallel.
    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(d: Path) -> None:
    """Every file of `d` (but the manifest) with its size and sha256; written last by a save."""
    paths = [p for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST_NAME]
    digests = _sha256_all(paths)
    files = {p.relative_to(d).as_posix(): {"size": p.stat().st_size, "sha256": h} for p, h in zip(paths, digests)}
    doc = {"format": "fastawq-checkpoint", "format_version": FORMAT_VERSION, "files": files}
    (d / MANIFEST_NAME).write_text(json.dumps(doc, indent=1))


def verify_mode(verify: str | None) -> str:
    mode = verify if verify is not None else os.environ.get("FASTAWQ_VERIFY", "full")
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES} (or FASTAWQ_VERIFY), got {mode!r}")
    return mode


def verify_checkpoint(d: Path, verify: str | None = None) -> dict | None:
    """Check `d` against its manifest: sizes always, sha256 unless verify="size"; "off" skips.
    A folder without a manifest (AutoAWQ's, transformers') is loaded unchecked."""
    mode = verify_mode(verify)
    mpath = d / MANIFEST_NAME
    if not mpath.exists():
        log.debug("%s has no %s (not written by fastawq): its files are not checked", d, MANIFEST_NAME)
        return None
    if mode == "off":
        return None
    try:
        doc = json.loads(mpath.read_text())
        version, files = doc["format_version"], doc["files"]
        if doc["format"] != "fastawq-checkpoint" or not isinstance(version, int) or version < 1:
            raise TypeError(f"format {doc['format']!r} version {version!r} is not a fastawq manifest")
        if not isinstance(files, dict):
            raise TypeError("files must be an object")
        entries = [(str(n), int(e["size"]), str(e["sha256"])) for n, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} is damaged ({type(e).__name__}: {e}); the checkpoint cannot be trusted") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format version {version} is newer than this fastawq reads ({FORMAT_VERSION})")
    for name, size, digest in entries:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{mpath} lists {name!r}, which is outside the checkpoint folder")
        p = d / name
        if not p.is_file():
            raise CheckpointError(f"{p} is missing, but {MANIFEST_NAME} lists it: the checkpoint is incomplete")
        actual = p.stat().st_size
        if actual != size:
            raise CheckpointError(f"{p} has {actual} bytes, {MANIFEST_NAME} says {size}: truncated or replaced")
    if mode == "full":
        paths = [d / name for name, _, _ in entries]
        for p, (name, _, digest), actual in zip(paths, entries, _sha256_all(paths)):
            if actual != digest:
                raise CheckpointError(
                    f"{p} does not match its sha256 in {MANIFEST_NAME}: corrupted or replaced after the save "
                    f"(if you edited it on purpose, load with verify='size' or remove {MANIFEST_NAME})"
                )
    listed = {n for n, _, _ in entries}
    for p in d.iterdir():
        if (p.suffix == ".safetensors" or p.name in (INDEX_NAME, "config.json")) and p.name not in listed:
            raise CheckpointError(f"{p} is not in {MANIFEST_NAME}: it does not belong to this checkpoint")
    return doc
