"""`fastawq quantize | generate | ppl` on a tiny Llama with a byte-level tokenizer."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastawq.cli import main


@pytest.fixture(scope="module")
def fp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=len(vocab) - 1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_quantize_generate_ppl(fp_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(fp_dir), str(out), "--group-size", "32", "--max-calib-samples", "2",
                 "--max-calib-seq-len", "64", "--device", "cpu"]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert "saved to" in capsys.readouterr().out
    assert main(["generate", str(out), "hello", "--max-new-tokens", "4", "--no-chat", "--device", "cpu"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["ppl", str(out), "--text", str(text), "--seq-len", "64", "--device", "cpu"]) == 0
    assert "perplexity" in capsys.readouterr().out
    with pytest.raises(FileExistsError):
        main(["quantize", str(fp_dir), str(out), "--group-size", "32", "--max-calib-samples", "2",
              "--max-calib-seq-len", "64", "--device", "cpu"])
