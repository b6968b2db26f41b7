"""What a streaming quantization has finished, kept on disk so a killed run continues.

The output folder gets a work folder `.fastawq-work/` holding:
- `journal.json`: the job's fingerprint (source checkpoint, quant config, calibration data), the
  number of decoder layers a resume skips, and the shard writer's state (which files hold which
  tensors);
- `piece-NNNNN.safetensors`: the tensors outside the decoder layers, then the finished layers,
  not yet gathered into an output shard;
- `hidden-LNNNNN-rR.safetensors`: the activations entering layer `layers_done`, per rank.
Every file is written to a temporary name and renamed, and the journal is rewritten only after
the files it names exist, so a kill at any instant leaves a consistent state: pieces the journal
does not name (layers finished after its last checkpoint) are written again by the resumed run.
The work folder is removed when the checkpoint is complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch

from fastawq.quantize.source import SAFETENSORS_DTYPES, read_header, read_tensor

WORK_DIR = ".fastawq-work"
JOURNAL = "journal.json"
FORMAT = 1


class ResumeError(RuntimeError):
    """The output folder holds a partial run of a different job."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors file written atomically (temporary name, fsync, rename), a tensor at a time."""
    write_safetensors(path, [(k, v.dtype, list(v.shape), lambda v=v: v) for k, v in tensors.items()])


