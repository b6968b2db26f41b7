"""Streaming quantization: a model larger than RAM and than the GPU, one decoder layer at a time.

The float checkpoint is read tensor by tensor from its safetensors shards (source.py), the model
is a skeleton on the meta device, and only the embeddings (for the calibration capture) and the
layer being searched are ever materialised; the next layer's tensors are read in a background
thread meanwhile. The tensors outside the layers are written to the output first and freed; each
finished layer is appended to its output shard at once (journal.ShardWriter: nothing is copied
later), on a second background thread that also
checkpoints the activations entering the next layer, so a killed run resumes bit-identically from
the last checkpoint. Checkpoints are taken as often as their writes hide behind the search.

    peak RAM ~ max(embeddings, two layers + a finished layer being written) [+ activations when
               they wait on the CPU]
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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from fastawq.atomic import write_manifest
from fastawq.quantize import SearchOptions
from fastawq.quantize.awq import AwqQuantizer, search_precision
from fastawq.quantize.config import QuantConfig
from fastawq.quantize.journal import WORK_DIR, Journal, ResumeError, ShardWriter, file_fingerprint, tensor_hash
from fastawq.quantize.source import LayerReader, SourceCheckpoint, expected_tensors, load_module

log = logging.getLogger(__name__)

# Test hook: kill this process with SIGKILL while layer N is being finished (after its piece is
# written, before the journal records it: the worst instant for a resume).
FAULT_ENV = "FASTAWQ_KILL_AT_LAYER"


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


def peaks(device: torch.device | None = None) -> dict[str, float]:
    """Peak resident memory of this process so far, and of the accelerator, in GiB."""
    out = {"rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device is not None and device.type == "cuda":
        out["gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _apply_max_memory(q: AwqQuantizer, max_memory: dict | None, act_bytes: int, layer_bytes: int) -> None:
    """Fit the search to a device budget: activations stay on the device while they fit in half of
    it (moving them to the CPU and back costs two copies per layer), and the candidate batches
    shrink to what the budget leaves."""
    from fastawq.checkpoint import parse_size

    if not max_memory:
        return
    budget = None
    for key in (str(q.device), q.device.type, q.device.index):
        if key in max_memory:
            budget = parse_size(max_memory[key])
            break
    if budget is not None and q.device.type != "cpu":
        # A layer's inputs and outputs coexist during its forward.
        if act_bytes * 2 + 3 * layer_bytes > budget // 2:
            q.offload = True
        resident = 0 if q.offload else 2 * act_bytes
        # The loss of a batch holds ~4 fp32 [candidates, N, K] temporaries.
        q.gpu_batch_elems = max(1 << 20, min(q.gpu_batch_elems, (budget - 3 * layer_bytes - resident) // 24))
        log.info("max_memory %s: candidate batch %d elements, activations %s", _gib(budget),
                 q.gpu_batch_elems, "on the CPU between uses" if q.offload else "on the device")
    cpu = max_memory.get("cpu")
    if cpu is not None:
        # The layer searched, the next one read ahead, the last one being written.
        need = 3 * layer_bytes + act_bytes * (2 if q.offload or q.device.type == "cpu" else 0)
        if need > parse_size(cpu):
            log.warning("max_memory cpu=%s is below the ~%s this run needs (three layers + activations)", cpu,
                        _gib(need))


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


def _timed(timings: dict[str, float], what: str, fn: Callable[[], None]) -> None:
    t = time.perf_counter()
    fn()
    _tick(timings, what, t)


def _tick(timings: dict[str, float], what: str, t0: float) -> float:
    dt = time.perf_counter() - t0
    timings[what] = timings.get(what, 0.0) + dt
    return dt


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
    shard_size: int | str = "5GB",
    max_memory: dict | None = None,
    resume: bool = True,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    quantizer_cls: type[AwqQuantizer] | None = None,
    prefetch: bool = True,
    checkpoint_every: int | None = None,
    **options: Any,
) -> Path:
    """AWQ-quantize the model folder `src_dir` into the checkpoint folder `out_dir`, one decoder
    layer in memory at a time; `options` are the SearchOptions fields, as quantize() takes them.

    With `resume` (default) a killed run continues from its last checkpoint of the activations:
    every `checkpoint_every` layers, or by default as often as the checkpoint's write hides behind
    the search (every layer where the search is slow, every few layers on a fast GPU). `prefetch`
    reads the next layer while the current one is searched. Under torch.distributed (torchrun)
    the calibration samples are split over the ranks."""
    from transformers import AutoConfig, AutoTokenizer

    from fastawq.checkpoint import parse_size
    from fastawq.models import architecture_of
    from fastawq.quantize import distributed as dist

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    cfg = QuantConfig.from_dict(quant_config)
    opts = SearchOptions.of("quantize_streaming", options)
    if not cfg.packable:
        raise ValueError(f"streaming writes packed 4-bit checkpoints; w_bit={cfg.w_bit} cannot be packed")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every}: give a number of layers >= 1, or None")
    src = SourceCheckpoint(src_dir)
    out = Path(out_dir)
    opts.device = dist.init_from_env(opts.device)  # under torchrun: join the group (a no-op when already joined)
    rank, world = dist.rank_world()
    config = AutoConfig.from_pretrained(str(src.path), trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{src.path / 'config.json'} has a quantization_config: the source must be a float model")
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tokenizer = None  # fine when calib_data is already token ids
    samples = opts.samples(calib_data, tokenizer)
    dtype = _model_dtype(config, src)
    model = build_skeleton(config, dtype, trust_remote_code)
    arch = architecture_of(model)
    lp = arch.layers_path
    layers = model.get_submodule(lp)
    n_layers = len(layers)
    _load_outer(model, lp, src)

    if quantizer_cls is None:
        quantizer_cls = dist.DistributedAwqQuantizer if world > 1 else AwqQuantizer
    q = opts.quantizer(quantizer_cls, model, cfg, dist.my_share(samples, rank, world))
    layer_bytes = sum(src.nbytes_of(k) for k in src.weight_map if k.startswith(f"{lp}.0."))
    act_bytes = samples.numel() // world * config.hidden_size * (q.forward_dtype or dtype).itemsize
    _apply_max_memory(q, max_memory, act_bytes, layer_bytes)

    fingerprint = {
        "source": file_fingerprint(src.files()),
        "quant_config": cfg.to_hf() | {"w_bit": cfg.w_bit},
        "search": {"duo_scaling": opts.duo_scaling, "apply_clip": opts.apply_clip, "n_grid": q.n_grid,
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
    if world > 1:
        # Every rank checkpoints at the same layers, and the collectives stay on the main thread.
        checkpoint_every = checkpoint_every or 1

    def finish(i: int, sd: dict[str, torch.Tensor] | None, hidden: list[torch.Tensor] | None, commit: bool) -> None:
        """Layer i's output: its piece, then (at a checkpoint) the activations entering layer
        i + 1 and the journal entry that makes both count."""
        t = time.perf_counter()
        if sd is not None:
            writer.add(sd)
        _tick(timings, "w_layers", t)
        _fault(i)
        if hidden is not None:
            t = time.perf_counter()
            journal.save_hidden(i + 1, rank, hidden)
            finisher.hidden_seconds = _tick(timings, "w_checkpoints", t)
        if commit:
            dist.barrier()
            if rank == 0:
                t = time.perf_counter()
                journal.layers_done = i + 1
                _commit(journal, writer)
                journal.drop_hidden_before(i + 1)
                _tick(timings, "w_journal", t)

    reader = LayerReader(src, n_layers, lambda j: expected_tensors(layers[j], f"{lp}.{j}."), prefetch)
    finisher = _Finisher(background=world == 1)
    try:
        with search_precision(q.device):
            t = time.perf_counter()
            inps, kwargs = q._capture_inputs(layers)
            _tick(timings, "capture", t)
            outer = _release_outer(model, lp, src, writer, journal)
            if outer is not None:  # written while the first layer is searched
                finisher.submit(_timed, timings, "w_outer_tensors", outer)
            if start and start < n_layers:  # (a run killed while finishing the folder has none to load)
                inps = journal.load_hidden(start, rank, torch.device("cpu") if q.offload else q.device)
                inps = [x.to(q.forward_dtype) for x in inps]
            bar = tqdm(range(start, n_layers), desc="AWQ (streaming)", unit="layer", initial=start,
                       total=n_layers, disable=rank != 0)
            since = 0.0  # search time since the last checkpoint
            for i in bar:
                t = time.perf_counter()
                load_module(layers[i], f"{lp}.{i}.", reader.take(i))
                t_search = time.perf_counter()
                _tick(timings, "read_wait", t)
                inps = q.quantize_layer(i, layers[i], inps, kwargs[i])
                _tick(timings, "search", t_search)
                sd = {f"{lp}.{i}.{k}": v for k, v in layers[i].state_dict().items()} if rank == 0 else None
                layers[i].to("meta")  # the piece writer holds the packed tensors until they are on disk
                since += time.perf_counter() - t
                last = i + 1 == n_layers
                if not resume or last:
                    commit = True
                elif checkpoint_every:
                    commit = (i + 1 - start) % checkpoint_every == 0
                else:
                    # The write (timed last time) overlaps the next layers' search, and takes at most
                    # a quarter of the writer thread's time: the layers' own bytes need the rest.
                    commit = since >= 4 * finisher.hidden_seconds
                t_wait = time.perf_counter()
                finisher.submit(finish, i, sd, inps if commit and resume and not last else None, commit)
                _tick(timings, "write_wait", t_wait)
                del sd
                if commit:
                    since = 0.0
                _trim_heap()
                pk = peaks(q.device)
                bar.set_postfix({k: f"{v:.2f}" for k, v in pk.items()})
                log.info("layer %d/%d done in %.1fs%s; peak RSS %.2f GiB%s", i + 1, n_layers,
                         time.perf_counter() - t, " (checkpoint)" if commit and not last else "", pk["rss_gib"],
                         f", GPU peak {pk['gpu_gib']:.2f} GiB" if "gpu_gib" in pk else "")
            bar.close()
    finally:
        reader.close()
        t = time.perf_counter()
        finisher.close()
        _tick(timings, "write_wait", t)

    t = time.perf_counter()
    if rank == 0:
        writer.close_open()
        journal.writer_state = writer.state()
        journal.save()
        writer.finish()
        _save_metadata(out, config, cfg, tokenizer, src.path)
        shutil.rmtree(journal.work, ignore_errors=True)
        write_manifest(out)  # last: the folder now loads as one checked checkpoint
        _tick(timings, "final_header_and_manifest", t)
        timings.update({f"search_{k}": v for k, v in q.timings.items()})
        log.info("streamed %d layers to %s in %.1fs; seconds (w_ = on the writer thread): %s", n_layers, out,
                 time.perf_counter() - t_start, json.dumps({k: round(v, 2) for k, v in timings.items()}))
    dist.barrier()
    return out


class _Finisher:
    """Runs the layers' output jobs in order on one background thread, at most one job behind the
    search (or inline when `background` is False): the job of layer i holds its packed tensors and
    references the activations entering layer i + 1, which the search of layer i + 1 reads too."""

    def __init__(self, background: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastawq-writer") if background else None
        self._job: Future | None = None
        self.hidden_seconds = 0.0  # how long the last activation checkpoint took to write

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self.wait()
        if self._pool is None:
            fn(*args)
        else:
            self._job = self._pool.submit(fn, *args)

    def wait(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _load_outer(model: nn.Module, layers_path: str, src: SourceCheckpoint) -> None:
    """Materialise what the calibration capture runs: the tensors outside the decoder layers,
    except an output head that is not tied (the capture stops before it; it is copied to the
    output later, a tensor at a time)."""
    from fastawq.checkpoint import _tied_names

    tied = _tied_names(model)
    skip = (layers_path + ".",)
    head = model.get_output_embeddings()
    if not tied and head is not None:
        skip += tuple(f"{n}." for n, m in model.named_modules() if m is head)
    load_module(model, "", src.read(expected_tensors(model, "", skip), optional=tied))
    if tied:
        model.tie_weights()


def _release_outer(model: nn.Module, layers_path: str, src: SourceCheckpoint, writer: ShardWriter | None,
                   journal: Journal) -> Callable[[], None] | None:
    """Free the tensors outside the decoder layers (from here on, RAM holds layers only) and return
    the job that writes them as the first piece, tied ones once as save_quantized writes them,
    read again from the source a tensor at a time (None when nothing is left to write)."""
    from fastawq.checkpoint import untied

    state = {k: t for k, t in untied(model.state_dict()).items() if not k.startswith(layers_path + ".")}
    entries = []
    if writer is not None and not writer.tail_written:
        for k, t in state.items():
            shape, dt = tuple(t.shape), t.dtype
            if k in src.weight_map:
                get = lambda k=k, shape=shape, dt=dt: src.read({k: (shape, dt)})[k]  # noqa: E731
            elif t.device.type == "meta":
                raise ValueError(f"{src.path}: checkpoint lacks tensor {k!r}")
            else:  # a persistent buffer the model computes
                get = lambda t=t: t  # noqa: E731
            entries.append((k, dt, list(shape), get))
    state = t = None  # the model's last references go in _free_outer
    _free_outer(model, layers_path)
    _trim_heap()
    if not entries:
        return None

    def job() -> None:
        writer.add_entries(entries)
        writer.tail_written = True
        journal.writer_state = writer.commit_state()
        journal.save()

    return job


def _free_outer(model: nn.Module, layers_path: str) -> None:
    for name, mod in model.named_modules():
        if name == layers_path or name.startswith(layers_path + "."):
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.device.type != "meta":
                mod._parameters[pname] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)


def _commit(journal: Journal, writer: ShardWriter) -> None:
    """Record the finished layers: the shard bytes reach the disk before the journal counts them."""
    journal.writer_state = writer.commit_state()
    journal.save()


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
