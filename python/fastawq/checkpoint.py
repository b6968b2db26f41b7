"""AWQ checkpoints: sharded safetensors + config.json with `quantization_config`, the layout that
AutoAWQ writes and transformers / vLLM read. Only safetensors are ever read.

A save never leaves a folder half-written: the whole checkpoint is written into a temporary folder
beside the target, fsynced, and swapped in by one rename (`atomic_dir`). The last file written is
`fastawq_manifest.json` (every other file with its size and sha256): loading checks it, so a folder
whose files do not belong together is refused instead of loaded."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path, PurePath
from typing import Any

import torch
from torch import nn

from fastawq.atomic import (  # noqa: F401  (re-exported: checkpoint.atomic_dir is the save machinery)
    INDEX_NAME, MANIFEST_NAME, CheckpointError, atomic_dir, fault_point, recover, verify_checkpoint, verify_mode,
    write_manifest,
)
from fastawq.models import architecture_of
from fastawq.models import moe
from fastawq.models.base import set_submodule
from fastawq.modules import WQLinear
from fastawq.modules.qlinear import unpack_to
from fastawq.quantize.config import QuantConfig
from fastawq.modules.scaled_activation import wrap_activation

log = logging.getLogger(__name__)

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_STORAGE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def save_steps(n_shards: int) -> list[str]:
    """Every fault point of one save, in order."""
    return (["save:tmpdir"] + [f"save:shard:{i + 1}" for i in range(n_shards)]
            + ["save:index", "save:config", "save:tokenizer", "save:manifest", "save:carry", "save:swap",
               "save:swapped"])


# ---------------------------------------------------------------- paths
def parse_size(size: int | str) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"shard_size must be bytes (int) or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", size)
        if not m or m.group(2).upper() not in _UNITS | {"": 1}:
            raise ValueError(f"cannot parse shard size {size!r} (e.g. '5GB', '500MB', or bytes)")
        try:
            n = int(float(m.group(1)) * _UNITS.get(m.group(2).upper(), 1))
        except ValueError:
            raise ValueError(f"cannot parse shard size {size!r} (e.g. '5GB', '500MB', or bytes)") from None
    if n <= 0:
        raise ValueError(f"shard size must be positive, got {size!r}")
    return n


def looks_local(path: str | os.PathLike) -> bool:
    """A hub id is `name` or `org/name`; anything else (a Path, ./x, /x, ~/x, a/b/c, an existing
    parent folder) is a local path, which must not be sent to the hub."""
    if isinstance(path, PurePath):
        return True
    s = os.fspath(path)
    if s.startswith(("/", ".", "~")) or "\\" in s or s.count("/") > 1:
        return True
    if not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", s):
        return True
    return "/" in s and Path(s).parent.is_dir()


def check_local_path(path: str | os.PathLike) -> Path | None:
    """The folder `path` names, when it looks local; FileNotFoundError naming it when that folder
    does not exist (no hub retries). None for something that may be a hub id."""
    p = Path(os.fspath(path)).expanduser()
    if p.exists():
        if not p.is_dir():
            raise NotADirectoryError(f"{path} is a file, not a model folder")
        return p
    if not looks_local(path):
        return None
    if recover(p):
        return p
    raise FileNotFoundError(errno.ENOENT, f"no such model folder: {os.fspath(path)}", os.fspath(path))


def check_not_source(target: Path, source: Any) -> None:
    if not source:
        return
    s = Path(source).expanduser()
    if not s.is_dir():
        return
    s, t = s.resolve(), target.expanduser().resolve()
    if t == s or s in t.parents or t in s.parents:
        raise ValueError(
            f"refusing to save into {target}: it is, contains or is inside {s}, the folder the model was "
            f"loaded from; choose another output folder"
        )


def source_of(model: nn.Module) -> str | None:
    """The folder the model was loaded from, if it was loaded from one."""
    src = getattr(model, "fastawq_source", None)
    if src:
        return str(src)
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name if name and Path(name).is_dir() else None


# ---------------------------------------------------------------- saving
def packing_state(model: nn.Module, quant_config: QuantConfig | None = None) -> str:
    """"float" (no packed layer), "quantized" or "partial" (an interrupted quantize())."""
    state = getattr(model, "fastawq_state", None)
    if state == "partial":
        return "partial"
    packed = [m for m in model.modules() if isinstance(m, WQLinear)]
    if not packed:
        return "float"
    if state == "quantized":  # a finished quantize() or a load: float layers there are on purpose
        return "quantized"
    try:
        arch = architecture_of(model)
        layers = model.get_submodule(arch.layers_path)
    except Exception:  # an unknown model can still be saved; only the layer scan is skipped
        return "quantized"
    for i, layer in enumerate(layers):
        for name, m in layer.named_modules():
            full = f"{arch.layers_path}.{i}.{name}"
            if type(m) is nn.Linear and not (quant_config and quant_config.skips(full)):
                return "partial"
    return "quantized"


def all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in a float tensor: min and max propagate NaN, and one vectorised min/max pass
    is ~15x faster on CPU than isfinite(t).all() on fp16 (no mask temporary)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def untied(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without the repeats of tied weights (lm_head = embed_tokens): each storage is saved
    once, under its first name, as transformers does. Meta tensors have no storage to share and are
    all kept (the streaming writer plans the names of tensors it has not read yet)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for k, t in sd.items():
        if t.device.type == "meta":
            out[k] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            out[k] = t
    return out


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    # Layers held packed unpack to the CPU one at a time (on the GPU, all of them at once would
    # double the weights' memory there while the model is saved).
    with unpack_to("cpu"):
        sd = model.state_dict()
    return {k: t.detach().to("cpu").contiguous() for k, t in untied(sd).items()}


def _plan_shards(sd: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    return shards


def save_quantized(
    model: nn.Module,
    save_dir: str | os.PathLike,
    quant_config: QuantConfig,
    tokenizer: Any = None,
    *,
    shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write `model` (packed) to `save_dir`, atomically (see `atomic_dir`). Everything is
    validated before the disk is touched; a non-empty directory is an error unless overwrite."""
    from safetensors.torch import save_file

    target = Path(save_dir)
    quant_config = QuantConfig.from_dict(quant_config)
    limit = parse_size(shard_size)
    state = packing_state(model, quant_config)
    if state == "partial":
        raise ValueError("the model is partially quantized (an interrupted quantize()): reload the float model and "
                         "quantize it again")
    if state == "float":
        raise ValueError("the model has no packed layers: quantize it (or pack() after export_compatible=True) first")
    if not quant_config.packable:
        raise ValueError(f"only 4-bit models are saved as AWQ checkpoints, the config says w_bit={quant_config.w_bit}")
    check_not_source(target, source_of(model))
    sd = _state_dict_for_save(model)
    to_ck, _ = moe.checkpoint_renamer(architecture_of(model).layers_path, moe.moe_spec_of(model))
    sd = {to_ck(k): t for k, t in sd.items()}
    for k, t in sd.items():
        if t.is_floating_point() and not all_finite(t):
            raise ValueError(f"tensor {k!r} holds NaN/inf (e.g. fp16 scales overflowed); not saving a broken model")
    shards = _plan_shards(sd, limit)
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with atomic_dir(target, overwrite=overwrite) as tmp:
        weight_map = {}
        for i, (name, shard) in enumerate(zip(names, shards)):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            fault_point(f"save:shard:{i + 1}")
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in sd.values())
            (tmp / INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        fault_point("save:index")
        _save_config(model, tmp, quant_config)
        fault_point("save:config")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        fault_point("save:tokenizer")
        write_manifest(tmp)
        fault_point("save:manifest")
    log.info("saved %d tensors in %d shard(s) to %s", len(sd), len(shards), target)
    return target


def _save_config(model: nn.Module, d: Path, quant_config: QuantConfig) -> None:
    config = model.config
    had = "quantization_config" in config.__dict__
    prev = config.__dict__.get("quantization_config")
    config.quantization_config = quant_config.to_hf()
    try:
        config.save_pretrained(str(d))
    finally:
        if had:
            config.quantization_config = prev
        else:
            del config.quantization_config
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(d))
        except Exception as e:  # a model's odd generation config must not lose the weights
            log.warning("generation_config not saved: %s", e)


