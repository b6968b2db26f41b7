"""The AWQ search, layer by layer.

Each decoder layer runs once over the calibration tokens. Forward hooks reduce the input of every
scale group to two statistics: the mean |x| per channel and the Gram matrix S = X^T X / n. The
loss AWQ minimises, the mean squared error of a group's linear outputs against full precision,
is then exact without touching the tokens again:

    || X (W_q - W)^T ||^2 / n  =  trace(D S D^T),   D = W_q - W

so each of the 20 grid points (and each clipping step) costs one [N, K] x [K, K] product instead
of a pass over 65k tokens, and all candidates of a grid are evaluated as one batch. The
rounding is reference.pseudo_quantize itself (in place), the same grid packing uses.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from fastawq.models import ScaleGroup, architecture_of
from fastawq.models.base import get_submodule, set_submodule
from fastawq.reference import pseudo_quantize
from fastawq.quantize.config import QuantConfig
from fastawq.quantize.pack import finalize_layer
from fastawq.quantize.scale import apply_scale

log = logging.getLogger(__name__)

# Clipping is skipped for the linears whose outputs enter softmax(QK^T): their error there is
# not what an output-MSE measures (AutoAWQ's rule).
_NO_CLIP = ("q_", "k_", "query", "key", "Wqkv", "c_attn")


@dataclass
class InputStats:
    """Mean |x| per input channel and the Gram matrix of one group's input, both fp32."""

    abs_sum: torch.Tensor  # [K]
    gram: torch.Tensor  # [K, K]
    count: int = 0

    @property
    def x_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)

    @property
    def sigma(self) -> torch.Tensor:
        return self.gram / max(self.count, 1)

    def rescale(self, s: torch.Tensor) -> None:
        """The group's input became x / s."""
        self.abs_sum /= s
        self.gram /= s[:, None] * s[None, :]


def _tuple_outputs() -> bool:
    """transformers 4.x decoder layers return tuples, 5.x tensors."""
    from importlib.metadata import version

    return int(version("transformers").split(".")[0]) < 5


