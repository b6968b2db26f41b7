"""GGUF export of the AWQ-scaled float model, read back with transformers' GGUF loader."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

from fastawq.auto import AutoAWQForCausalLM  # noqa: E402
from fastawq.cli import main as cli_main  # noqa: E402
from fastawq.gguf_export import export_gguf  # noqa: E402

TEXT = [
    "The jury said the election was conducted fairly, and the city praised its officials.",
    "def add(a, b):\n    return a + b  # a tiny function with a docstring-free body",
    "She walked to the harbour at dawn; the boats were already out and the gulls were loud.",
] * 20


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    """A tiny llama, AWQ-quantized with export_compatible=True and saved: the scaled float model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("gguf")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=10000.0)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "fp"))
    tok.save_pretrained(str(root / "fp"))
    model = AutoAWQForCausalLM.from_pretrained(str(root / "fp"), torch_dtype=torch.float32)
    model.quantize(tok, quant_config={"w_bit": 4, "q_group_size": 32, "zero_point": True, "version": "GEMM"},
                   calib_data=TEXT, max_calib_samples=4, max_calib_seq_len=32, export_compatible=True, device="cpu")
    model.save_quantized(str(root / "scaled"))
    return root


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_save_quantized_after_export_compatible_writes_scaled_float_model(scaled_dir):
    from transformers import AutoModelForCausalLM

    d = scaled_dir / "scaled"
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and (d / "tokenizer.json").exists()
    scaled = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    orig = AutoModelForCausalLM.from_pretrained(str(scaled_dir / "fp"), dtype=torch.float32)
    w_s = scaled.model.layers[0].mlp.down_proj.weight
    w_o = orig.model.layers[0].mlp.down_proj.weight
    assert w_s.shape == w_o.shape and not torch.equal(w_s, w_o)  # AWQ scaled / clipped it
    assert not any("qweight" in k for k in scaled.state_dict())


@pytest.mark.parametrize("gguf_type", ["f16", "q4_0"])
def test_gguf_reads_back_with_transformers(scaled_dir, gguf_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = scaled_dir / f"model-{gguf_type}.gguf"
    export_gguf(scaled_dir / "scaled", out, gguf_type)
    ref = AutoModelForCausalLM.from_pretrained(str(scaled_dir / "scaled"), dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(str(scaled_dir), gguf_file=out.name, dtype=torch.float32).eval()
    assert type(got).__name__ == "LlamaForCausalLM"
    assert got.config.num_key_value_heads == 2 and got.config.head_dim == 16
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    want = _logits(ref, ids)
    if gguf_type == "f16":
        # the same model with its weights rounded to fp16, as the file stores them (norms stay fp32)
        rounded = AutoModelForCausalLM.from_pretrained(str(scaled_dir / "scaled"), dtype=torch.float32).eval()
        with torch.no_grad():
            for p in rounded.parameters():
                if p.dim() == 2:
                    p.copy_(p.half().float())
        torch.testing.assert_close(_logits(got, ids), _logits(rounded, ids), atol=1e-4, rtol=1e-4)
    else:
        q = _logits(got, ids)
        assert torch.isfinite(q).all()
        err = (q - want).norm() / want.norm()
        assert 0 < err < 0.5, err  # 4-bit blocks of 32: close to, not equal to, the float model
    tok = AutoTokenizer.from_pretrained(str(scaled_dir), gguf_file=out.name)
    src = AutoTokenizer.from_pretrained(str(scaled_dir / "scaled"))
    assert tok("The boats were out.")["input_ids"] == src("The boats were out.")["input_ids"]


def test_cli_and_clear_errors(scaled_dir, tmp_path):
    out = tmp_path / "m.gguf"
    assert cli_main(["export-gguf", str(scaled_dir / "scaled"), str(out), "--type", "q8_0"]) == 0
    assert out.stat().st_size > 0
    # An existing file is replaced only when asked.
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_gguf(scaled_dir / "scaled", out, "f16")
    assert out.read_bytes() == before
    assert cli_main(["export-gguf", str(scaled_dir / "scaled"), str(out), "--type", "f16", "--overwrite"]) == 0
    assert out.read_bytes() != before
    with pytest.raises(ValueError, match="gguf_type"):
        export_gguf(scaled_dir / "scaled", tmp_path / "x.gguf", "q3_k")
    bad = tmp_path / "opt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "opt"}))
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotImplementedError, match="opt"):
        export_gguf(bad, tmp_path / "y.gguf")
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="packed awq checkpoint"):
        export_gguf(bad, tmp_path / "z.gguf")
