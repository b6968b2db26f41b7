"""A float checkpoint read tensor by tensor, and the next decoder layer read ahead in a thread.

Tensors are read with plain file reads into fresh tensors, not memory-mapped: the pages of a
mapped shard count in the process's resident size for as long as the mapping lives, so a reader
that maps shards holds twice the bytes it needs (the mapping and the copy the model keeps).
A read releases the GIL, so the next layer's bytes arrive while the current layer is searched.
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

INDEX_NAME = "model.safetensors.index.json"
# The safetensors format caps its JSON header at 100 MB; anything larger is a corrupt file.
_MAX_HEADER = 100 * 1024 * 1024


SAFETENSORS_DTYPES = {
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64", torch.int32: "I32",
    torch.int64: "I64", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64",
}


def dtype_of_code(code: str) -> torch.dtype:
    for dt, c in SAFETENSORS_DTYPES.items():
        if c == code:
            return dt
    raise ValueError(f"unsupported safetensors dtype {code!r}")


class _Entry:
    __slots__ = ("file", "dtype", "shape", "start", "nbytes")

    def __init__(self, file: Path, dtype: torch.dtype, shape: list[int], start: int, nbytes: int):
        self.file, self.dtype, self.shape, self.start, self.nbytes = file, dtype, shape, start, nbytes


def read_header(path: Path) -> dict[str, _Entry]:
    """Name -> (dtype, shape, absolute byte range) of every tensor in one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path} is not a valid safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} has an unreadable safetensors header: {e}") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtype_of_code(info["dtype"])
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has a bad header entry {info!r} ({e})") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or begin < 0 or end < begin:
            raise ValueError(f"{path}: tensor {name!r} {info['dtype']} {shape} spans bytes [{begin}, {end}), "
                             f"which does not match its shape")
        if base + end > size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size} "
                             f"(truncated?)")
        out[name] = _Entry(path, dtype, shape, base + begin, end - begin)
    return out


def read_tensor(e: _Entry, name: str) -> torch.Tensor:
    """One tensor read into a new CPU tensor (one read call for the whole byte range)."""
    t = torch.empty(e.shape, dtype=e.dtype)
    if e.nbytes:
        buf = memoryview(t.view(-1).view(torch.uint8).numpy())
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.start)
            got = 0
            while got < e.nbytes:
                n = f.readinto(buf[got:])
                if not n:
                    raise ValueError(f"cannot read tensor {name!r} from {e.file}: the file ends after "
                                     f"{got} of its {e.nbytes} bytes (truncated?)")
                got += n
    return t


class SourceCheckpoint:
    """A Hugging Face model folder read tensor by tensor from its safetensors shards."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face model folder")
        self._headers: dict[str, dict[str, _Entry]] = {}
        index = self.path / INDEX_NAME
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {self.path}: fastawq reads only safetensors")
            self.weight_map = {k: f for f in files for k in self._header(f)}
        for f in sorted(set(self.weight_map.values())):
            if not (self.path / f).is_file():
                raise FileNotFoundError(f"shard {self.path / f} named by {index.name} is missing")

    def files(self) -> list[Path]:
        names = {"config.json", *self.weight_map.values()}
        if (self.path / INDEX_NAME).exists():
            names.add(INDEX_NAME)
        return [self.path / n for n in sorted(names)]

    def _header(self, file: str) -> dict[str, _Entry]:
        h = self._headers.get(file)
        if h is None:
            h = self._headers[file] = read_header(self.path / file)
        return h

    def entry(self, name: str) -> _Entry:
        f = self.weight_map[name]
        e = self._header(f).get(name)
        if e is None:
            raise ValueError(f"{self.path / f} lacks tensor {name!r}, which {INDEX_NAME} places there")
        return e

    def get(self, name: str) -> torch.Tensor:
        return read_tensor(self.entry(name), name)

    def nbytes_of(self, name: str) -> int:
        return self.entry(name).nbytes

    def first_float_dtype(self) -> torch.dtype:
        for k in self.weight_map:
            dt = self.entry(k).dtype
            if dt.is_floating_point:
                return dt
        return torch.float32

    def read(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], optional: set[str] = frozenset()
             ) -> dict[str, torch.Tensor]:
        """The tensors named in `expected` (full name -> the shape and dtype the model holds), cast
        to that dtype where both are floating point; names in `optional` may be absent."""
        missing = [k for k in expected if k not in self.weight_map and k not in optional]
        if missing:
            raise ValueError(f"{self.path}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
        out = {}
        for k, (shape, dtype) in expected.items():
            if k not in self.weight_map:
                continue
            e = self.entry(k)
            if tuple(e.shape) != tuple(shape):
                raise ValueError(f"{e.file}: tensor {k!r} has shape {tuple(e.shape)}, the model expects {tuple(shape)}")
            t = self.get(k)
            out[k] = t.to(dtype) if t.is_floating_point() and dtype.is_floating_point else t
        return out


def expected_tensors(module: torch.nn.Module, prefix: str, skip: tuple[str, ...] = ()
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """prefix + key -> (shape, dtype) of the module's state, keys starting with one of `skip` left out."""
    return {prefix + k: (tuple(t.shape), t.dtype) for k, t in module.state_dict().items()
            if not any(k.startswith(s) for s in skip)}


def load_module(module: torch.nn.Module, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
    """Give `module` the tensors read for it (full names), replacing its meta parameters."""
    module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items()}, strict=False, assign=True)


class LayerReader:
    """The tensors of decoder layer after decoder layer; with `prefetch`, layer i + 1 is read in a
    background thread while layer i is searched (one layer ahead, no more: it is the second layer
    of the RAM budget). Exceptions of a background read surface at take()."""

    def __init__(self, src: SourceCheckpoint, n_layers: int,
                 expected_of: Callable[[int], dict[str, tuple[tuple[int, ...], torch.dtype]]], prefetch: bool = True):
        self.src = src
        self.n_layers = n_layers
        self.expected_of = expected_of
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastawq-prefetch") if prefetch else None
        self._ahead: tuple[int, Future] | None = None

    def take(self, i: int) -> dict[str, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == i:
            tensors = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()
            tensors = self.src.read(self.expected_of(i))
        if self._pool is not None and i + 1 < self.n_layers:
            self._ahead = (i + 1, self._pool.submit(self.src.read, self.expected_of(i + 1)))
        return tensors

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "LayerReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
