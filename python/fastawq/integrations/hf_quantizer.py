"""transformers' HfQuantizer for AWQ "gemm" checkpoints, served by fastawq's WQLinear and kernels.

Imported only by fastawq.integrations.transformers.register() (it imports transformers)."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from fastawq import layouts
from fastawq.modules import WQLinear

log = logging.getLogger(__name__)

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
           "I16": torch.int16}


def _format(qc: Any) -> str:
    fmt = getattr(qc, "format", None) or getattr(qc, "version", None) or "gemm"
    return str(getattr(fmt, "value", fmt)).lower()


class _LayoutTensors(nn.Module):
    """Holds one linear's tensors as a gemv / gemv_fast checkpoint stores them, until the load
    is done and they are repacked into a WQLinear."""

    def __init__(self, linear: nn.Linear, tensors: dict[str, tuple[list[int], str]]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        for name, (shape, dtype) in tensors.items():
            self.register_buffer(name, torch.empty(shape, dtype=_DTYPES.get(dtype, torch.int32), device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a layout placeholder runs only if the model load did not finish")


def _checkpoint_shapes(files: Any) -> dict[str, tuple[list[int], str]] | None:
    """name -> (shape, dtype) from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    if not files:
        return None
    out: dict[str, tuple[list[int], str]] = {}
    for f in files:
        if not str(f).endswith(".safetensors"):
            return None
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_shape(), s.get_dtype())
    return out


def _moe_of(model: nn.Module) -> tuple[str, Any] | None:
    """(layers_path, MoESpec) of a mixture-of-experts family, None for dense (or unknown) ones."""
    from fastawq.models import UnsupportedModelError, architecture_of
    from fastawq.models.moe import moe_spec_of

    spec = moe_spec_of(model)
    if spec is None:
        return None
    try:
        return architecture_of(model).layers_path, spec
    except (UnsupportedModelError, AttributeError):
        return None


def _unfuse_stored_experts(model: nn.Module, shapes: dict | None) -> dict | None:
    """fastawq (like AutoAWQ and vLLM) saves MoE experts one by one, transformers 5 builds them fused
    (3-D): unfuse every MoE block whose checkpoint stores its experts that way into weightless
    per-expert nn.Linear, which the caller's loop then turns into meta WQLinear. Returns `shapes`
    under the names transformers loads them by (Mixtral's `block_sparse_moe` is `mlp`: transformers'
    conversion mapping renames every key so, and its expert-merging converters match only
    `.weight`, so `.qweight / .qzeros / .scales` reach the per-expert modules by name)."""
    moe_ = _moe_of(model)
    if moe_ is None:
        return shapes
    from fastawq.models import moe

    layers_path, spec = moe_
    if shapes is None:
        raise ValueError(f"{model.config.model_type}: MoE experts are unfused to fit the checkpoint's per-expert "
                         "tensors, read from safetensors headers; the loader was given no safetensors files")
    _, from_ck = moe.checkpoint_renamer(layers_path, spec)
    renamed = {from_ck(k): v for k, v in shapes.items()}
    # Only packed experts: float per-expert `.weight`s (experts kept in full precision) are merged into
    # the fused parameters by transformers' own converters, which need the fused module in place.
    packed = [k for k in renamed if k.endswith(".qweight")]
    n = moe.unfuse_stored_experts(model, layers_path, spec, packed)
    log.info("unfused the experts of %d MoE block(s) to load the checkpoint's per-expert AWQ tensors", n)
    return renamed


