"""The one graph-safe scratch-buffer helper of the Triton kernels (split-K partials and counters).

Buffers are per device and name and grow only. A buffer handed out during a CUDA-graph capture is
never freed: the graph keeps pointing at it, so once outgrown it is retired, not released. One
that no capture saw (grown by the GEMM tuner timing large split-K candidates, say) is released
when outgrown or by `release`, so it does not hold memory for the life of the process.
Counters are zeroed once, when allocated; the kernels re-arm them after use, so no memset sits
in a captured step. Kernels sharing a name on one device must run on one stream at a time.
"""
from __future__ import annotations

import torch


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Workspace:
    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._captured: set[tuple[torch.device, str]] = set()  # keys whose buffer a capture saw
        self.retired: list[torch.Tensor] = []

    def get(
        self, device: torch.device, name: str, numel: int, dtype: torch.dtype, *, zeroed: bool, minimum: int = 0
    ) -> torch.Tensor:
        """A buffer of at least `numel` elements (`minimum` when first allocated, to grow rarely)."""
        key = (torch.device(device), name)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if key in self._captured:
                self.retired.append(buf)
                self._captured.discard(key)
            # An outgrown buffer no graph holds goes back to the allocator before the new one is made.
            buf = self._bufs.pop(key, None)
            del buf
            alloc = torch.zeros if zeroed else torch.empty
            buf = alloc(max(numel, minimum), dtype=dtype, device=device)
            self._bufs[key] = buf
        if _capturing(key[0]):
            self._captured.add(key)
        return buf

    def release(self, device: torch.device, name: str) -> None:
        """Drop the buffer `name` on `device` unless a capture saw it (the next get allocates anew)."""
        key = (torch.device(device), name)
        if key not in self._captured:
            self._bufs.pop(key, None)

    @property
    def buffers(self) -> dict[torch.device, tuple[torch.Tensor, ...]]:
        """The live buffers by device (a captured graph must be re-captured when one changes)."""
        out: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        for (device, _), buf in sorted(self._bufs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            out[device] = out.get(device, ()) + (buf,)
        return out


WORKSPACE = Workspace()
