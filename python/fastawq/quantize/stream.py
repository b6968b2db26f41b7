"""Streaming quantization: a model larger than RAM and than the GPU, one decoder layer at a time.

The float checkpoint is read lazily from its safetensors shards (memory-mapped), the model is a
skeleton on the meta device, and only the embeddings, the final norm / head and the layer being
searched are ever materialised. Each finished layer is written to the output at once (see
journal.ShardWriter) and freed, with the activations entering the next layer saved beside it so a
killed run resumes at the first unfinished layer with bit-identical results.

    peak RAM ~ embeddings + head + two layers + calibration activations
    peak GPU ~ one layer + activations + the search's working set

The search itself is AwqQuantizer.quantize_layer, unchanged: the output equals the in-memory
quantize() + save_quantized() tensor for tensor.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastawq.quantize.awq import AwqQuantizer, search_precision
from fastawq.quantize.config import QuantConfig
from fastawq.atomic import write_manifest
from fastawq.quantize.journal import WORK_DIR, Journal, ResumeError, ShardWriter, file_fingerprint, tensor_hash

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
# Test hook: kill this process with SIGKILL while layer N is being finished (after its piece is
# written, before the journal records it: the worst instant for a resume).
FAULT_ENV = "FASTAWQ_KILL_AT_LAYER"
_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class SourceCheckpoint:
    """A Hugging Face model folder read tensor by tensor from its safetensors shards."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} has no config.json: not a Hugging Face model folder")
        index = self.path / INDEX_NAME
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {self.path}: fastawq reads only safetensors")
            self.weight_map = {}
            for f in files:
                with safe_open(str(self.path / f), framework="pt", device="cpu") as h:
                    self.weight_map.update({k: f for k in h.keys()})
        for f in sorted(set(self.weight_map.values())):
            if not (self.path / f).is_file():
                raise FileNotFoundError(f"shard {self.path / f} named by {index.name} is missing")
        self._handles: dict[str, Any] = {}

    def files(self) -> list[Path]:
        names = {"config.json", *self.weight_map.values()}
        if (self.path / INDEX_NAME).exists():
            names.add(INDEX_NAME)
        return [self.path / n for n in sorted(names)]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        f = self.weight_map[name]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = safe_open(str(self.path / f), framework="pt", device="cpu")
        return h

    def get(self, name: str) -> torch.Tensor:
        f = self.weight_map[name]
        try:
            return self._handle(name).get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from {self.path / f} (truncated?): {e}") from None

    def release(self) -> None:
        """Unmap the shards: pages of a memory-mapped file count in the process's resident size
        while mapped, so keeping every shard open would make RSS grow to the whole model."""
        self._handles.clear()

    def nbytes_of(self, name: str) -> int:
        """Stored size of one tensor, read from the header only."""
        sl = self._handle(name).get_slice(name)
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * _ITEMSIZE.get(sl.get_dtype(), 4)

    def first_float_dtype(self) -> torch.dtype:
        for k in self.weight_map:
            t = self.get(k)
            if t.is_floating_point():
                return t.dtype
        return torch.float32


def _model_dtype(config: Any, src: SourceCheckpoint) -> torch.dtype:
    """What from_pretrained(dtype="auto") picks: the config's dtype, else the checkpoint's."""
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else src.first_float_dtype()