class FastAwqHfQuantizer(HfQuantizer):
    """Loads pre-quantized AWQ "gemm" checkpoints; quantizing is done with fastawq itself."""

    requires_calibration = True

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        qc = self.quantization_config
        fmt = _format(qc)
        if fmt != "gemm" and fmt not in layouts.LAYOUTS:
            raise ValueError(
                f"fastawq's transformers backend loads AWQ checkpoints of version gemm, {', '.join(layouts.LAYOUTS)}; "
                f"this one is {fmt!r}"
            )
        if getattr(qc, "bits", 4) != 4:
            raise ValueError(f"fastawq's AWQ layers are 4-bit, the checkpoint says bits={qc.bits}")

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        qc = self.quantization_config
        shapes = _checkpoint_shapes(kwargs.get("checkpoint_files"))
        fmt = _format(qc)
        if fmt != "gemm" and shapes is None:
            raise ValueError(f"the {fmt} layout is repacked from safetensors files; none were given to the loader")
        skip = self.get_modules_to_not_convert(model, qc.modules_to_not_convert, model._keep_in_fp32_modules, True)
        shapes = _unfuse_stored_experts(model, shapes)
        count = 0
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, nn.Linear):
                continue
            if shapes is not None:
                # The checkpoint says which layers are packed and with how many groups, as fastawq's
                # own loader reads it (mixed group sizes included).
                if f"{name}.qweight" not in shapes or f"{name}.scales" not in shapes:
                    continue
                if fmt != "gemm":
                    names = [n for n in ("qweight", "qzeros", "scales", "bias") if f"{name}.{n}" in shapes]
                    model.set_submodule(name, _LayoutTensors(mod, {n: shapes[f"{name}.{n}"] for n in names}))
                    count += 1
                    continue
                sshape, sdtype = shapes[f"{name}.scales"]
                groups = sshape[0]
                if groups == 0 or mod.in_features % groups:
                    raise ValueError(f"{name}.scales {tuple(sshape)} does not divide in_features={mod.in_features}")
                group_size, dtype = mod.in_features // groups, _DTYPES.get(sdtype, torch.float16)
            else:
                if any(k in name for k in skip) or name.split(".")[-1] in skip:
                    continue
                group_size = mod.in_features if qc.group_size == -1 else qc.group_size
                dtype = torch.float16
            new = WQLinear(mod.in_features, mod.out_features, group_size, mod.bias is not None,
                           device="meta", dtype=dtype)
            new.requires_grad_(False)
            model.set_submodule(name, new)
            count += 1
        if shapes is not None:
            self._wrap_activations(model, shapes)
        if count == 0:
            log.warning("no packed AWQ layer found in this checkpoint")

    @staticmethod
    def _wrap_activations(model: nn.Module, shapes: dict) -> None:
        """Room for the `<act>.scales` some architectures save (e.g. GPT-NeoX's MLP activation)."""
        from fastawq.models import UnsupportedModelError, architecture_of
        from fastawq.quantize.scale import wrap_activation

        try:
            arch = architecture_of(model)
        except (UnsupportedModelError, AttributeError):
            return
        if arch.act_path is None:
            return
        for i, layer in enumerate(model.get_submodule(arch.layers_path)):
            key = f"{arch.layers_path}.{i}.{arch.act_path}.scales"
            if key in shapes:
                wrap_activation(layer, arch.act_path, shapes[key][0][0])

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        # Same attention as from_quantized's unfused GPU model: sdpa without cuDNN's per-KV-length
        # plans (integrations/transformers.py says why).
        if any(p.is_cuda for p in model.parameters()):
            from fastawq.integrations.transformers import use_sdpa_without_cudnn
            use_sdpa_without_cudnn(model)
        fmt = _format(self.quantization_config)
        if fmt != "gemm":
            self._repack_layouts(model, fmt)
        moe_ = _moe_of(model)
        if moe_ is not None:
            from fastawq.models.moe import use_fast_experts

            # As from_quantized does: its logits are the reference this load must give.
            use_fast_experts(model, *moe_)
        return model

    def _repack_layouts(self, model: nn.Module, fmt: str) -> None:
        layout, g = layouts.get_layout(fmt), self.quantization_config.group_size
        for name, mod in list(model.named_modules()):
            if isinstance(mod, _LayoutTensors):
                try:
                    qweight, qzeros, scales = layout.to_gemm({n: b for n, b in mod.named_buffers()}, g)
                except layouts.LayoutError as e:
                    raise ValueError(f"layer {name!r} ({fmt} layout): {e}") from None
                bias = getattr(mod, "bias", None)
                new = WQLinear(mod.in_features, mod.out_features, qweight.shape[0] // scales.shape[0],
                               bias is not None, device=qweight.device, dtype=scales.dtype)
                new.qweight, new.qzeros, new.scales = qweight, qzeros, scales
                if bias is not None:
                    new.bias = bias
                model.set_submodule(name, new.requires_grad_(False))
        # What the model now holds (and save_pretrained would write) is gemm.
        self.quantization_config.format = "gemm"

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[dict | None, dict]:
        """What save_pretrained writes. Grouped experts (WQExperts) give per-expert views of their
        stacked buffers, the gate and up ones strided: transformers' shared-storage check cannot
        walk those, so they are handed over as contiguous CPU copies (what safetensors writes)."""
        from fastawq.modules.moe import WQExperts
        from fastawq.modules.qlinear import unpack_to

        if not any(isinstance(m, WQExperts) for m in model.modules()):
            return None, {}
        with unpack_to("cpu"):  # layers held packed unpack one at a time, not all at once on the GPU
            state = model.state_dict()
        return {k: t if t.is_contiguous() else t.detach().to("cpu").contiguous() for k, t in state.items()}, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False