# ---------------------------------------------------------------- loading
def _open(f: Path) -> Any:
    from safetensors import safe_open

    try:
        h = safe_open(str(f), framework="pt", device="cpu")
        keys = list(h.keys())
    except Exception as e:
        raise CheckpointError(f"cannot read {f} (truncated or not safetensors?): {e}") from None
    return h, keys


def _read_index(index: Path) -> dict[str, str]:
    try:
        wm = json.loads(index.read_text())["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
    for f in set(wm.values()):
        if Path(f).is_absolute() or ".." in Path(f).parts or not f.endswith(".safetensors"):
            raise CheckpointError(f"{index} names {f!r}, which is not a .safetensors file in the checkpoint folder")
    return wm


def read_tensors(d: Path) -> dict[str, tuple[Path, Any]]:
    """Map tensor name -> (file, open safetensors handle). Every shard must open; a tensor is
    taken from the shard the index names, and a tensor stored twice is refused."""
    index = d / INDEX_NAME
    wm = _read_index(index) if index.exists() else None
    if wm is not None:
        files = [d / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.exists():
                tensors = sorted(k for k, v in wm.items() if v == f.name)[:3]
                raise CheckpointError(f"shard {f} is missing (it holds {tensors}...)")
    else:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
            extra = f"; found {bins}: fastawq reads only safetensors" if bins else ""
            raise CheckpointError(f"no .safetensors files in {d}{extra}")
    out: dict[str, tuple[Path, Any]] = {}
    for f in files:
        h, keys = _open(f)
        for k in keys:
            if k in out:
                raise CheckpointError(f"tensor {k!r} is stored in both {out[k][0]} and {f}; a checkpoint holds it once")
            if wm is not None and wm.get(k) != f.name:
                where = f"names {wm[k]}" if k in wm else "does not list it"
                raise CheckpointError(f"{f} holds tensor {k!r} but {index.name} {where}")
            out[k] = (f, h)
    if wm is not None:
        absent = [k for k in wm if k not in out]
        if absent:
            raise CheckpointError(f"{index} maps {absent[:3]} to shards that do not hold them")
    return out


def _get(tensors: dict, name: str) -> torch.Tensor:
    f, h = tensors[name]
    try:
        return h.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {f} (truncated?): {e}") from None


def _local_dir(quant_dir: str | os.PathLike) -> Path:
    d = check_local_path(quant_dir)
    if d is None:  # not local-looking and absent; hub ids are resolved before this point
        raise FileNotFoundError(errno.ENOENT, f"no such checkpoint folder: {os.fspath(quant_dir)}", os.fspath(quant_dir))
    return d


def load_quantized(
    quant_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    verify: str | None = None,
) -> tuple[nn.Module, QuantConfig]:
    """Build the transformers model of `quant_dir` with WQLinear layers where the checkpoint has
    `<name>.qweight`, and load every tensor, checking the manifest, names, dtypes, shapes and
    finiteness first. Returns it on the CPU. verify: "full" | "size" | "off" (FASTAWQ_VERIFY)."""
    d = _local_dir(quant_dir)  # before the slow imports: a typo fails at once
    verify_checkpoint(d, verify)
    from transformers import AutoConfig

    from fastawq import layouts
    from fastawq.multimodal import auto_model_class, rename_checkpoint_keys

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    if not (d / "config.json").exists():
        raise CheckpointError(f"{d} has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{d / 'config.json'} cannot be read: {e}") from None
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise CheckpointError(f"{d / 'config.json'} has no quantization_config: not an AWQ checkpoint")
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    # AutoAWQ's gemv / gemv_fast / marlin checkpoints are repacked to gemm right after reading.
    version = layouts.version_of(qc)
    if version != "gemm" and version not in layouts.LAYOUTS:
        raise CheckpointError(
            f"{d / 'config.json'}: unknown AWQ version={version!r}; fastawq reads gemm, {', '.join(layouts.LAYOUTS)}"
        )
    try:
        quant_config = QuantConfig.from_dict({k: v for k, v in qc.items() if k not in ("version", "format")})
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{d / 'config.json'}: quantization_config: {e}") from None
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
        model = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    arch = architecture_of(model)
    tensors = rename_checkpoint_keys(model, tensors)  # vision-language checkpoints in the saved layout
    spec = moe.moe_spec_of(model)
    if spec is not None:
        tensors = moe.prepare_load(model, arch.layers_path, spec, tensors)
    _swap_modules(model, arch, tensors, quant_config)
    _load_state(model, tensors, d)
    if spec is not None:
        moe.use_fast_experts(model, arch.layers_path, spec)
    model.eval()
    model.fastawq_quant_config = quant_config
    model.fastawq_packed = True
    model.fastawq_state = "quantized"
    model.fastawq_source = str(d)
    return model, quant_config


def _header(tensors: dict, name: str) -> tuple[Path, str, tuple[int, ...]]:
    f, h = tensors[name]
    sl = h.get_slice(name)
    return f, sl.get_dtype(), tuple(sl.get_shape())


def _check_packed(tensors: dict, name: str, k: int, n: int, qc: QuantConfig) -> tuple[int, torch.dtype]:
    """The group size and scale dtype of packed layer `name` [k -> n], from its tensors' headers."""
    f, qdt, qshape = _header(tensors, f"{name}.qweight")
    for part in ("scales", "qzeros"):
        if f"{name}.{part}" not in tensors:
            raise CheckpointError(f"{f} has {name}.qweight but no {name}.{part}")
    _, sdt, sshape = _header(tensors, f"{name}.scales")
    zf, zdt, zshape = _header(tensors, f"{name}.qzeros")
    sf = tensors[f"{name}.scales"][0]
    if qdt != "I32" or zdt != "I32":
        bad, where, dt = (f"{name}.qweight", f, qdt) if qdt != "I32" else (f"{name}.qzeros", zf, zdt)
        raise CheckpointError(f"{where}: tensor {bad!r} is {dt}; AWQ packs 4-bit values into int32 (I32)")
    if sdt not in _STORAGE_DTYPES:
        raise CheckpointError(f"{sf}: tensor {name + '.scales'!r} is {sdt}; scales are F16, BF16 or F32")
    if qshape != (k, n // 8) or n % 8:
        raise CheckpointError(f"{f}: tensor {name + '.qweight'!r} has shape {qshape}, the layer [{k} -> {n}] "
                              f"needs ({k}, {n // 8})")
    groups = sshape[0] if len(sshape) == 2 else 0
    if len(sshape) != 2 or sshape[1] != n or groups == 0 or k % groups:
        raise CheckpointError(f"{sf}: tensor {name + '.scales'!r} has shape {sshape}; the layer [{k} -> {n}] needs "
                              f"(K // group_size, {n})")
    g = k // groups
    allowed = {k if qc.q_group_size == -1 else qc.q_group_size, qc.fallback_group_size}
    if g not in allowed:
        raise CheckpointError(f"{sf}: tensor {name + '.scales'!r} implies group size {g}, the config says "
                              f"{qc.q_group_size}" + (f" (fallback {qc.fallback_group_size})" if qc.fallback_group_size else ""))
    if zshape != (groups, n // 8):
        raise CheckpointError(f"{zf}: tensor {name + '.qzeros'!r} has shape {zshape}, expected ({groups}, {n // 8})")
    return g, _STORAGE_DTYPES[sdt]


def _swap_modules(model: nn.Module, arch, tensors: dict, qc: QuantConfig) -> None:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.qweight" in tensors:
            g, dtype = _check_packed(tensors, name, mod.in_features, mod.out_features, qc)
            new = WQLinear(mod.in_features, mod.out_features, g, mod.bias is not None, dtype=dtype, device="cpu")
            set_submodule(model, name, new)
    if arch.act_path is not None:
        layers = model.get_submodule(arch.layers_path)
        for i, layer in enumerate(layers):
            key = f"{arch.layers_path}.{i}.{arch.act_path}.scales"
            if key in tensors:
                wrap_activation(layer, arch.act_path, _header(tensors, key)[2][0])


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
        f = tensors[k][0]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{f}: tensor {k!r} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)}")
        if t.is_floating_point() != ref.is_floating_point() or (not t.is_floating_point() and t.dtype != ref.dtype):
            raise CheckpointError(f"{f}: tensor {k!r} is {t.dtype}, the model expects {ref.dtype}")
        if t.is_floating_point():
            if not all_finite(t):
                raise CheckpointError(f"{f}: tensor {k!r} holds NaN/inf")
            cast = t.to(ref.dtype)
            if cast.dtype != t.dtype and not all_finite(cast):
                raise CheckpointError(f"{f}: tensor {k!r} overflows {ref.dtype}; load with a wider dtype")
            t = cast
        loaded[k] = t
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
