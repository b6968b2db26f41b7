"""The default calibration set shipped inside the package (scripts/make_calib_data.py builds it)."""
from __future__ import annotations

import gzip
import json
import zlib

import pytest
import torch

from fastawq import data
from fastawq.calib import get_calib_dataset


class CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 100 for c in text]}


@pytest.fixture(scope="module")
def records():
    return data.load_default_calib()


def test_shipped_file_loads_and_is_small(records):
    assert data.DEFAULT_CALIB_FILE.stat().st_size < 400 * 1024
    assert all(set(r) == {"id", "source", "genre", "text"} and len(r["text"]) > 500 for r in records)
    assert (data.DEFAULT_CALIB_FILE.parent / "README.md").exists()  # sources and licences beside the data


def test_every_calibration_genre_and_code(records):
    genres = {r["genre"] for r in records}
    want = set(data.BROWN_GENRES) - set(data.BROWN_HELDOUT_GENRES)
    assert genres == want | {"code"}
    ids = [r["id"] for r in records if r["source"] == "brown"]
    assert ids == data.brown_calib_ids()
    for g in want:
        assert sum(r["genre"] == g for r in records) == data.CALIB_FILES_PER_GENRE
    # tags are stripped: no "word/tag" tokens left in the English text
    assert not any("/at " in r["text"] or "/nn " in r["text"] for r in records if r["source"] == "brown")


def test_never_overlaps_heldout_files(records):
    shipped = {r["id"] for r in records}
    genres, files = set(data.brown_heldout_ids("genres")), set(data.brown_heldout_ids("files"))
    assert not shipped & genres and not shipped & files
    assert {f[1] for f in genres} == set(data.BROWN_HELDOUT_GENRES)
    # every Brown file is either calibration or held out, exactly once
    n_total = sum(n for _, n in data.BROWN_GENRES.values())
    assert len(genres) + len(files) + len(data.brown_calib_ids()) == n_total == 500
    # the code part comes only from the calibration side of the stdlib docstring split, so
    # data.heldout_text() stays unseen
    code_ids = [r["id"].removeprefix("stdlib/") for r in records if r["source"] == "python-stdlib"]
    assert len(code_ids) > 10
    assert all(zlib.crc32(rel.encode()) % data._HELDOUT_EVERY != 0 for rel in code_ids)


def test_default_texts_interleave_genres_and_code():
    texts = data.default_calib_texts(max_chars=60_000)
    assert 60_000 <= sum(map(len, texts)) < 60_000 + 5_000
    code_chunks = {c for r in data.load_default_calib() if r["genre"] == "code" for c in data._chunks(r["text"], 2000)}
    code = sum(len(t) for t in texts if t in code_chunks)
    assert 0.08 < code / sum(map(len, texts)) < 0.3  # code is 16 % of SmolLM2 tokens at 128 x 512
    # every genre is already in the first round of chunks
    english = {r["text"][:200]: r["genre"] for r in data.load_default_calib() if r["genre"] != "code"}
    assert {english[t[:200]] for t in texts[:15] if t[:200] in english} == set(data.BROWN_GENRES) - set(data.BROWN_HELDOUT_GENRES)


@pytest.mark.parametrize("calib", [None, "default", "pileval"])
def test_get_calib_dataset_default(calib):
    x = get_calib_dataset(calib, CharTokenizer(), n_samples=16, max_seq_len=256)
    assert x.shape == (16, 256) and x.dtype == torch.long
    ref = get_calib_dataset(None, CharTokenizer(), n_samples=16, max_seq_len=256)
    assert torch.equal(x, ref)


def test_stdlib_set_stays_reachable():
    x = get_calib_dataset("stdlib", CharTokenizer(), n_samples=4, max_seq_len=128)
    assert x.shape == (4, 128)
    assert not torch.equal(x, get_calib_dataset(None, CharTokenizer(), n_samples=4, max_seq_len=128))


def test_brown_detokenizer():
    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` it/pps was/bedz n't/* fair/jj ''/'' ,/, (/( he/pps )/) said/vbd ./.\n"
    assert data.brown_to_text(raw) == 'The jury said "it wasn\'t fair", (he) said.'


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_calib_data"):
        data.load_default_calib(tmp_path / "none.jsonl.gz")
    bad = tmp_path / "x.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"id": "ca01", "source": "brown", "genre": "a", "text": "t"}) + "\n")
    assert data.load_default_calib(bad)[0]["id"] == "ca01"