def search_kwargs(kwargs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """A layer's captured keyword arguments, on `device` in `dtype`, with the KV cache off: the
    search runs each layer on its own, many times."""
    kw = dict(kwargs)
    for key in ("past_key_values", "past_key_value", "cache", "layer_past"):
        if key in kw:
            kw[key] = None
    if "use_cache" in kw:
        kw["use_cache"] = False
    return {k: _to(v, device, dtype) for k, v in kw.items()}


class _Catcher(nn.Module):
    """Stands in for decoder layer `index`: records the keyword arguments it is called with (masks
    and rotary embeddings differ per layer type, e.g. Gemma's sliding layers) and, for layer 0,
    its input; passes the hidden states through untouched."""

    def __init__(self, layer: nn.Module, index: int, store: dict):
        super().__init__()
        self.__dict__["_inner"] = layer  # not a submodule: it must not follow .to(device)
        self.index = index
        self.store = store

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_inner"], name)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.index == 0:
            self.store["x"] = hidden_states
        self.store["kwargs"].setdefault(self.index, kwargs)
        return (hidden_states,) if self.store["tuples"] else hidden_states


class AwqQuantizer:
    """Activation-aware weight quantization of one transformers model, in place.

    Subclass and override `compute_scales`, `search_best_scale` or `search_best_clip` to change
    how scales are initialised or weights clipped.
    """

    n_grid: int = 20
    # dtype of the calibration forward on CPU: None = bf16 where the CPU has native bf16, else fp32.
    cpu_forward_dtype: torch.dtype | None = None
    max_shrink: float = 0.5
    # Elements of one [candidates, N, K] batch: bounds the search's working memory.
    cpu_batch_elems: int = 1 << 23
    gpu_batch_elems: int = 1 << 28

    def __init__(
        self,
        model: nn.Module,
        quant_config: QuantConfig,
        samples: torch.Tensor,
        *,
        duo_scaling: bool = True,
        apply_clip: bool = True,
        export_compatible: bool = False,
        n_parallel_calib_samples: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        self.config = QuantConfig.from_dict(quant_config)
        self.arch = architecture_of(model)
        if samples.dim() != 2 or samples.numel() == 0:
            raise ValueError(f"calibration samples must be a non-empty [n, seq_len] id tensor, got {tuple(samples.shape)}")
        self.samples = samples
        self.duo_scaling = duo_scaling
        self.apply_clip = apply_clip
        self.export_compatible = export_compatible
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk = n_parallel_calib_samples or (16 if self.device.type == "cpu" else 32)
        # With an explicit chunk size on an accelerator, activations wait on the CPU between uses.
        self.offload = n_parallel_calib_samples is not None and self.device.type != "cpu"
        self.layers_prefix = self.arch.layers_path
        # CPU: the layer is searched and folded in fp32 (fp16 CPU math is slow and lossy) and runs
        # its forward in forward_dtype. Accelerators: everything in the model's dtype.
        self.upcast = self.device.type == "cpu"
        self.forward_dtype: torch.dtype | None = None
        if self.upcast:
            self.forward_dtype = self.cpu_forward_dtype or _cpu_forward_dtype()
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ driver
    @torch.no_grad()
    def quantize(self) -> nn.Module:
        with search_precision(self.device):
            return self._quantize()

    def _quantize(self) -> nn.Module:
        layers = get_submodule(self.model, self.arch.layers_path)
        t0 = time.perf_counter()
        inps, kwargs = self._capture_inputs(layers)
        self._tick("capture", t0)
        self.moe_spec()
        for i in tqdm(range(len(layers)), desc="AWQ", unit="layer"):
            inps = self.quantize_layer(i, layers[i], inps, kwargs[i])
        log.info("AWQ done in %.1fs (%s)", sum(self.timings.values()),
                 ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
        self.model.fastawq_quant_config = self.config
        self.model.fastawq_packed = not self.export_compatible and self.config.packable
        return self.model

    def quantize_layer(self, i: int, layer: nn.Module, inps: list[torch.Tensor], kwargs: dict) -> list[torch.Tensor]:
        """Search, clip and pack decoder layer `i` in place; returns the next layer's inputs (the
        streaming and distributed drivers call this one layer at a time)."""
        from fastawq.quantize import moe  # here, not at the top: quantize/moe.py imports this module

        name = f"{self.layers_prefix}.{i}"
        spec = self.moe_spec()
        # Unfuses the layer's experts before anything moves it: the search sees per-expert linears.
        mx = moe.MoELayerSearch(self, layer, name, spec) if spec and spec.block_of(layer) else None
        orig_device = next(layer.parameters()).device
        orig_dtype = next(layer.parameters()).dtype
        # The search folds scales into full-precision weights; on CPU the layer's forward may
        # run on a bf16 copy (twice the matmul speed where the CPU has bf16 instructions).
        compute_dtype = torch.float32 if self.upcast else orig_dtype
        layer.to(self.device, compute_dtype)
        fwd = layer
        if self.forward_dtype != compute_dtype:
            fwd = copy.deepcopy(layer).to(self.forward_dtype)
        groups = self._resolve_groups(layer, name)
        if mx:  # the experts' search owns their linears
            groups = mx.unclaimed(groups)
        t = time.perf_counter()
        stats, inps = self._run_layer(fwd, name, groups, inps, kwargs, mx.hooks if mx else None)
        del fwd
        self.reduce_stats(stats)
        self._tick("forward", t)
        t = time.perf_counter()
        self.scale_layer(layer, name, groups, stats)
        if mx:
            mx.search_scales()
        self._tick("scale", t)
        t = time.perf_counter()
        if self.apply_clip:
            self.clip_layer(layer, name, groups, stats)
            if mx:
                mx.clip()
        self._tick("clip", t)
        t = time.perf_counter()
        layer.to(dtype=orig_dtype)
        if mx:
            mx.finish(pack=not self.export_compatible and self.config.packable)
        if not self.export_compatible:
            finalize_layer(layer, name, self.config)
        layer.to(orig_device)
        self._tick("pack", t)
        return inps

    def moe_spec(self):
        """The model's mixture-of-experts layout (None for a dense model), found once; finding it
        lists the routers in modules_to_not_convert."""
        if not hasattr(self, "_moe_spec"):
            from fastawq.quantize import moe

            self._moe_spec = moe.prepare(self)
        return self._moe_spec

    def reduce_stats(self, stats: dict[str, "InputStats"]) -> None:
        """Hook: combine the statistics of calibration samples spread over processes."""

    def scale_groups(self, name: str, groups: list[ScaleGroup]) -> list[tuple[ScaleGroup, list[str]]]:
        """The groups whose scale is searched, each with its quantized linears."""
        out = []
        for g in groups:
            consumers = [n for n in g.linears if not self.config.skips(f"{name}.{n}")]
            if g.kind != "none" and consumers:
                out.append((g, consumers))
        return out

    def scale_layer(self, layer: nn.Module, name: str, groups: list[ScaleGroup], stats: dict) -> None:
        for g, consumers in self.scale_groups(name, groups):
            s = self.search_best_scale(layer, name, g, consumers, stats[g.linears[0]])
            apply_scale(layer, g, s)
            stats[g.linears[0]].rescale(s)

    def clip_targets(self, name: str, groups: list[ScaleGroup]) -> list[tuple[str, str]]:
        """(linear, name of the group's first linear whose statistics it uses) pairs to clip."""
        return [
            (lin_name, g.linears[0]) for g in groups for lin_name in g.linears
            if not self.config.skips(f"{name}.{lin_name}") and not any(p in lin_name for p in _NO_CLIP)
        ]

    def clip_layer(self, layer: nn.Module, name: str, groups: list[ScaleGroup], stats: dict) -> None:
        for lin_name, key in self.clip_targets(name, groups):
            lin = layer.get_submodule(lin_name)
            apply_clip(lin, self.search_best_clip(lin, f"{name}.{lin_name}", stats[key]))

    def _tick(self, what: str, t0: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------------ capture
    # Text chunks differ only in their rows: every chunk is searched with the first one's masks and
    # positions, and only those are kept. A subclass whose chunks differ (image+text pairs) keeps all.
    per_chunk_kwargs: bool = False

    def _calibration_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The keyword arguments of the model's base, one calibration chunk each."""
        for start in range(0, self.samples.shape[0], self.chunk):
            yield {"input_ids": self.samples[start : start + self.chunk].to(self.device)}

    def _capture_inputs(self, layers: nn.ModuleList) -> tuple[list[torch.Tensor], list[Any]]:
        """Run the model's embedding on every calibration chunk, decoder layers stubbed out:
        layer 0's inputs, and the keyword arguments each layer receives (see _layer_kwargs)."""
        real = layers
        store: dict = {"kwargs": {}, "tuples": _tuple_outputs()}
        set_submodule(self.model, self.arch.layers_path,
                      nn.ModuleList([_Catcher(layer, i, store) for i, layer in enumerate(real)]))
        # Everything but the decoder layers visits the accelerator for the capture.
        devices = {n: t.device for n, t in _tensors(self.model)}
        base = self.model.base_model
        inps: list[torch.Tensor] = []
        captured: list[dict] = []
        try:
            base.to(self.device)
            for inputs in self._calibration_batches():
                store["kwargs"] = {}
                base(**inputs, use_cache=False)
                x = store["x"]
                inps.append(x.to("cpu") if self.offload else x)
                if self.per_chunk_kwargs or not captured:
                    captured.append(store["kwargs"])
        finally:
            set_submodule(self.model, self.arch.layers_path, real)
            for n, t in _tensors(self.model):
                if n in devices and t.device != devices[n]:
                    t.data = t.data.to(devices[n])
        compute_dtype = self.forward_dtype if self.upcast else inps[0].dtype
        self.forward_dtype = compute_dtype
        inps = [x.to(compute_dtype) for x in inps]
        return inps, [self._layer_kwargs([kw[i] for kw in captured], compute_dtype) for i in range(len(real))]

    def _layer_kwargs(self, per_chunk: list[dict], dtype: torch.dtype) -> Any:
        """One layer's keyword arguments for the search, from those captured (one dict per kept chunk)."""
        return search_kwargs(per_chunk[0], self.device, dtype)

    # ------------------------------------------------------------------ one layer
    def _resolve_groups(self, layer: nn.Module, name: str) -> list[ScaleGroup]:
        groups = list(self.arch.scale_groups(layer, self.model.config))
        covered = {n for g in groups for n in g.linears}
        for lin_name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear) and lin_name not in covered:
                groups.append(ScaleGroup([lin_name]))
        for g in groups:
            for lin_name in g.linears:
                mod = layer.get_submodule(lin_name)
                if not isinstance(mod, nn.Linear):
                    raise TypeError(f"{name}.{lin_name} is {type(mod).__name__}, expected nn.Linear")
        return groups

    def _run_layer(self, layer, name, groups, inps, kwargs, extra_hooks=None):
        """One pass of the layer over all chunks: the output (next layer's input) and, through
        hooks, each group's input statistics (`extra_hooks(layer)` registers more)."""
        stats: dict[str, InputStats] = {}
        handles = []

        def make_hook(lin_name: str):
            def hook(_mod, args, _out):
                x = args[0]
                k = x.shape[-1]
                if not torch.isfinite(x).all():
                    raise FloatingPointError(
                        f"non-finite activations (NaN/inf) entering {name}.{lin_name}; the model or its "
                        f"dtype overflows on the calibration data (try float32 or bfloat16)"
                    )
                x2 = x.reshape(-1, k)
                if x2.dtype == torch.bfloat16 and x2.device.type == "cpu":
                    # bf16 products summed in fp32 inside the kernel; only the result rounds.
                    gram = (x2.t() @ x2).float()
                    x2 = x2.float()
                else:
                    x2 = x2.float()
                    gram = None
                st = stats.get(lin_name)
                if st is None:
                    st = stats[lin_name] = InputStats(
                        torch.zeros(k, device=x.device), torch.zeros(k, k, device=x.device)
                    )
                st.abs_sum += x2.abs().sum(0)
                if gram is None:
                    st.gram.addmm_(x2.t(), x2)
                else:
                    st.gram += gram
                st.count += x2.shape[0]

            return hook

        for g in groups:
            handles.append(layer.get_submodule(g.linears[0]).register_forward_hook(make_hook(g.linears[0])))
        if extra_hooks is not None:
            handles += extra_hooks(layer)
        outs = []
        try:
            for x in inps:
                xd = x.to(self.device, non_blocking=True)
                y = layer(xd, **kwargs)
                y = y[0] if isinstance(y, (tuple, list)) else y
                if not torch.isfinite(y).all():
                    raise FloatingPointError(f"non-finite activations (NaN/inf) leaving {name}")
                outs.append(y.to("cpu") if self.offload else y)
        finally:
            for h in handles:
                h.remove()
        return stats, outs

    # ------------------------------------------------------------------ scale search
    def _group_size(self, full_name: str, k: int) -> int:
        return self.config.group_size_for(full_name, k)

    def _batch(self, per_candidate: int) -> int:
        budget = self.cpu_batch_elems if self.device.type == "cpu" else self.gpu_batch_elems
        return max(1, budget // max(per_candidate, 1))

    def compute_scales(self, x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratios: torch.Tensor) -> torch.Tensor:
        """Candidate scales [len(ratios), K]: x^r / w^(1-r) (duo) or x^r, normalised so that
        max * min = 1."""
        r = ratios[:, None]
        if w_mean is not None:
            s = x_mean[None].pow(r) / (w_mean[None].pow(1 - r) + 1e-4)
        else:
            s = x_mean[None].pow(r)
        s = s.clamp(min=1e-4)
        return s / (s.amax(dim=1, keepdim=True) * s.amin(dim=1, keepdim=True)).sqrt()

    def _loss(self, weights: list[tuple[torch.Tensor, int]], sigma: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """trace((Q(W s)/s - W) S (Q(W s)/s - W)^T) summed over the group's linears, per candidate."""
        c = s.shape[0]
        loss = torch.zeros(c, device=s.device)
        bits, zp = self.config.w_bit, self.config.zero_point
        for w, g in weights:
            n, k = w.shape
            step = self._batch(n * k)
            for i in range(0, c, step):
                sc = s[i : i + step, None, :]
                m = sc.shape[0]
                d = pseudo_quantize(w[None] * sc, g, bits, zp, inplace=True).div_(sc).sub_(w[None])
                a = (d.view(m * n, k) @ sigma).view(m, n * k)
                loss[i : i + m] += a.mul_(d.view(m, n * k)).sum(dim=1)
        return loss

    def search_best_scale(
        self, layer: nn.Module, name: str, group: ScaleGroup, consumers: list[str], st: InputStats
    ) -> torch.Tensor:
        """The scale [K] (fp32) of one group, chosen on the grid by the group's output MSE."""
        weights = []
        for lin_name in consumers:
            w = layer.get_submodule(lin_name).weight.detach().float()
            weights.append((w, self._group_size(f"{name}.{lin_name}", w.shape[1])))
        x_mean = st.x_mean
        w_mean = None
        if self.duo_scaling:
            acc = torch.zeros_like(x_mean)
            rows = 0
            for w, g in weights:
                n, k = w.shape
                wa = w.abs().view(n, k // g, g)
                acc += (wa / wa.amax(dim=-1, keepdim=True).clamp(min=1e-8)).view(n, k).sum(0)
                rows += n
            w_mean = acc / rows
        ratios = torch.arange(self.n_grid, device=x_mean.device, dtype=torch.float32) / self.n_grid
        cand = self.compute_scales(x_mean, w_mean, ratios)
        # Unscaled round-to-nearest competes too, so the search never makes a group worse.
        cand = torch.cat([cand, torch.ones_like(cand[:1])])
        loss = self._loss(weights, st.sigma, cand)
        if not torch.isfinite(loss).any():
            raise FloatingPointError(f"AWQ scale search for {name}.{group.linears} produced no finite loss")
        best = int(torch.nan_to_num(loss, nan=float("inf")).argmin())
        log.debug("%s %s: best ratio %s, loss %.4g (unscaled %.4g)", name, group.linears,
                  "none" if best == self.n_grid else f"{best / self.n_grid:.2f}", loss[best], loss[-1])
        return cand[best].detach()

    # ------------------------------------------------------------------ clipping
    def search_best_clip(self, linear: nn.Linear, name: str, st: InputStats) -> torch.Tensor:
        """Per-group max |w| [N, K // G] minimising each group's share of the output MSE."""
        w = linear.weight.detach().float()
        n, k = w.shape
        g = self._group_size(name, k)
        ng = k // g
        sigma = st.sigma
        # Diagonal [G, G] blocks of S: a group's error couples only with its own inputs here.
        blocks = sigma.view(ng, g, ng, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
        wg = w.view(n, ng, g)
        org_max = wg.abs().amax(dim=-1)  # [N, ng]
        steps = int(self.max_shrink * self.n_grid)
        shrink = 1.0 - torch.arange(steps, device=w.device, dtype=torch.float32) / self.n_grid
        best_err = torch.full((n, ng), float("inf"), device=w.device)
        best_max = org_max.clone()
        step = self._batch(n * k)
        for i in range(0, steps, step):
            sh = shrink[i : i + step]
            m = sh.shape[0]
            mx = (org_max[None] * sh[:, None, None]).unsqueeze(-1)  # [m, N, ng, 1]
            cw = torch.maximum(torch.minimum(wg[None], mx), -mx)
            q = pseudo_quantize(cw, g, self.config.w_bit, self.config.zero_point, inplace=True)
            d = (q.view(m, n, ng, g) - wg[None]).permute(2, 0, 1, 3).reshape(ng, m * n, g)
            err = (torch.bmm(d, blocks) * d).sum(-1).view(ng, m, n).permute(1, 2, 0)  # [m, N, ng]
            for j in range(m):
                better = err[j] < best_err
                best_err = torch.where(better, err[j], best_err)
                best_max = torch.where(better, mx[j, :, :, 0], best_max)
        return best_max


# max_val [N, K // G]: clamp each group of the linear's weight to +-max_val
@torch.no_grad()
def apply_clip(lin: nn.Linear, max_val: torch.Tensor) -> None:
    w = lin.weight.data.float()
    n, k = w.shape
    g_sz = k // max_val.shape[1]
    w = w.view(n, -1, g_sz).clamp(-max_val.unsqueeze(-1), max_val.unsqueeze(-1)).view(n, k)
    lin.weight.data = w.to(lin.weight.dtype)


@contextlib.contextmanager
def search_precision(device: torch.device):
    """TF32 for the fp32 statistics and loss products on GPUs: the loss ranks candidates, and
    10 mantissa bits do not change a ranking that fp16 activations already limit."""
    prev = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def _cpu_forward_dtype() -> torch.dtype:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def _tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _to(v: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
    if isinstance(v, tuple):
        return tuple(_to(x, device, dtype) for x in v)
    if isinstance(v, list):
        return [_to(x, device, dtype) for x in v]
    return v
