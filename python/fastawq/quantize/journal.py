"""What a streaming quantization has finished, kept on disk so a killed run continues.

The output folder gets a work folder `.fastawq-work/` holding:
- `journal.json`: the job's fingerprint (source checkpoint, quant config, calibration data), the
  number of decoder layers a resume skips, and the shard writer's state (which shard holds which
  tensors, and how many bytes of the open shard count);
- `shard-NNNNN.safetensors`: the output shards, the tensors outside the decoder layers first,
  then the finished layers appended as they come;
- `hidden-LNNNNN-rR.safetensors`: the activations entering layer `layers_done`, per rank.
Files are written to a temporary name and renamed, or (the open shard) appended and synced, and
the journal is rewritten only after the bytes it counts are on disk, so a kill at any instant
leaves a consistent state: bytes the journal does not count (layers finished after its last
checkpoint) are cut off and written again by the resumed run.
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
    """Output shards written in place as the layers finish, never copied: tensors are appended to
    the open shard behind a header space reserved at its start, and the shard is closed (its
    header written into that space) when the next tensors would pass `shard_size` or the space.
    The journal records the open shard's committed length (commit_state); a resumed run cuts the
    file back to it and appends again. Shards get their final names (model-XXXXX-of-YYYYY
    .safetensors, or model.safetensors alone) in finish()."""

    def __init__(self, out_dir: Path, work: Path, shard_size: int, state: dict[str, Any] | None = None):
        self.out_dir = Path(out_dir)
        self.work = Path(work)
        self.shard_size = shard_size
        state = state or {}
        self.shards: list[dict[str, Any]] = list(state.get("shards", []))  # closed: {"file", "tensors", "bytes"}
        # {"file", "reserve", "bytes", "header_bound", "entries": {name: [dtype code, shape, begin, end]}}
        self.open: dict[str, Any] | None = state.get("open")
        self.tail_written = bool(state.get("tail_written", False))  # the tensors outside the layers
        if self.open is not None:
            path = self.work / self.open["file"]
            end = 8 + self.open["reserve"] + self.open["bytes"]
            if not path.exists() or path.stat().st_size < end:
                raise ResumeError(f"{path} is shorter than the {end} bytes the journal recorded; delete "
                                  f"{self.work} to start over")
            os.truncate(path, end)  # what was appended after the last commit is written again

    def state(self) -> dict[str, Any]:
        op = None if self.open is None else dict(self.open, entries=dict(self.open["entries"]))
        return {"shards": list(self.shards), "open": op, "tail_written": self.tail_written}

    def commit_state(self) -> dict[str, Any]:
        """The state to record, once the open shard's bytes are on disk."""
        if self.open is not None:
            fd = os.open(self.work / self.open["file"], os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return self.state()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Append tensors (not yet recorded: the caller saves the journal with commit_state())."""
        self.add_entries([(k, v.dtype, list(v.shape), lambda v=v: v) for k, v in tensors.items()])

    def add_entries(self, entries: list[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor]]]) -> None:
        """add() of tensors produced one at a time while they are written (peak memory: one)."""
        size = sum(_nbytes(shape, dt) for _, dt, shape, _ in entries)
        bound = sum(_entry_bound(k, dt, shape) for k, dt, shape, _ in entries)
        op = self.open
        if op is not None and op["entries"] and (op["bytes"] + size > self.shard_size
                                                 or op["header_bound"] + bound > op["reserve"]):
            self._close()
        if self.open is None:
            self._start(bound)
        op = self.open
        with open(self.work / op["file"], "r+b") as f:
            f.seek(8 + op["reserve"] + op["bytes"])
            for k, dtype, shape, get in entries:
                t = get().detach().to("cpu").contiguous()
                if t.dtype != dtype or list(t.shape) != list(shape):
                    raise ValueError(f"tensor {k}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
                n = t.numel() * t.element_size()
                if n:
                    f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
                op["entries"][k] = [SAFETENSORS_DTYPES[dtype], list(shape), op["bytes"], op["bytes"] + n]
                op["bytes"] += n
                del t
        op["header_bound"] += bound

    def _start(self, bound: int) -> None:
        # A 5 GB shard of packed linears holds ~1000 tensors (~150 header bytes each); many small
        # experts hold more, hence the reserve grows with the shard size.
        reserve = max(1 << 20, self.shard_size // 2000, bound + 4096)
        reserve += -reserve % 8  # aligned data reads faster
        name = f"shard-{len(self.shards):05d}.safetensors"
        with open(self.work / name, "wb") as f:
            f.truncate(8 + reserve)
        self.open = {"file": name, "reserve": reserve, "bytes": 0, "header_bound": len(_HEADER_META), "entries": {}}

    def _close(self) -> None:
        """Write the open shard's header into its reserved space; the shard is then complete."""
        op, self.open = self.open, None
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for k, (code, shape, begin, end) in op["entries"].items():
            header[k] = {"dtype": code, "shape": shape, "data_offsets": [begin, end]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        if len(blob) > op["reserve"]:  # cannot happen: header_bound bounds it
            raise RuntimeError(f"header of {op['file']} ({len(blob)} bytes) overflows its reserve {op['reserve']}")
        path = self.work / op["file"]
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", op["reserve"]))
            f.write(blob + b" " * (op["reserve"] - len(blob)))
            f.flush()
            os.fsync(f.fileno())
        self.shards.append({"file": op["file"], "tensors": sorted(op["entries"]), "bytes": op["bytes"]})

    def close_open(self) -> None:
        if self.open is not None and self.open["entries"]:
            self._close()
        elif self.open is not None:
            (self.work / self.open["file"]).unlink(missing_ok=True)
            self.open = None

    def finish(self) -> dict[str, str]:
        """Close the open shard, move the shards to their final names in the output folder; write
        the index when there is more than one. Returns the weight map."""
        self.close_open()
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


_HEADER_META = json.dumps({"__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()


def _entry_bound(name: str, dtype: torch.dtype, shape: list[int]) -> int:
    """An upper bound of the header bytes one tensor takes (its offsets written with 16 digits)."""
    e = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [10**15, 10**15]}
    return len(json.dumps({name: e}, separators=(",", ":")).encode()) + 2
