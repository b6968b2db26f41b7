"""generate(): greedy and sampling, stop tokens, streaming, HF-style generate() on fused models."""
import copy

import pytest
import torch

from fastawq.generate import TextStream, encode, generate, sample_next
from fastawq.modules.fused import fuse_model
from test_fused import COMMON, tiny_w4_model

V = COMMON["vocab_size"]


@pytest.fixture(scope="module")
def models():
    ref = tiny_w4_model("llama", seed=3)
    fused = fuse_model(copy.deepcopy(ref), max_seq_len=48, batch_size=2, backend="torch")
    return ref, fused


def test_greedy_fused_matches_unfused(models):
    ref, fused = models
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    a = generate(fused, None, ids, 10, stop_token_ids=[])
    b = generate(ref, None, ids, 10, stop_token_ids=[])
    assert a.shape == (2, 19)
    assert torch.equal(a[:, :9], ids)
    assert torch.equal(a, b)


def test_sampling_is_reproducible_with_a_seed(models):
    _, fused = models
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(temperature=1.5, top_k=100, top_p=0.95, stop_token_ids=[])
    a = generate(fused, None, ids, 16, seed=7, **kw)
    b = generate(fused, None, ids, 16, seed=7, **kw)
    c = generate(fused, None, ids, 16, seed=8, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = generate(fused, None, ids, 16, stop_token_ids=[])
    assert torch.equal(generate(fused, None, ids, 16, temperature=1.0, top_k=1, seed=3, stop_token_ids=[]), greedy)


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0], [3.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        # top_k=2 never picks columns 0 or 3 of row 0; top_p=0.5 keeps only row 1's dominant column 0.
        assert sample_next(logits[:1], 1.0, top_k=2, generator=gen).item() in (1, 2)
        assert sample_next(logits[1:], 1.0, top_p=0.5, generator=gen).item() == 0
    assert sample_next(logits).tolist() == [1, 0]
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


def test_stop_tokens_and_stream(models):
    _, fused = models
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    free = generate(fused, None, ids, 12, stop_token_ids=[])
    stop = int(free[0, 6 + 2])  # row 0's third new token
    seen = []
    out = generate(fused, None, ids, 12, stop_token_ids=[stop], stream=lambda t: seen.append(t.clone()))
    first_stop = [int((free[r, 6:] == stop).nonzero()[0]) if (free[r, 6:] == stop).any() else 11 for r in range(2)]
    assert out.shape[1] == 6 + max(first_stop) + 1
    assert len(seen) == out.shape[1] - 6 and all(t.shape == (2,) for t in seen)
    assert torch.equal(torch.stack(seen, 1), out[:, 6:])
    for r in range(2):
        n = first_stop[r]
        assert torch.equal(out[r, 6:6 + n + 1], free[r, 6:6 + n + 1])
        if (free[r, 6:] == stop).any():
            assert (out[r, 6 + n:] == stop).all()  # a stopped row is padded with its stop token


def test_hf_style_generate_on_fused_model(models):
    _, fused = models
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(4))

    class Streamer:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, t):
            self.parts.append(t)

        def end(self):
            self.ended = True

    s = Streamer()
    out = fused.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, streamer=s)
    assert torch.equal(out, generate(fused, None, ids, 5, stop_token_ids=[]))
    assert s.ended and torch.equal(s.parts[0], ids) and len(s.parts) == 6
    with pytest.raises(NotImplementedError, match="unpadded"):
        fused.generate(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]), max_new_tokens=2)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "user:", "assistant:", "hello", "world", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    t.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}assistant:"
    return t


def test_chat_template_and_text_stream(models):
    _, fused = models
    tok = _word_tokenizer()
    ids = encode(tok, "hello world", chat=True)
    assert ids.tolist() == [[2, 4, 5, 3]]
    pieces = []
    out = generate(fused, tok, "hello world", 4, chat=True, stream=TextStream(tok, pieces.append))
    assert out[0, :4].tolist() == [2, 4, 5, 3]
    new = out[0, 4:]
    assert "".join(pieces) == tok.decode(new, skip_special_tokens=True)
    if (new == tok.eos_token_id).any():  # the tokenizer's EOS is the default stop token
        assert int(new[-1]) == tok.eos_token_id
