"""A save stopped at any step (an error, a full disk, Ctrl-C, SIGKILL) loses no checkpoint: the
target holds the old checkpoint, byte for byte, or the complete new one."""
from __future__ import annotations

import errno
import signal

import pytest
import torch

from fastawq import atomic
from fastawq.auto import AutoAWQForCausalLM
from fastawq.checkpoint import save_steps, verify_checkpoint
from relhelp import assert_intact, assert_loads_like, debris, run_forked, snapshot

STEPS = save_steps(4)  # the packed tiny model in 20KB shards: 4 shards
RAISES = {"raise": RuntimeError, "enospc": OSError, "int": KeyboardInterrupt}


def _save(model, target, **kw):
    model.save_quantized(target, shard_size="20KB", overwrite=True, **kw)


CASES = [(step, scenario) for scenario in ("fresh", "overwrite", "overwrite-two-renames")
         for step in STEPS + (["save:between-renames"] if scenario == "overwrite-two-renames" else [])]


@pytest.mark.parametrize("action", list(RAISES))
@pytest.mark.parametrize(("step", "scenario"), CASES)
def test_fault_in_process(packed, copy_of, tmp_path, monkeypatch, ids, step, scenario, action):
    target = tmp_path / "ckpt"
    snap = None
    if scenario != "fresh":
        copy_of("old")
        snap = snapshot(target)
    if scenario == "overwrite-two-renames":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    monkeypatch.setenv("FASTAWQ_FAULT_AT", step)
    monkeypatch.setenv("FASTAWQ_FAULT_ACTION", action)
    with pytest.raises(RAISES[action]) as e:
        _save(packed, target)
    if action == "enospc":
        assert e.value.errno == errno.ENOSPC
    monkeypatch.delenv("FASTAWQ_FAULT_AT")
    assert debris(tmp_path) == []
    if step == "save:swapped":
        assert_loads_like(target, packed.model, ids)
    elif snap is None:
        assert not target.exists()
    else:
        assert_intact(target, snap)


@pytest.mark.parametrize("sig", ["kill", "int"])
@pytest.mark.parametrize("step", STEPS)
def test_killed_save_keeps_old_checkpoint(packed, copy_of, tmp_path, ids, step, sig):
    """A forked process saving over a checkpoint is sent SIGKILL / SIGINT at `step`."""
    target = copy_of("old")
    snap = snapshot(target)
    how = run_forked(lambda: _save(packed, target), {"FASTAWQ_FAULT_AT": step, "FASTAWQ_FAULT_ACTION": sig})
    assert how == (("signal", signal.SIGKILL) if sig == "kill" else ("exit", 3))
    if step == "save:swapped":
        assert_loads_like(target, packed.model, ids)
    else:
        assert_intact(target, snap)
    if sig == "int":
        assert debris(tmp_path) == []
    # The next save removes what a kill left behind and succeeds.
    _save(packed, target)
    assert debris(tmp_path) == [] and verify_checkpoint(target, "full")


@pytest.mark.parametrize("step", STEPS)
def test_killed_fresh_save_leaves_nothing_loadable(packed, tmp_path, step):
    target = tmp_path / "ckpt"
    how = run_forked(lambda: _save(packed, target), {"FASTAWQ_FAULT_AT": step, "FASTAWQ_FAULT_ACTION": "kill"})
    assert how == ("signal", signal.SIGKILL)
    if step == "save:swapped":
        assert verify_checkpoint(target, "full")
    else:
        assert not target.exists()


@pytest.mark.parametrize("sig", ["kill", "int"])
def test_kill_between_two_renames_is_recovered(packed, copy_of, tmp_path, monkeypatch, ids, other, sig):
    """Where one-step exchange is missing, a kill between the renames leaves the old checkpoint
    aside; the next load puts it back."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = copy_of("old")
    snap = snapshot(target)
    run_forked(lambda: _save(packed, target), {"FASTAWQ_FAULT_AT": "save:between-renames", "FASTAWQ_FAULT_ACTION": sig})
    if sig == "int":
        assert_intact(target, snap)
    else:
        assert not target.exists() and debris(tmp_path)
        loaded = AutoAWQForCausalLM.from_quantized(target, device_map="cpu")
        assert_intact(target, snap)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, other.model(ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("failing_shard", [1, 2, 4])
def test_disk_full_inside_a_shard_write(packed, copy_of, tmp_path, monkeypatch, failing_shard):
    """safetensors writes half a shard, then the disk is full."""
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def half_then_enospc(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == failing_shard:
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_enospc)
    target = copy_of("old")
    snap = snapshot(target)
    with pytest.raises(OSError, match="No space"):
        _save(packed, target)
    assert_intact(target, snap)
    assert debris(tmp_path) == []
