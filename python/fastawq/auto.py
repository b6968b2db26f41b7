"""AutoAWQ's API, unchanged for its users: AutoAWQForCausalLM.from_pretrained(...).quantize(...)
.save_quantized(...), and AutoAWQForCausalLM.from_quantized(...).generate(...)."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from fastawq.quantize import AwqQuantizer, QuantConfig, pack_model
from fastawq.quantize import quantize as _quantize

log = logging.getLogger(__name__)


def _resolve_dtype(torch_dtype: Any) -> Any:
    if isinstance(torch_dtype, str) and torch_dtype != "auto":
        return getattr(torch, torch_dtype)
    return torch_dtype


class AWQModel(nn.Module):
    """A transformers causal LM plus its quant config. Attributes and calls it does not define
    (generate, config, device, ...) go to the wrapped model."""

    def __init__(self, model: nn.Module, quant_config: QuantConfig | None = None, tokenizer: Any = None,
                 processor: Any = None):
        super().__init__()
        from fastawq.multimodal import repair_forward

        self.model = repair_forward(model)
        self.quant_config = quant_config or QuantConfig()
        self.tokenizer = tokenizer
        self.processor = processor  # vision-language models: tokenizer + image processor + chat template
        self.is_quantized = bool(getattr(model, "fastawq_packed", False))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        from fastawq.generate import check_input_ids

        ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            check_input_ids(ids, self.model)
        with torch.inference_mode():
            return self.model.generate(*args, **kwargs)

    @torch.no_grad()
    def quantize(
        self,
        tokenizer: Any = None,
        quant_config: dict | QuantConfig | None = None,
        calib_data: Any = None,
        split: str = "train",
        text_column: str = "text",
        duo_scaling: bool = True,
        export_compatible: bool = False,
        apply_clip: bool = True,
        n_parallel_calib_samples: int | None = None,
        max_calib_samples: int = 128,
        max_calib_seq_len: int = 512,
        max_chunk_memory: int | None = None,
        quantizer_cls: type[AwqQuantizer] = AwqQuantizer,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        """AutoAWQ's quantize(); calib_data=None (or "pileval") uses fastawq's offline text.

        Everything is validated before any work. An interrupted run (an error or Ctrl-C) leaves
        the model marked partial (`fastawq_state == "partial"`): save_quantized refuses it."""
        if kwargs:
            log.warning("ignoring AutoAWQ arguments fastawq does not use: %s", sorted(kwargs))
        if max_chunk_memory is not None:
            log.info("max_chunk_memory is not needed: the search works on Gram matrices, not on activations")
        state = getattr(self.model, "fastawq_state", None)
        if state == "partial":
            raise RuntimeError("an earlier quantize() was interrupted and left this model half-packed: reload the "
                               "float model (AutoAWQForCausalLM.from_pretrained) and quantize it again")
        if self.is_quantized or state in ("quantized", "scaled", "pseudo") or _has_packed(self.model):
            raise RuntimeError("this model is already quantized; quantize() needs the float model "
                               "(AutoAWQForCausalLM.from_pretrained)")
        from fastawq import multimodal

        config = QuantConfig.from_dict(quant_config)
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        multimodal.add_full_precision_modules(self.model, config)
        pairs = multimodal.as_pairs(calib_data, text_column)
        if pairs is None:
            _check_quantize_args(self.model, config, tokenizer, calib_data, max_calib_samples, max_calib_seq_len,
                                 export_compatible)
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but torch sees no CUDA device")
        self.quant_config = config
        self.tokenizer = tokenizer
        self.model.fastawq_state = "partial"
        if pairs is not None:
            multimodal.quantize_pairs(
                self.model, self.processor, self.quant_config, pairs, max_calib_samples=max_calib_samples,
                duo_scaling=duo_scaling, apply_clip=apply_clip, export_compatible=export_compatible,
                n_parallel_calib_samples=n_parallel_calib_samples, device=device,
            )
        else:
            _quantize(
                self.model, self.tokenizer, self.quant_config, calib_data,
                max_calib_samples=max_calib_samples, max_calib_seq_len=max_calib_seq_len, split=split,
                text_column=text_column, duo_scaling=duo_scaling, apply_clip=apply_clip,
                export_compatible=export_compatible, n_parallel_calib_samples=n_parallel_calib_samples,
                device=device, quantizer_cls=quantizer_cls,
            )
        _check_quantized(self.model, config, export_compatible)
        self.model.fastawq_state = (
            "scaled" if export_compatible else "quantized" if config.packable else "pseudo"
        )
        self.is_quantized = bool(getattr(self.model, "fastawq_packed", False))

    @torch.no_grad()
    def pack(self) -> None:
        """Pack the weights after quantize(export_compatible=True)."""
        if getattr(self.model, "fastawq_state", None) == "partial":
            raise RuntimeError("the model is partially quantized (an interrupted quantize()); reload and quantize again")
        self.model.fastawq_state = "partial"
        pack_model(self.model, self.quant_config)
        _check_quantized(self.model, self.quant_config, False)
        self.model.fastawq_state = "quantized"
        self.is_quantized = True

    def save_quantized(
        self, save_dir: str | os.PathLike, safetensors: bool = True, shard_size: int | str = "5GB",
        overwrite: bool = False,
    ) -> None:
        from fastawq.checkpoint import save_quantized

        if not safetensors:
            raise ValueError("fastawq writes only safetensors checkpoints")
        if getattr(self.model, "fastawq_state", None) == "scaled":
            # After quantize(export_compatible=True): the scaled float model, for GGUF export.
            from fastawq.gguf_export import save_scaled_float

            save_scaled_float(self.model, save_dir, self.processor or self.tokenizer, shard_size=shard_size,
                              overwrite=overwrite)
            return
        save_quantized(self.model, save_dir, self.quant_config, self.processor or self.tokenizer, shard_size=shard_size,
                       overwrite=overwrite)


def _device_of(device_map: Any) -> torch.device:
    if device_map in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, dict):
        devs = set(device_map.values())
        if len(devs) != 1:
            raise ValueError(f"fastawq places the whole model on one device; got device_map {device_map}")
        device_map = devs.pop()
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)


class AutoAWQForCausalLM:
    """Entry points; never instantiated (as in AutoAWQ)."""

    def __init__(self) -> None:
        raise EnvironmentError("use AutoAWQForCausalLM.from_pretrained or AutoAWQForCausalLM.from_quantized")

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike,
        torch_dtype: Any = "auto",
        device_map: Any = None,
        trust_remote_code: bool = False,
        low_cpu_mem_usage: bool = True,
        safetensors: bool = True,
        **model_init_kwargs: Any,
    ) -> AWQModel:
        """Load a float model to quantize (on the CPU unless device_map says otherwise: the
        quantizer moves one layer at a time to the accelerator)."""
        from fastawq.checkpoint import check_local_path

        if not safetensors:
            raise ValueError("fastawq reads only safetensors weights")
        local = check_local_path(model_path)  # before the slow imports: a typo fails at once
        from transformers import AutoConfig, AutoTokenizer

        from fastawq import multimodal
        from fastawq.models import architecture_of

        from fastawq.hub import resolve

        model_path = resolve(model_path, model_init_kwargs.pop("revision", None), trust_remote_code=trust_remote_code)
        kwargs = dict(model_init_kwargs)
        kwargs["dtype"] = _resolve_dtype(torch_dtype)
        if device_map is not None:
            kwargs["device_map"] = device_map
        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        model = multimodal.auto_model_class(config).from_pretrained(
            str(model_path), trust_remote_code=trust_remote_code, use_safetensors=True,
            low_cpu_mem_usage=low_cpu_mem_usage, **kwargs,
        )
        model.eval()
        architecture_of(model)  # fail early on an unsupported architecture
        multimodal.check_language_model(model)
        processor = None
        if multimodal.is_multimodal(model.config):
            processor = multimodal.load_processor(model_path, trust_remote_code)
        model.fastawq_state = "float"
        if local is not None:
            model.fastawq_source = str(local)
        try:
            tok = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tok = getattr(processor, "tokenizer", None)
        return AWQModel(model, tokenizer=tok, processor=processor)

    @classmethod
    def quantize_streaming(cls, src_dir: str | os.PathLike, out_dir: str | os.PathLike, tokenizer: Any = None,
                           quant_config: dict | QuantConfig | None = None, calib_data: Any = None,
                           **kwargs: Any) -> Any:
        """Quantize the model folder `src_dir` into `out_dir` one decoder layer at a time, resuming
        a killed run (fastawq.quantize.stream.quantize_streaming has the options)."""
        from fastawq.quantize.stream import quantize_streaming

        return quantize_streaming(src_dir, out_dir, tokenizer, quant_config, calib_data, **kwargs)

    @classmethod
    def from_quantized(
        cls,
        quant_path: str | os.PathLike,
        quant_filename: str = "",
        max_seq_len: int = 2048,
        trust_remote_code: bool = False,
        fuse_layers: bool | None = None,
        use_exllama: bool = False,
        use_exllama_v2: bool = False,
        use_ipex: bool = False,
        batch_size: int = 1,
        safetensors: bool = True,
        device_map: Any = "auto",
        torch_dtype: Any = None,
        backend: str | None = None,
        cpu_lm_head_bits: int | None | str = "auto",
        verify: str | None = None,
        max_memory: dict | None = None,
        offload_folder: str | os.PathLike | None = None,
        layout: str = "auto",
        **kwargs: Any,
    ) -> AWQModel:
        """Load an AWQ checkpoint (fastawq's or AutoAWQ's) ready for generate().

        layout: how the quantized layers hold their weights in memory: "awq" (the checkpoint's
        layout), "packed" (repacked at load for the decode kernel, exactly; see WQLinear.set_layout)
        or "auto" (backend.preferred_layout: packed for the fused engine on a GPU at batch_size
        <= 4, else awq). Routed experts follow a packed model on a GPU with the packed-expert
        kernels (backend.experts_layout). Saving always writes AWQ GEMM.

        On the CPU, `fuse_layers=True` (or, with `fuse_layers=None`, FASTAWQ_CPU_FUSE=1) fuses the
        layers where the fused engine serves the model type: decode runs fused_cpu.CPUDecodeStep
        (one C++ call per layer). `use_ipex=True` instead makes the packed layers inference-only
        modules that call the CPU kernel directly. `cpu_lm_head_bits=8` runs the float lm_head as an
        8-bit layer: about +0.15% perplexity on SmolLM2-135M for about 2x its fused decode speed
        (benchmarks/CPU_RESULTS.md); None keeps it float; "auto" (default) is the fused engine's
        default (8) when fused on the CPU and None with use_ipex (AWQ's recipe keeps it float).
        verify: "full" (default: sizes and sha256 against the checkpoint's manifest), "size" or
        "off"; FASTAWQ_VERIFY sets the default."""
        from fastawq.checkpoint import load_quantized

        if not safetensors:
            raise ValueError("fastawq reads only safetensors checkpoints")
        from fastawq.modules.qlinear import LAYOUTS, set_layout

        if layout not in (*LAYOUTS, "auto"):
            raise ValueError(f"layout must be one of {LAYOUTS} or 'auto', got {layout!r}")
        if use_ipex and layout == "packed":
            raise ValueError("use_ipex=True makes CPU modules of the AWQ layout; layout='packed' serves CUDA devices")
        if isinstance(cpu_lm_head_bits, str) and cpu_lm_head_bits != "auto":
            raise ValueError(f"cpu_lm_head_bits must be 8, 4, None or 'auto', got {cpu_lm_head_bits!r}")
        from fastawq.hub import resolve

        quant_path = resolve(quant_path, kwargs.pop("revision", None), trust_remote_code=trust_remote_code)
        if use_exllama or use_exllama_v2:
            log.info("use_exllama* ignored: fastawq's own kernels serve every backend")
        if kwargs:
            log.warning("ignoring from_quantized arguments fastawq does not use: %s", sorted(kwargs))
        from fastawq.dispatch import main_device, spans_devices

        # Several devices (or CPU + disk): accelerate's dispatch places whole decoder layers.
        spread = not use_ipex and spans_devices(device_map, max_memory, offload_folder)
        if spread and fuse_layers:
            raise ValueError("fuse_layers=True needs the whole model on one device; drop device_map/max_memory/offload_folder")
        if spread and layout == "packed":
            raise ValueError("layout='packed' needs the whole model on one device (dispatched layers move and "
                             "offload the checkpoint's AWQ tensors); drop device_map/max_memory/offload_folder")
        fuse_layers = False if spread else fuse_layers
        device = _device_of("cpu" if use_ipex else (main_device(device_map) if spread else device_map))
        if use_ipex:
            log.info("use_ipex=True: fastawq's own CPU kernels serve it (IPEX is not used); the packed "
                     "layers become inference-only CPUInt4Linear modules")
        dtype = _resolve_dtype(torch_dtype)
        if dtype in (None, "auto"):
            # CPU matmuls are fast in fp32 / bf16 and slow in fp16; the packed scales stay as saved.
            dtype = torch.float32 if device.type == "cpu" else None
        model, qc = load_quantized(quant_path, dtype=None if device.type == "cpu" else dtype,
                                   trust_remote_code=trust_remote_code, verify=verify)
        if device.type == "cpu" and dtype is not None:
            _cast_float_params(model, dtype)
        if spread:
            from fastawq.dispatch import dispatch

            dispatch(model, device_map, max_memory, None if offload_folder is None else str(offload_folder))
        else:
            model.to(device)
        if backend is not None:
            from fastawq.modules import WQLinear

            for m in model.modules():
                if isinstance(m, WQLinear):
                    m.set_backend(backend)
        auto_fuse = fuse_layers is None
        if auto_fuse:
            # AutoAWQ fuses by default; fastawq does on GPUs where the fused modules exist.
            import importlib.util

            fuse_layers = device.type == "cuda" and importlib.util.find_spec("fastawq.modules.fused") is not None
            if device.type == "cpu" and not use_ipex and backend is None and os.environ.get("FASTAWQ_CPU_FUSE") == "1":
                # The fused CPU engine (modules/fused_cpu.py) where the model type has one: opt-in
                # for now (an unfused CPU load is what callers of batch > batch_size rely on).
                from fastawq import cpu

                fuse_layers = cpu.fast_kernel_available() is None
        if fuse_layers:
            try:
                from fastawq.modules.fused import fuse_model
            except ImportError as e:
                raise ImportError(f"fuse_layers=True needs fastawq.modules.fused, which failed to import: {e}") from e
            from fastawq import multimodal

            if multimodal.is_multimodal(model.config):  # fuses the language model behind the vision tower
                fuse_model = multimodal.fuse_model
            try:
                extra = {"cpu_lm_head_bits": cpu_lm_head_bits} if device.type == "cpu" and cpu_lm_head_bits != "auto" else {}
                model = fuse_model(model, max_seq_len=max_seq_len, batch_size=batch_size, backend=backend, **extra)
            except NotImplementedError as e:
                if not auto_fuse:
                    raise
                log.info("not fusing layers: %s", e)
                fuse_layers = False
        if device.type == "cuda" and not fuse_layers:
            # Unfused decode meets a new KV length every step, and cuDNN's SDPA plans each one.
            from fastawq.integrations.transformers import use_sdpa_without_cudnn

            use_sdpa_without_cudnn(model)
        if layout == "auto":
            from fastawq.backend import preferred_layout

            # A forced backend keeps the checkpoint's layout (its kernels may not read the packed one).
            layout = "awq" if backend is not None else preferred_layout(device, batch_size if fuse_layers else None)
        if layout != "awq" and not use_ipex:
            # After fusing: the fused engine concatenates the layers' AWQ tensors, then they convert.
            set_layout(model, layout)
        if use_ipex and backend is None and not fuse_layers:
            # AutoAWQ's IPEX path makes inference-only CPU modules; so does this one: each packed
            # layer holds only its repacked weight and calls the kernel directly (no per-call
            # dispatch, ~10 us of a small model's ~20 us per layer call; benchmarks/CPU_RESULTS.md).
            from fastawq.modules.cpu_linear import convert_model

            count = convert_model(model, lm_head_bits=None if cpu_lm_head_bits == "auto" else cpu_lm_head_bits)
            log.info("use_ipex=True: %d packed layers converted for the CPU", count)
        elif cpu_lm_head_bits not in (None, "auto") and not (fuse_layers and device.type == "cpu"):
            raise ValueError("cpu_lm_head_bits needs the fused CPU engine (fuse_layers=True) or use_ipex=True on "
                             "the CPU, and no forced backend")
        tok = None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(quant_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            pass
        from fastawq import multimodal

        processor = None
        if multimodal.is_multimodal(model.config):
            processor = multimodal.load_processor(quant_path, trust_remote_code)
        return AWQModel(model, qc, tok if tok is not None else getattr(processor, "tokenizer", None), processor)


def _has_packed(model: nn.Module) -> bool:
    from fastawq.modules import WQLinear

    return any(isinstance(m, WQLinear) for m in model.modules())


def _check_quantize_args(model: nn.Module, config: QuantConfig, tokenizer: Any, calib: Any, n_samples: Any,
                         seq_len: Any, export_compatible: bool) -> None:
    """Everything quantize() can check before the first layer is searched."""
    from pathlib import Path, PurePath

    from fastawq.checkpoint import looks_local
    from fastawq.models.moe import moe_spec_of
    from fastawq.quantize.pack import layers_of, target_linears

    for name, v in (("max_calib_samples", n_samples), ("max_calib_seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    prefix, layers = layers_of(model)
    spec = moe_spec_of(model)
    # Routers (and shared-expert gates) stay full precision: the MoE search adds them to
    # modules_to_not_convert only once it starts, so they are not checked for packing here
    # (a router over 4 or 60 experts has out_features no multiple of 8).
    floats = {f"{prefix}.{i}.{spec.block}.{n}" for i, layer in enumerate(layers) if spec.block_of(layer) is not None
              for n in spec.float_consumers()} if spec is not None else set()
    targets = [(f"{prefix}.{i}.{n}", m) for i, layer in enumerate(layers)
               for n, m in target_linears(layer, f"{prefix}.{i}", config) if f"{prefix}.{i}.{n}" not in floats]
    if not targets:
        raise ValueError(f"modules_to_not_convert={config.modules_to_not_convert} excludes every linear layer: "
                         f"nothing would be quantized")
    for name, lin in targets:
        config.group_size_for(name, lin.in_features)  # names the layer no group size fits
        if config.packable and lin.out_features % 8:
            raise ValueError(f"layer {name}: out_features={lin.out_features} is not divisible by 8, so it cannot "
                             f"be packed; list it in modules_to_not_convert")
    if config.packable and not export_compatible:
        # Packed scales are fp16 for fp32 models: a group whose range / 15 exceeds fp16's max packs to inf.
        for name, lin in targets:
            w = lin.weight.detach()
            if w.dtype == torch.float32 and float(w.abs().max()) * 2 / 15 > torch.finfo(torch.float16).max:
                raise ValueError(f"layer {name}: weights up to {float(w.abs().max()):.3g} overflow fp16 scales; "
                                 f"cast the model to bfloat16 first")
    vocab = model.get_input_embeddings().num_embeddings
    if isinstance(calib, (str, PurePath)):
        s = str(calib)
        looks_file = s.endswith((".txt", ".jsonl", ".json")) or looks_local(calib)
        if s not in ("default", "pileval", "stdlib") and looks_file and not Path(s).exists():
            raise FileNotFoundError(f"calibration file {s} does not exist")
        texts = Path(s).exists() or s in ("default", "pileval", "stdlib")
        if texts and tokenizer is None:
            raise ValueError("text calibration data needs a tokenizer: pass tokenizer= or token ids")
        return
    if calib is None:
        if tokenizer is None:
            raise ValueError("calibration with fastawq's default text needs a tokenizer: pass tokenizer= or "
                             "calib_data as token ids")
        return
    if isinstance(calib, torch.Tensor):
        if calib.dim() != 2 or calib.is_floating_point() or calib.dtype == torch.bool or calib.numel() == 0:
            raise ValueError(f"calib_data tensor must be non-empty [n, seq_len] integer token ids, got "
                             f"{calib.dtype} {tuple(calib.shape)}")
        lo, hi = int(calib.min()), int(calib.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"calib_data holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab})")
        return
    if isinstance(calib, (list, tuple)):
        if not calib:
            raise ValueError("calib_data is an empty list")
        if all(isinstance(t, str) for t in calib):
            if not any(t.strip() for t in calib):
                raise ValueError("calib_data holds only empty strings")
            if tokenizer is None:
                raise ValueError("text calibration data needs a tokenizer: pass tokenizer= or token ids")
            return
        for i, seq in enumerate(calib):
            if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)):
                raise ValueError(f"calib_data[{i}] is {type(seq).__name__}: give all strings or all token-id lists")
            for t in seq:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"calib_data[{i}] holds {t!r}, not a token id in [0, {vocab})")


def _check_quantized(model: nn.Module, config: QuantConfig, export_compatible: bool) -> None:
    """After the search: every packed scale finite and at least one layer packed."""
    from fastawq.modules import WQLinear

    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, WQLinear)]
    if config.packable and not export_compatible and not packed:
        raise RuntimeError("quantize() packed no layer; check modules_to_not_convert")
    for n, m in packed:
        if not bool(torch.isfinite(m.scales).all()):
            raise FloatingPointError(f"layer {n}: packed scales overflowed to inf/NaN ({m.scales.dtype}); "
                                     f"quantize the model in bfloat16")


def _cast_float_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Everything but the packed layers' buffers to `dtype`."""
    from fastawq.modules import WQLinear

    packed = {id(t) for m in model.modules() if isinstance(m, WQLinear) for t in m.buffers()}
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.is_floating_point() and id(p) not in packed:
                p.data = p.data.to(dtype)
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and id(b) not in packed and not isinstance(m, WQLinear):
                m._buffers[name] = b.to(dtype)
