"""AWQ quantization: the config, the search, and packing."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastawq.quantize.awq import AwqQuantizer
from fastawq.quantize.config import QuantConfig
from fastawq.quantize.pack import pack_model, pseudo_quantize_model
from fastawq.modules.scaled_activation import ScaledActivation


def quantize(
    model: nn.Module,
    tokenizer: Any,
    config: QuantConfig | dict | None = None,
    calib: Any = None,
    *,
    max_calib_samples: int = 128,
    max_calib_seq_len: int = 512,
    split: str = "train",
    text_column: str = "text",
    duo_scaling: bool = True,
    apply_clip: bool = True,
    export_compatible: bool = False,
    n_parallel_calib_samples: int | None = None,
    device: torch.device | str | None = None,
    quantizer_cls: type[AwqQuantizer] = AwqQuantizer,
) -> nn.Module:
    """AWQ-quantize a transformers causal LM in place and return it.

    With w_bit=4 the decoder linears become packed WQLinear layers (unless export_compatible,
    which only applies the scales and clipping so that `pack_model` can pack later); other bit
    widths leave pseudo-quantized float weights for evaluation.
    """
    from fastawq.calib import get_calib_dataset

    cfg = QuantConfig.from_dict(config)
    samples = get_calib_dataset(calib, tokenizer, max_calib_samples, max_calib_seq_len, split, text_column)
    q = quantizer_cls(
        model, cfg, samples, duo_scaling=duo_scaling, apply_clip=apply_clip,
        export_compatible=export_compatible, n_parallel_calib_samples=n_parallel_calib_samples, device=device,
    )
    return q.quantize()


__all__ = ["AwqQuantizer", "QuantConfig", "ScaledActivation", "quantize", "pack_model", "pseudo_quantize_model"]

