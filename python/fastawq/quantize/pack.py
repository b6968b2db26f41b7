"""Turning a layer's (scaled, clipped) float linears into their final form: packed 4-bit
WQLinear, or pseudo-quantized floats for the 2/3/8-bit evaluation modes."""
from __future__ import annotations

import torch
from torch import nn

from fastawq import reference
from fastawq.models.base import set_submodule
from fastawq.modules import WQLinear
from fastawq.quantize.config import QuantConfig


def target_linears(layer: nn.Module, prefix: str, config: QuantConfig) -> list[tuple[str, nn.Linear]]:
    """The float linears of one decoder layer that get quantized, by name relative to the layer."""
    return [
        (n, m) for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and not config.skips(f"{prefix}.{n}")
    ]


@torch.no_grad()
def finalize_layer(layer: nn.Module, prefix: str, config: QuantConfig, *, pack: bool | None = None) -> None:
    """Round every target linear of `layer` to nearest on its group grid: pack it into a WQLinear
    (4-bit, pack=None/True) or write the dequantized weights back (pseudo-quantization)."""
    pack = config.packable if pack is None else pack
    if pack and not config.packable:
        raise ValueError(f"only 4-bit weights pack; w_bit={config.w_bit} is for pseudo-quantized evaluation")
    for name, lin in target_linears(layer, prefix, config):
        g = config.group_size_for(f"{prefix}.{name}", lin.in_features)
        if pack:
            if lin.out_features % reference.PACK != 0:
                raise ValueError(
                    f"layer {prefix}.{name}: out_features={lin.out_features} is not divisible by 8, "
                    f"so it cannot be packed; list it in modules_to_not_convert"
                )
            set_submodule(layer, name, WQLinear.from_linear(lin, g, zero_point=config.zero_point))
        else:
            lin.weight.data = reference.pseudo_quantize(lin.weight.data, g, config.w_bit, config.zero_point)


def layers_of(model: nn.Module) -> tuple[str, nn.ModuleList]:
    from fastawq.models import architecture_of
    from fastawq.models.moe import moe_spec_of, unfuse_model

    arch = architecture_of(model)
    # Fused 3-D experts are not nn.Linear: without this they would silently stay full precision.
    unfuse_model(model, arch.layers_path, moe_spec_of(model))
    return arch.layers_path, model.get_submodule(arch.layers_path)


@torch.no_grad()
def pack_model(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Pack every decoder layer (after quantize(export_compatible=True))."""
    prefix, layers = layers_of(model)
    for i, layer in enumerate(layers):
        finalize_layer(layer, f"{prefix}.{i}", config, pack=True)
    model.fastawq_quant_config = config
    model.fastawq_packed = True
    return model


@torch.no_grad()
def pseudo_quantize_model(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Replace every target weight by its quantize-dequantize image, in place (any w_bit)."""
    prefix, layers = layers_of(model)
    for i, layer in enumerate(layers):
        finalize_layer(layer, f"{prefix}.{i}", config, pack=False)
    return model
