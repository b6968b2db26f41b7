"""Damaged checkpoints: every truncation, bit flip, deletion or forged header ends in a
CheckpointError naming the file, never in a crash or a silently wrong model."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastawq.checkpoint import MANIFEST_NAME, CheckpointError, load_quantized

FILES = ["config.json", MANIFEST_NAME, "generation_config.json", "model.safetensors.index.json"] + [
    f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)
]
SHARDS = [f for f in FILES if f.endswith(".safetensors")]
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "delete":
        path.unlink()
        return
    if how == "truncate-half":
        data = data[: len(data) // 2]
    elif how == "truncate-7":
        data = data[:7]
    elif how == "empty":
        data = bytearray()
    elif how == "append":
        data += b"\x00garbage"
    else:
        pos = {"flip-first": 0, "flip-header": 12, "flip-middle": len(data) // 2, "flip-last": len(data) - 1}[how]
        data[pos] ^= 0x20
    path.write_bytes(bytes(data))


def load(d, verify):
    return load_quantized(d, verify=verify)[0]


ALL = ["truncate-half", "truncate-7", "empty", "append", "delete", "flip-first", "flip-header", "flip-middle", "flip-last"]


@pytest.mark.parametrize("how", ALL)
@pytest.mark.parametrize("name", FILES)
def test_full_verify_refuses_any_damage(copy_of, packed, ids, name, how):
    d = copy_of("sharded")
    damage(d / name, how)
    if name == MANIFEST_NAME and how == "delete":
        # No manifest reads as a third-party checkpoint: loaded unchecked, and it is intact.
        with torch.no_grad():
            torch.testing.assert_close(load(d, "full")(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)
        return
    with pytest.raises(CheckpointError) as e:
        load(d, "full")
    if name != MANIFEST_NAME:
        assert name in str(e.value)


@pytest.mark.parametrize("how", ["truncate-half", "truncate-7", "empty", "append", "delete"])
@pytest.mark.parametrize("name", [f for f in FILES if f != MANIFEST_NAME])
def test_size_verify_refuses_resized_files(copy_of, name, how):
    d = copy_of("sharded")
    damage(d / name, how)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(d, "size")


READER_CASES = [(n, h) for n in SHARDS for h in ("truncate-half", "truncate-7", "empty", "flip-first", "flip-header",
                                                  "delete")]
READER_CASES += [(n, h) for n in ("model.safetensors.index.json", "config.json")
                 for h in ("truncate-half", "truncate-7", "empty", "delete")]


@pytest.mark.parametrize(("name", "how"), READER_CASES)
def test_reader_without_manifest_names_damaged_file(copy_of, packed, ids, name, how):
    """verify="off" (or an AutoAWQ checkpoint): the reader itself refuses a broken file."""
    d = copy_of("sharded")
    damage(d / name, how)
    if (name, how) == ("model.safetensors.index.json", "delete"):
        # Without an index every shard is read; each tensor is in one of them: the same model.
        with torch.no_grad():
            torch.testing.assert_close(load(d, "off")(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)
        return
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(d, "off")


@FUZZ
@given(data=st.data())
def test_fuzz_bit_flips_are_always_caught(copy_of, data):
    d = copy_of("sharded")
    name = data.draw(st.sampled_from(FILES))
    raw = bytearray((d / name).read_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    (d / name).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        load(d, "full")


@FUZZ
@given(data=st.data())
def test_fuzz_truncations_without_manifest(copy_of, data):
    d = copy_of("sharded")
    (d / MANIFEST_NAME).unlink()
    name = data.draw(st.sampled_from(SHARDS))
    raw = (d / name).read_bytes()
    (d / name).write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(d, "off")


@FUZZ
@given(data=st.data())
def test_fuzz_header_flips_without_manifest(copy_of, packed, ids, data):
    """A flip inside a shard's JSON header: refused, or (a flip in padding) the same model."""
    d = copy_of("sharded")
    name = data.draw(st.sampled_from(SHARDS))
    raw = bytearray((d / name).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    pos = data.draw(st.integers(0, 8 + n - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    (d / name).write_bytes(bytes(raw))
    try:
        model = load(d, "off")
    except CheckpointError:
        return
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, packed.model(ids).logits, rtol=1e-3, atol=1e-3)


_DTYPES = st.sampled_from(["F16", "F32", "BF16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""])
_ENTRY = st.fixed_dictionaries({
    "dtype": _DTYPES,
    "shape": st.lists(st.integers(-2, 70), max_size=3),
    "data_offsets": st.lists(st.integers(-4, 4096), min_size=0, max_size=3),
})


@FUZZ
@given(header=st.dictionaries(st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "__metadata__",
                                               "model.layers.0.mlp.down_proj.qweight", "x"]), _ENTRY, max_size=4),
       body=st.binary(max_size=256), lie=st.integers(-8, 8))
def test_fuzz_forged_headers(copy_of, header, body, lie):
    """Random safetensors headers (wrong dtypes, shapes, offsets, lengths) never crash the reader."""
    d = copy_of("one")
    (d / MANIFEST_NAME).unlink()
    blob = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", max(len(blob) + lie, 0)) + blob + body)
    with pytest.raises(CheckpointError, match="model.safetensors|lacks"):
        load(d, "off")
