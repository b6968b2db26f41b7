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

    def __init__(self, model: nn.Module, quant_config: QuantConfig | None = None, tokenizer: Any = None):
        super().__init__()
        self.model = model
        self.quant_config = quant_config or QuantConfig()
        self.tokenizer = tokenizer
        self.is_quantized = bool(getattr(model, "fastawq_packed", False))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
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
        """AutoAWQ's quantize(); calib_data=None (or "pileval") uses fastawq's offline text."""
        if kwargs:
            log.warning("ignoring AutoAWQ arguments fastawq does not use: %s", sorted(kwargs))
        if max_chunk_memory is not None:
            log.info("max_chunk_memory is not needed: the search works on Gram matrices, not on activations")
        self.quant_config = QuantConfig.from_dict(quant_config)
        self.tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        _quantize(
            self.model, self.tokenizer, self.quant_config, calib_data,
            max_calib_samples=max_calib_samples, max_calib_seq_len=max_calib_seq_len, split=split,
            text_column=text_column, duo_scaling=duo_scaling, apply_clip=apply_clip,
            export_compatible=export_compatible, n_parallel_calib_samples=n_parallel_calib_samples,
            device=device, quantizer_cls=quantizer_cls,
        )
        self.is_quantized = bool(getattr(self.model, "fastawq_packed", False))

    @torch.no_grad()
    def pack(self) -> None:
        """Pack the weights after quantize(export_compatible=True)."""
        pack_model(self.model, self.quant_config)
        self.is_quantized = True

    def save_quantized(
        self, save_dir: str | os.PathLike, safetensors: bool = True, shard_size: int | str = "5GB",
        overwrite: bool = False,
    ) -> None:
        from fastawq.checkpoint import save_quantized

        if not safetensors:
            raise ValueError("fastawq writes only safetensors checkpoints")
        save_quantized(self.model, save_dir, self.quant_config, self.tokenizer, shard_size=shard_size, overwrite=overwrite)


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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fastawq.models import architecture_of

        if not safetensors:
            raise ValueError("fastawq reads only safetensors weights")
        kwargs = dict(model_init_kwargs)
        kwargs["dtype"] = _resolve_dtype(torch_dtype)
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), trust_remote_code=trust_remote_code, use_safetensors=True,
            low_cpu_mem_usage=low_cpu_mem_usage, **kwargs,
        )
        model.eval()
        architecture_of(model)  # fail early on an unsupported architecture
        try:
            tok = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tok = None
        return AWQModel(model, tokenizer=tok)

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
        cpu_lm_head_bits: int | None = None,
        max_memory: dict | None = None,
        offload_folder: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> AWQModel:
        """Load an AWQ checkpoint (fastawq's or AutoAWQ's) ready for generate().

        On the CPU, `use_ipex=True` makes the packed layers inference-only modules that call the
        CPU kernel directly, and `cpu_lm_head_bits=8` (with it) also runs the float lm_head as an
        8-bit layer: about +0.15% perplexity on SmolLM2-135M for 1.7x its decode speed
        (benchmarks/CPU_RESULTS.md); it is not AWQ's recipe, so it is off by default."""
        from fastawq.checkpoint import load_quantized

        if not safetensors:
            raise ValueError("fastawq reads only safetensors checkpoints")
        if use_exllama or use_exllama_v2:
            log.info("use_exllama* ignored: fastawq's own kernels serve every backend")
        if kwargs:
            log.warning("ignoring from_quantized arguments fastawq does not use: %s", sorted(kwargs))
        from fastawq.dispatch import main_device, spans_devices

        # Several devices (or CPU + disk): accelerate's dispatch places whole decoder layers.
        spread = not use_ipex and spans_devices(device_map, max_memory, offload_folder)
        if spread and fuse_layers:
            raise ValueError("fuse_layers=True needs the whole model on one device; drop device_map/max_memory/offload_folder")
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
                                   trust_remote_code=trust_remote_code)
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
                    m.backend = backend
        auto_fuse = fuse_layers is None
        if auto_fuse:
            # AutoAWQ fuses by default; fastawq does on GPUs where the fused modules exist.
            import importlib.util

            fuse_layers = device.type == "cuda" and importlib.util.find_spec("fastawq.modules.fused") is not None
        if fuse_layers:
            try:
                from fastawq.modules.fused import fuse_model
            except ImportError as e:
                raise ImportError(f"fuse_layers=True needs fastawq.modules.fused, which failed to import: {e}") from e
            try:
                model = fuse_model(model, max_seq_len=max_seq_len, batch_size=batch_size)
            except NotImplementedError as e:
                if not auto_fuse:
                    raise
                log.info("not fusing layers: %s", e)
        if use_ipex and backend is None and not fuse_layers:
            # AutoAWQ's IPEX path makes inference-only CPU modules; so does this one: each packed
            # layer holds only its repacked weight and calls the kernel directly (no per-call
            # dispatch, ~10 us of a small model's ~20 us per layer call; benchmarks/CPU_RESULTS.md).
            from fastawq import cpu

            count = cpu.convert_model(model, lm_head_bits=cpu_lm_head_bits)
            log.info("use_ipex=True: %d packed layers converted for the CPU", count)
        elif cpu_lm_head_bits is not None:
            raise ValueError("cpu_lm_head_bits needs use_ipex=True on the CPU (and no fused layers or forced backend)")
        tok = None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(quant_path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            pass
        return AWQModel(model, qc, tok)


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
