"""Helpers of the reliability suite: folder snapshots and a forked child that a fault stops."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from fastawq.auto import AutoAWQForCausalLM
from fastawq.checkpoint import MANIFEST_NAME, verify_checkpoint


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def debris(parent: Path) -> list[str]:
    """Hidden temporary / backup folders a save left beside its target."""
    return sorted(p.name for p in parent.iterdir() if ".fastawq-" in p.name)


def assert_intact(d: Path, snap: dict[str, bytes]) -> None:
    """`d` holds exactly the checkpoint it held before, and it verifies."""
    assert d.is_dir(), f"{d} was lost"
    assert snapshot(d) == snap, f"{d} changed: {sorted(snapshot(d))} vs {sorted(snap)}"
    assert verify_checkpoint(d, "full") is not None


def assert_loads_like(d: Path, model: torch.nn.Module, ids: torch.Tensor) -> None:
    assert (d / MANIFEST_NAME).exists()
    loaded = AutoAWQForCausalLM.from_quantized(d, device_map="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)


def run_forked(fn, env: dict[str, str], timeout: float = 60.0) -> tuple[str, int]:
    """Run fn() in a forked child with `env` set: ("signal", n) when a signal ended it, else
    ("exit", code); 0 = returned, 3 = KeyboardInterrupt, 4 = another exception."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            # One thread: the child must not touch the parent's OpenMP pool, which fork does not copy.
            torch.set_num_threads(1)
            os.environ.update(env)
            fn()
        except KeyboardInterrupt:
            code = 3
        except BaseException:
            code = 4
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError("forked child hung")
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        return "signal", os.WTERMSIG(status)
    return "exit", os.WEXITSTATUS(status)
