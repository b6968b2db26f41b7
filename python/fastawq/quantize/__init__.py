"""AWQ quantization: the config, the search, and packing."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from fastawq.quantize.awq import AwqQuantizer
from fastawq.quantize.config import QuantConfig
from fastawq.quantize.pack import pack_model, pseudo_quantize_model
from fastawq.modules.scaled_activation import ScaledActivation


@dataclass
class SearchOptions:
    """The calibration and search options of quantize() and quantize_streaming().

    max_calib_samples x max_calib_seq_len tokens of `split` / `text_column` calibrate; duo_scaling
    and apply_clip select AWQ's search variants; n_parallel_calib_samples is the number of samples
    a layer forward takes at once (given explicitly, activations wait on the CPU between uses);
    device runs the search (default: CUDA when present)."""

    max_calib_samples: int = 128
    max_calib_seq_len: int = 512
    split: str = "train"
    text_column: str = "text"
    duo_scaling: bool = True
    apply_clip: bool = True
    n_parallel_calib_samples: int | None = None
    device: torch.device | str | None = None

    @classmethod
    def of(cls, caller: str, options: dict[str, Any]) -> "SearchOptions":
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{caller}() got unknown option(s) {unknown}; its search options are {names}")
        return cls(**options)

    def samples(self, calib: Any, tokenizer: Any) -> torch.Tensor:
        """The calibration token ids [n, seq_len]."""
        from fastawq.calib import get_calib_dataset

        return get_calib_dataset(calib, tokenizer, self.max_calib_samples, self.max_calib_seq_len, self.split,
                                 self.text_column)

    def quantizer(self, cls: type[AwqQuantizer], model: nn.Module, config: QuantConfig, samples: torch.Tensor,
                  **extra: Any) -> AwqQuantizer:
        return cls(model, config, samples, duo_scaling=self.duo_scaling, apply_clip=self.apply_clip,
                   n_parallel_calib_samples=self.n_parallel_calib_samples, device=self.device, **extra)


def quantize(
    model: nn.Module,
    tokenizer: Any,
    config: QuantConfig | dict | None = None,
    calib: Any = None,
    *,
    export_compatible: bool = False,
    quantizer_cls: type[AwqQuantizer] = AwqQuantizer,
    **options: Any,
) -> nn.Module:
    """AWQ-quantize a transformers causal LM in place and return it; `options` are the
    SearchOptions fields (max_calib_samples, max_calib_seq_len, split, text_column, duo_scaling,
    apply_clip, n_parallel_calib_samples, device).

    With w_bit=4 the decoder linears become packed WQLinear layers (unless export_compatible,
    which only applies the scales and clipping so that `pack_model` can pack later); other bit
    widths leave pseudo-quantized float weights for evaluation.
    """
    cfg = QuantConfig.from_dict(config)
    opts = SearchOptions.of("quantize", options)
    q = opts.quantizer(quantizer_cls, model, cfg, opts.samples(calib, tokenizer), export_compatible=export_compatible)
    return q.quantize()


__all__ = ["AwqQuantizer", "QuantConfig", "ScaledActivation", "SearchOptions", "quantize", "pack_model",
           "pseudo_quantize_model"]
