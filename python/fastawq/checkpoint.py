"""AWQ checkpoints: sharded safetensors + config.json with `quantization_config`, the layout that
AutoAWQ writes and transformers / vLLM read. Only safetensors are ever read."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastawq.models import architecture_of
from fastawq.modules import WQLinear
from fastawq.quantize.config import QuantConfig
from fastawq.modules.scaled_activation import wrap_activation

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class CheckpointError(ValueError):
    pass


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", size)
    if not m or m.group(2).upper() not in _UNITS | {"": 1}:
        raise ValueError(f"cannot parse shard size {size!r} (e.g. '5GB', '500MB', or bytes)")
    return int(float(m.group(1)) * _UNITS.get(m.group(2).upper(), 1))


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for k, t in sd.items():
        # Tied weights (lm_head = embed_tokens) are saved once, as transformers does.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[k] = t.detach().to("cpu").contiguous()
    return out


def save_quantized(
    model: nn.Module,
    save_dir: str | os.PathLike,
    quant_config: QuantConfig,
    tokenizer: Any = None,
    *,
    shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write `model` (packed) to `save_dir`. A non-empty directory is an error unless overwrite."""
    from safetensors.torch import save_file

    save_dir = Path(save_dir)
    if save_dir.exists() and any(save_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{save_dir} is not empty; pass overwrite=True to replace its checkpoint")
        for old in list(save_dir.glob("*.safetensors")) + list(save_dir.glob(INDEX_NAME)):
            old.unlink()
    save_dir.mkdir(parents=True, exist_ok=True)
    if not any(isinstance(m, WQLinear) for m in model.modules()):
        raise ValueError("the model has no packed layers: quantize it (or pack() after export_compatible=True) first")
    sd = _state_dict_for_save(model)
    limit = parse_size(shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(save_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (save_dir / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    config = model.config
    config.quantization_config = quant_config.to_hf()
    try:
        config.save_pretrained(str(save_dir))
    finally:
        del config.quantization_config
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(save_dir))
        except Exception as e:  # a model's odd generation config must not lose the weights
            log.warning("generation_config not saved: %s", e)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(save_dir))
    log.info("saved %d tensors in %d shard(s) to %s", len(sd), len(shards), save_dir)
    return save_dir


# ---------------------------------------------------------------- loading
def _shard_files(d: Path) -> list[Path]:
    index = d / INDEX_NAME
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = [d / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.exists():
                tensors = sorted(k for k, v in wm.items() if v == f.name)[:3]
                raise CheckpointError(f"shard {f} is missing (it holds {tensors}...)")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        extra = f"; found {bins}: fastawq reads only safetensors" if bins else ""
        raise CheckpointError(f"no .safetensors files in {d}{extra}")
    return files


def read_tensors(d: Path) -> dict[str, tuple[Path, Any]]:
    """Map tensor name -> (file, open safetensors handle); checks every shard opens."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, Any]] = {}
    for f in _shard_files(d):
        try:
            h = safe_open(str(f), framework="pt", device="cpu")
            keys = list(h.keys())
        except Exception as e:
            raise CheckpointError(f"cannot read {f} (truncated or not safetensors?): {e}") from None
        for k in keys:
            out[k] = (f, h)
    return out


def _get(tensors: dict, name: str) -> torch.Tensor:
    f, h = tensors[name]
    try:
        return h.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {f} (truncated?): {e}") from None


def load_quantized(
    quant_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, QuantConfig]:
    """Build the transformers model of `quant_dir` with WQLinear layers where the checkpoint has
    `<name>.qweight`, and load every tensor, checking names and shapes. Returns it on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    d = Path(quant_dir)
    if not (d / "config.json").exists():
        raise CheckpointError(f"{d} has no config.json")
    config = AutoConfig.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise CheckpointError(f"{d / 'config.json'} has no quantization_config: not an AWQ checkpoint")
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    from fastawq import layouts

    # AutoAWQ's gemv / gemv_fast / marlin checkpoints are repacked to gemm right after reading.
    version = layouts.version_of(qc)
    if version != "gemm" and version not in layouts.LAYOUTS:
        raise CheckpointError(
            f"{d / 'config.json'}: unknown AWQ version={version!r}; fastawq reads gemm, {', '.join(layouts.LAYOUTS)}"
        )
    quant_config = QuantConfig.from_dict({k: v for k, v in qc.items() if k not in ("version", "format")})
    del config.quantization_config
    tensors = read_tensors(d)
    if version != "gemm":
        try:
            tensors = layouts.convert_to_gemm(tensors, qc)
        except layouts.LayoutError as e:
            raise CheckpointError(str(e)) from None
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    arch = architecture_of(model)
    _swap_modules(model, arch, tensors, d)
    _load_state(model, tensors, d)
    model.eval()
    model.fastawq_quant_config = quant_config
    model.fastawq_packed = True
    return model, quant_config


def _swap_modules(model: nn.Module, arch, tensors: dict, d: Path) -> None:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.qweight" in tensors:
            qw = tensors[f"{name}.qweight"]
            sc_name = f"{name}.scales"
            if sc_name not in tensors:
                raise CheckpointError(f"{qw[0]} has {name}.qweight but no {sc_name}")
            f, h = tensors[sc_name]
            groups = h.get_slice(sc_name).get_shape()[0]
            if groups == 0 or mod.in_features % groups != 0:
                raise CheckpointError(
                    f"{f}: tensor {sc_name} has {groups} groups, which does not divide in_features={mod.in_features}"
                )
            sdtype = h.get_slice(sc_name).get_dtype()
            dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}.get(sdtype, torch.float16)
            new = WQLinear(mod.in_features, mod.out_features, mod.in_features // groups, mod.bias is not None,
                           dtype=dtype, device="cpu")
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    if arch.act_path is not None:
        layers = model.get_submodule(arch.layers_path)
        for i, layer in enumerate(layers):
            key = f"{arch.layers_path}.{i}.{arch.act_path}.scales"
            if key in tensors:
                f, h = tensors[key]
                wrap_activation(layer, arch.act_path, h.get_slice(key).get_shape()[0])


def _load_state(model: nn.Module, tensors: dict, d: Path) -> None:
    expected = model.state_dict()
    tied = _tied_names(model)
    missing = [k for k in expected if k not in tensors and k not in tied]
    if missing:
        raise CheckpointError(f"{d}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        log.warning("%s: ignoring %d unexpected tensor(s), e.g. %s", d, len(unexpected), unexpected[:5])
    loaded = {}
    for k, ref in expected.items():
        if k not in tensors:
            continue
        t = _get(tensors, k)
        if tuple(t.shape) != tuple(ref.shape):
            f = tensors[k][0]
            raise CheckpointError(f"{f}: tensor {k!r} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)}")
        loaded[k] = t.to(ref.dtype) if t.is_floating_point() and ref.is_floating_point() else t
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.tie_weights()


def _tied_names(model: nn.Module) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    for name, mod in model.named_modules():
        if mod is out:
            return {f"{name}.weight"}
    return set()