def write_safetensors(dest: Path, entries: list[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor]]]) -> None:
    """A safetensors file written a tensor at a time, atomically: `entries` give each tensor's name,
    dtype, shape and a function producing it, so peak memory is one tensor, not the file."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k, dtype, shape, _ in entries:
        n = _nbytes(shape, dtype)
        header[k] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format allows space padding; aligned data reads faster
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for k, dtype, shape, get in entries:
            t = get().detach().to("cpu").contiguous()
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(f"tensor {k}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
            if t.numel():
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))  # no bytes copy of the tensor
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def concat_safetensors(sources: list[Path], dest: Path) -> dict[str, str]:
    """Write the tensors of several safetensors files into one. Returns {tensor name: dest file name}.
    Read with plain reads, a tensor at a time: peak memory is one tensor."""
    entries = []
    for src in sources:
        for k, e in read_header(src).items():
            entries.append((k, e.dtype, e.shape, lambda e=e, k=k: read_tensor(e, k)))
    write_safetensors(dest, entries)
    return {k: dest.name for k, _, _, _ in entries}


def _link(src: Path, dest: Path) -> bool:
    """A lone piece becomes a shard by a second name (no copy); the piece's own name goes when the
    journal records the shard, so a kill in between still finds the piece. False where the
    filesystem has no hard links (the caller copies)."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        return False
    return True


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def file_fingerprint(paths: list[Path], hash_small: int = 1 << 20) -> dict[str, Any]:
    """Names, sizes and mtimes of the files; content hashes of the small ones (config, index)."""
    out = {}
    for p in sorted(paths):
        st = p.stat()
        entry: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if st.st_size <= hash_small:
            entry = {"size": st.st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        out[p.name] = entry
    return out


def tensor_hash(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Journal:
    """The work folder of one output folder. Only rank 0 writes it."""

    def __init__(self, out_dir: Path, fingerprint: dict[str, Any]):
        self.out_dir = Path(out_dir)
        self.work = self.out_dir / WORK_DIR
        self.path = self.work / JOURNAL
        self.fingerprint = fingerprint
        self.layers_done = 0
        self.writer_state: dict[str, Any] = {}

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> None:
        """Read the journal and check it was written for the same job; raise ResumeError otherwise."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ResumeError(f"{self.path} is unreadable ({e}); delete {self.work} to start over") from None
        if data.get("format") != FORMAT:
            raise ResumeError(f"{self.path} was written by another fastawq journal format ({data.get('format')})")
        old = data.get("fingerprint", {})
        diffs = _diff(old, self.fingerprint)
        if diffs:
            raise ResumeError(
                f"{self.out_dir} holds a partial quantization of a different job, so it cannot be resumed: "
                + "; ".join(diffs)
                + f". Pass resume=False (CLI: --no-resume) to discard it and start over, or choose another output folder."
            )
        self.layers_done = int(data["layers_done"])
        self.writer_state = data.get("writer", {})

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        data = {"format": FORMAT, "fingerprint": self.fingerprint, "layers_done": self.layers_done,
                "writer": self.writer_state}
        atomic_write_bytes(self.path, json.dumps(data, indent=1, sort_keys=True).encode())

    def hidden_path(self, layer: int, rank: int) -> Path:
        return self.work / f"hidden-L{layer:05d}-r{rank}.safetensors"

    def save_hidden(self, layer: int, rank: int, chunks: list[torch.Tensor]) -> None:
        # One chunk at a time through host memory: these are [samples, seq, hidden] activations.
        write_safetensors(self.hidden_path(layer, rank),
                          [(f"x{j}", x.dtype, list(x.shape), lambda x=x: x) for j, x in enumerate(chunks)])

    def load_hidden(self, layer: int, rank: int, device: torch.device) -> list[torch.Tensor]:
        p = self.hidden_path(layer, rank)
        if not p.exists():
            raise ResumeError(f"{p} is missing: the activations entering layer {layer} were not saved; "
                              f"delete {self.work} to start over")
        entries = read_header(p)
        return [read_tensor(entries[f"x{j}"], f"x{j}").to(device) for j in range(len(entries))]

    def drop_hidden_before(self, layer: int) -> None:
        for p in self.work.glob("hidden-L*-r*.safetensors"):
            if int(p.name[8:13]) < layer:
                p.unlink(missing_ok=True)


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _diff(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
        return out
    if old != new:
        return [f"{path} changed (journal: {_short(old)}, now: {_short(new)})"]
    return []


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 80 else s[:77] + "..."


class ShardWriter:
    """Output shards written as the layers finish: each finished layer becomes a piece file; when
    the pieces would pass `shard_size` they are gathered into the next shard. Shards get their
    final names (model-XXXXX-of-YYYYY.safetensors, or model.safetensors alone) in finish()."""

    def __init__(self, out_dir: Path, work: Path, shard_size: int, state: dict[str, Any] | None = None):
        self.out_dir = Path(out_dir)
        self.work = Path(work)
        self.shard_size = shard_size
        state = state or {}
        self.pieces: list[dict[str, Any]] = list(state.get("pieces", []))  # {"file", "bytes"}
        self.shards: list[dict[str, Any]] = list(state.get("shards", []))  # {"file", "tensors", "bytes"}
        self.next_piece = int(state.get("next_piece", 0))
        self.tail_written = bool(state.get("tail_written", False))  # the tensors outside the layers

    def state(self) -> dict[str, Any]:
        return {"pieces": self.pieces, "shards": self.shards, "next_piece": self.next_piece,
                "tail_written": self.tail_written}

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write a piece (not yet recorded: the caller saves the journal with state())."""
        self.add_entries([(k, v.dtype, list(v.shape), lambda v=v: v) for k, v in tensors.items()])

    def add_entries(self, entries: list[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor]]]) -> None:
        """add() of tensors produced one at a time while the piece is written (write_safetensors)."""
        name = f"piece-{self.next_piece:05d}.safetensors"
        write_safetensors(self.work / name, entries)
        self.next_piece += 1
        self.pieces.append({"file": name, "bytes": sum(_nbytes(shape, dt) for _, dt, shape, _ in entries)})

    def full(self) -> bool:
        """Do the pieces, minus the last, already fill a shard? Then gather them."""
        return len(self.pieces) > 1 and sum(p["bytes"] for p in self.pieces) > self.shard_size

    def roll(self, upto: int | None = None) -> list[Path]:
        """Gather the first `upto` pieces into a shard (default: the longest run of pieces that fits
        the shard size, at least one, never the last); returns the piece files the caller deletes
        once the journal records the shard."""
        if upto is None:
            upto, size = 0, 0
            while upto < len(self.pieces) - 1 and (upto == 0 or size + self.pieces[upto]["bytes"] <= self.shard_size):
                size += self.pieces[upto]["bytes"]
                upto += 1
        if upto <= 0:
            return []
        take, self.pieces = self.pieces[:upto], self.pieces[upto:]
        name = f"shard-{len(self.shards):05d}.safetensors"
        sources = [self.work / p["file"] for p in take]
        dest = self.work / name
        if len(sources) == 1 and _link(sources[0], dest):
            names = {k: name for k in read_header(dest)}
        else:
            names = concat_safetensors(sources, dest)
        self.shards.append({"file": name, "tensors": sorted(names), "bytes": sum(p["bytes"] for p in take)})
        return sources

    def finish(self) -> dict[str, str]:
        """Move the shards to their final names in the output folder; write the index when there is
        more than one. Returns the weight map."""
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for i, sh in enumerate(self.shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            src = self.work / sh["file"]
            if src.exists():
                os.replace(src, self.out_dir / final)
            elif not (self.out_dir / final).exists():
                raise ResumeError(f"shard {src} is missing and {self.out_dir / final} was never written")
            weight_map.update({k: final for k in sh["tensors"]})
        if n > 1:
            total = sum(sh["bytes"] for sh in self.shards)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write_bytes(self.out_dir / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
        return weight_map
