"""The one graph-safe scratch-buffer helper of the Triton kernels (split-K partials and counters).

Buffers are per device and name, grow only, and are never freed once handed out: a CUDA graph
captured over a buffer keeps pointing at it, so an outgrown one is retired, not released.
Counters are zeroed once, when allocated; the kernels re-arm them after use, so no memset sits
in a captured step. Kernels sharing a name on one device must run on one stream at a time.
"""
from __future__ import annotations

import torch


class Workspace:
    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, str], torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []

    def get(
        self, device: torch.device, name: str, numel: int, dtype: torch.dtype, *, zeroed: bool, minimum: int = 0
    ) -> torch.Tensor:
        """A buffer of at least `numel` elements (`minimum` when first allocated, to grow rarely)."""
        key = (torch.device(device), name)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:
                self.retired.append(buf)
            alloc = torch.zeros if zeroed else torch.empty
            buf = alloc(max(numel, minimum), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf

    @property
    def buffers(self) -> dict[torch.device, tuple[torch.Tensor, ...]]:
        """The live buffers by device (a captured graph must be re-captured when one changes)."""
        out: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        for (device, _), buf in sorted(self._bufs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            out[device] = out.get(device, ()) + (buf,)
        return out


WORKSPACE = Workspace()