def build_skeleton(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model with every parameter on the meta device (no memory); buffers such as rotary
    frequencies are real, as from_pretrained computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()


def _load_module(module: nn.Module, prefix: str, src: SourceCheckpoint, skip: tuple[str, ...] = (),
                 optional: set[str] = frozenset()) -> None:
    """Materialise `module`'s tensors named `prefix` + key from the checkpoint (cast to the
    module's dtypes); keys starting with one of `skip` stay on meta."""
    expected = module.state_dict()
    loaded = {}
    missing = []
    for k, ref in expected.items():
        if any(k.startswith(s) for s in skip):
            continue
        full = prefix + k
        if full not in src.weight_map:
            if full not in optional:
                missing.append(full)
            continue
        t = src.get(full)
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{src.path / src.weight_map[full]}: tensor {full!r} has shape {tuple(t.shape)}, "
                             f"the model expects {tuple(ref.shape)}")
        loaded[k] = t.to(ref.dtype) if t.is_floating_point() and ref.is_floating_point() else t
    if missing:
        raise ValueError(f"{src.path}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    module.load_state_dict(loaded, strict=False, assign=True)


def _tied_keys(model: nn.Module) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    return {f"{n}.weight" for n, m in model.named_modules() if m is out}


def _outer_state(model: nn.Module, layers_path: str) -> dict[str, torch.Tensor]:
    """The tensors outside the decoder layers, tied ones once (as save_quantized writes them)."""
    out, seen = {}, set()
    for k, t in model.state_dict().items():
        if k.startswith(layers_path + ".") or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[k] = t.detach().to("cpu").contiguous()
    return out


def peaks(device: torch.device | None = None) -> dict[str, float]:
    """Peak resident memory of this process so far, and of the accelerator, in GiB."""
    out = {"rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device is not None and device.type == "cuda":
        out["gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _apply_max_memory(q: AwqQuantizer, max_memory: dict | None, act_bytes: int, layer_bytes: int) -> None:
    """Fit the search to a device budget: smaller candidate batches, activations parked on the CPU."""
    from fastawq.checkpoint import parse_size

    if not max_memory:
        return
    budget = None
    for key in (str(q.device), q.device.type, q.device.index):
        if key in max_memory:
            budget = parse_size(max_memory[key])
            break
    if budget is not None and q.device.type != "cpu":
        # The loss of a batch holds ~4 fp32 [candidates, N, K] temporaries.
        q.gpu_batch_elems = max(1 << 20, min(q.gpu_batch_elems, (budget - 3 * layer_bytes) // 24))
        if act_bytes * 2 + 3 * layer_bytes > budget // 2:
            q.offload = True
        log.info("max_memory %s: candidate batch %d elements, activations %s", _gib(budget),
                 q.gpu_batch_elems, "on the CPU between uses" if q.offload else "on the device")
    cpu = max_memory.get("cpu")
    if cpu is not None:
        need = 2 * layer_bytes + act_bytes * (2 if q.offload or q.device.type == "cpu" else 0)
        if need > parse_size(cpu):
            log.warning("max_memory cpu=%s is below the ~%s this run needs (two layers + activations)", cpu, _gib(need))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}GiB"


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS after each layer: glibc keeps freed blocks of up to
    32 MB in its arenas (its mmap threshold grows as large blocks are freed), so without this the
    resident size creeps up by a fraction of a layer per layer."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fault(i: int) -> None:
    if os.environ.get(FAULT_ENV) == str(i):
        os.kill(os.getpid(), signal.SIGKILL)


def _prepare_output(out: Path, journal: Journal, resume: bool, overwrite: bool) -> bool:
    """Make `out` ready; True when a partial run is resumed."""
    work = out / WORK_DIR
    if journal.exists() and resume:
        journal.load()
        log.info("resuming %s: %d layer(s) already done", out, journal.layers_done)
        return True
    if work.exists():
        shutil.rmtree(work)
    if out.exists() and any(out.iterdir()):
        # Streaming writes its shards into `out` as layers finish, so replacing a checkpoint there
        # would delete the old one before the new one is whole: refused, whatever overwrite says.
        raise FileExistsError(
            f"{out} is not empty: streaming quantization writes into a new or empty folder (it never deletes "
            f"a checkpoint before the new one is complete); choose another folder or empty this one"
            + ("" if not overwrite else " (overwrite=True applies to in-memory saves only)")
        )
    out.mkdir(parents=True, exist_ok=True)
    journal.start()
    return False


@torch.no_grad()
def quantize_streaming(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    quant_config: QuantConfig | dict | None = None,
    calib_data: Any = None,
    *,
    max_calib_samples: int = 128,
    max_calib_seq_len: int = 512,
    split: str = "train",
    text_column: str = "text",
    duo_scaling: bool = True,
    apply_clip: bool = True,
    n_parallel_calib_samples: int | None = None,
    device: torch.device | str | None = None,
    shard_size: int | str = "5GB",
    max_memory: dict | None = None,
    resume: bool = True,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    quantizer_cls: type[AwqQuantizer] | None = None,
) -> Path:
    """AWQ-quantize the model folder `src_dir` into the checkpoint folder `out_dir`, one decoder
    layer in memory at a time. With `resume` (default) a killed run continues where it stopped;
    under torch.distributed (torchrun) the calibration samples are split over the ranks."""
    from transformers import AutoConfig, AutoTokenizer

    from fastawq.calib import get_calib_dataset
    from fastawq.checkpoint import parse_size
    from fastawq.models import architecture_of
    from fastawq.quantize import distributed as dist

    t_start = time.perf_counter()
    cfg = QuantConfig.from_dict(quant_config)
    if not cfg.packable:
        raise ValueError(f"streaming writes packed 4-bit checkpoints; w_bit={cfg.w_bit} cannot be packed")
    src = SourceCheckpoint(src_dir)
    out = Path(out_dir)
    device = dist.init_from_env(device)  # under torchrun: join the group (a no-op when already joined)
    rank, world = dist.rank_world()
    config = AutoConfig.from_pretrained(str(src.path), trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{src.path / 'config.json'} has a quantization_config: the source must be a float model")
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tokenizer = None  # fine when calib_data is already token ids
    samples = get_calib_dataset(calib_data, tokenizer, max_calib_samples, max_calib_seq_len, split, text_column)
    dtype = _model_dtype(config, src)
    model = build_skeleton(config, dtype, trust_remote_code)
    arch = architecture_of(model)
    layers = model.get_submodule(arch.layers_path)
    n_layers = len(layers)
    _load_module(model, "", src, skip=(arch.layers_path + ".",), optional=_tied_keys(model))
    if _tied_keys(model):
        model.tie_weights()
    src.release()

    if quantizer_cls is None:
        quantizer_cls = dist.DistributedAwqQuantizer if world > 1 else AwqQuantizer
    q = quantizer_cls(model, cfg, dist.my_share(samples, rank, world), duo_scaling=duo_scaling, apply_clip=apply_clip,
                      n_parallel_calib_samples=n_parallel_calib_samples, device=device)
    layer_bytes = sum(src.nbytes_of(k) for k in src.weight_map if k.startswith(f"{arch.layers_path}.0."))
    act_bytes = samples.numel() // world * config.hidden_size * 4
    _apply_max_memory(q, max_memory, act_bytes, layer_bytes)

    fingerprint = {
        "source": file_fingerprint(src.files()),
        "quant_config": cfg.to_hf() | {"w_bit": cfg.w_bit},
        "search": {"duo_scaling": duo_scaling, "apply_clip": apply_clip, "n_grid": q.n_grid,
                   "max_shrink": q.max_shrink, "device_type": q.device.type, "world_size": world,
                   "chunk": q.chunk, "forward_dtype": str(q.forward_dtype)},
        "calibration": {"shape": list(samples.shape), "sha256": tensor_hash(samples)},
        "resumable": bool(resume),
    }
    journal = Journal(out, fingerprint)
    status = None
    if rank == 0:
        try:
            _prepare_output(out, journal, resume, overwrite)
            status = ("ok", journal.layers_done, journal.writer_state)
        except (ResumeError, FileExistsError) as e:
            status = (type(e).__name__, str(e), None)
    status = dist.broadcast_object(status)
    if status[0] != "ok":
        raise (ResumeError if status[0] == "ResumeError" else FileExistsError)(status[1])
    start = status[1]
    writer = ShardWriter(out, journal.work, parse_size(shard_size), status[2]) if rank == 0 else None

    with search_precision(q.device):
        inps, kwargs = q._capture_inputs(layers)
        if start:
            inps = journal.load_hidden(start, rank, torch.device("cpu") if q.offload else q.device)
            inps = [x.to(q.forward_dtype) for x in inps]
        bar = tqdm(range(start, n_layers), desc="AWQ (streaming)", unit="layer", initial=start, total=n_layers,
                   disable=rank != 0)
        for i in bar:
            t = time.perf_counter()
            _load_module(layers[i], f"{arch.layers_path}.{i}.", src)
            src.release()
            inps = q.quantize_layer(i, layers[i], inps, kwargs[i])
            if rank == 0:
                sd = layers[i].state_dict()
                writer.add({f"{arch.layers_path}.{i}.{k}": v for k, v in sd.items()})
                del sd
            layers[i].to("meta")  # frees the layer; its packed tensors are on disk
            _trim_heap()
            _fault(i)
            if resume and i + 1 < n_layers:
                journal.save_hidden(i + 1, rank, inps)
            dist.barrier()
            if rank == 0:
                journal.layers_done = i + 1
                _commit(journal, writer)
                journal.drop_hidden_before(i + 1)
            pk = peaks(q.device)
            bar.set_postfix({k: f"{v:.2f}" for k, v in pk.items()})
            log.info("layer %d/%d done in %.1fs; peak RSS %.2f GiB%s", i + 1, n_layers, time.perf_counter() - t,
                     pk["rss_gib"], f", GPU peak {pk['gpu_gib']:.2f} GiB" if "gpu_gib" in pk else "")
        bar.close()

    if rank == 0:
        if not writer.tail_written:  # a run killed inside this block must not add them twice
            writer.add(_outer_state(model, arch.layers_path))
            writer.roll(len(writer.pieces))
            writer.tail_written = True
            journal.writer_state = writer.state()
            journal.save()
        _remove_pieces(journal)
        writer.finish()
        _save_metadata(out, config, cfg, tokenizer, src.path)
        shutil.rmtree(journal.work, ignore_errors=True)
        write_manifest(out)  # last: the folder now loads as one checked checkpoint
        log.info("streamed %d layers to %s in %.1fs (%s)", n_layers, out, time.perf_counter() - t_start,
                 ", ".join(f"{k} {v:.1f}s" for k, v in q.timings.items()))
    dist.barrier()
    return out


def _commit(journal: Journal, writer: ShardWriter) -> None:
    """Record the finished layer, then gather pieces into a shard when they fill one."""
    journal.writer_state = writer.state()
    journal.save()
    if writer.full():
        writer.roll()
        journal.writer_state = writer.state()
        journal.save()
        _remove_pieces(journal)


def _remove_pieces(journal: Journal) -> None:
    """Piece files the journal no longer names (gathered into a shard, or left by a killed run)."""
    keep = {p["file"] for p in journal.writer_state.get("pieces", [])}
    keep |= {s["file"] for s in journal.writer_state.get("shards", [])}
    for p in journal.work.glob("piece-*.safetensors"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def _save_metadata(out: Path, config: Any, cfg: QuantConfig, tokenizer: Any, src: Path) -> None:
    config.quantization_config = cfg.to_hf()
    try:
        config.save_pretrained(str(out))
    finally:
        del config.quantization_config
    if (src / "generation_config.json").exists():
        shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))
