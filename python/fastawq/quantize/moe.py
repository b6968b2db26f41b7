"""The AWQ search for mixture-of-experts layers.

Calibration tokens reach each expert through the real router: the experts are unfused into
per-expert linears (models/moe.py) and hooks collect, in one pass of the layer,
  - the MoE input over all tokens: mean |x| per channel and its Gram matrix,
  - per expert e, the Gram matrix of the tokens routed to it (the input of its gate/up),
  - per expert e, mean |h| and the Gram matrix of h = act(gate(x)) * up(x) (its down_proj input).
The gate/up of every expert and of the shared expert read one normed input, so they share one
scale s; the router (and a shared-expert gate) read it too and stay in full precision, taking
W * s so the folded norm's output x / s routes exactly as before. The search ranks candidates by

    sum_e trace(D_e S_e D_e^T)  +  trace(D_shared S D_shared^T),   S_e = X_e^T X_e / n

(each expert's output error on its own tokens), batched over experts and candidates. Each
expert's down_proj gets its own up -> down scale from its own tokens, all experts at once.

The per-expert input Grams take E * H^2 * 4 bytes (2.1 GB for Qwen3-30B-A3B, 52 GB for DeepSeek-V3).
Beyond `MoELayerSearch.gram_budget` they are never all held: the forward records each call's
routed rows (top-k: the routing over the block input, which is kept anyway), and the search rebuilds the Grams a chunk of experts at a time from the
same rows in the same order (bit-identical to the one-pass statistics), keeping only their
diagonal blocks for the clip.

An expert with fewer than `MIN_TOKENS` routed tokens (a cold expert) takes its clipping and
down_proj statistics from every calibration token run through it densely, so it is quantized as
an expert would be that saw the whole set; the log says how many there were.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from functools import partial

import torch
from torch import nn

from fastawq.models.moe import MoESpec, moe_spec_of, router_names, unfuse_experts
from fastawq.reference import pseudo_quantize

# The search's in-place rounding: the reference's own, in place (one rounding function).
_round_ = partial(pseudo_quantize, inplace=True)

if TYPE_CHECKING:
    from fastawq.quantize.awq import AwqQuantizer

log = logging.getLogger(__name__)

# Below this many routed calibration tokens an expert's own statistics are too thin to clip by.
MIN_TOKENS = 16
# Overrides MoELayerSearch.gram_budget (GiB, a float).
GRAM_BUDGET_ENV = "FASTAWQ_MOE_GRAM_BUDGET_GB"


def prepare(q: "AwqQuantizer") -> MoESpec | None:
    """Before the search: list the routers in modules_to_not_convert (they stay full precision,
    and other loaders must know not to expect packed tensors for them)."""
    spec = moe_spec_of(q.model)
    if spec is None:
        return None
    names = router_names(q.model, q.arch.layers_path, spec)
    have = list(q.config.modules_to_not_convert or [])
    q.config.modules_to_not_convert = have + [n for n in names if n not in have]
    return spec


class MoELayerSearch:
    """The MoE part of one decoder layer: unfuses its experts, collects their statistics during
    the layer's forward, then searches and folds the scales and clips, batched over experts."""

    # Bytes the per-expert input Grams may take at once (GRAM_BUDGET_ENV overrides).
    gram_budget: int = 8 << 30

    def __init__(self, q: "AwqQuantizer", layer: nn.Module, name: str, spec: MoESpec):
        self.q, self.layer, self.name, self.spec = q, layer, name, spec
        block = spec.block_of(layer)
        self.num_experts = len(unfuse_experts(block, spec))
        self.bp = f"{spec.block}.{spec.experts}"
        p = spec.block
        self.shared = [f"{p}.{spec.shared}.gate_proj", f"{p}.{spec.shared}.up_proj"] if spec.shared else []
        self.floats = [f"{p}.{n}" for n in spec.float_consumers()]
        self.x_chunks: list[torch.Tensor] = []
        # Chunked Grams only: each experts call's rows (see _calls_hook), the Grams' diagonal blocks.
        self.gram_chunk = self._gram_chunk()
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, list[int]]] = []
        self.blocks_in: dict[int, torch.Tensor] = {}
        self.st: dict[str, torch.Tensor] = {}
        self.n_all = 0
        # Routers may be kept in fp32 (DeepSeek's weight and score-correction bias): the layer's
        # casts for the search must not round them, so their originals are restored at the end.
        self.s_in: torch.Tensor | None = None
        self.float_state = {
            path: {n: t.detach().clone() for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
                   if t is not None}
            for path in self.floats if (m := _maybe_submodule(layer, path)) is not None
        }

    # ------------------------------------------------------------------ names
    def expert(self, e: int) -> nn.Module:
        return self.layer.get_submodule(f"{self.bp}.{e}")

    def claimed(self) -> set[str]:
        """Linears (relative to the layer) the generic per-group search must leave alone."""
        out = {f"{self.bp}.{e}.{n}" for e in range(self.num_experts) for n in self.spec.proj_names}
        return out | set(self.shared) | set(self.floats)

    def unclaimed(self, groups: list) -> list:
        """The layer's scale groups without the singleton groups of the linears this search owns."""
        mine = self.claimed()
        return [g for g in groups if not mine.intersection(g.linears)]

    # ------------------------------------------------------------------ statistics
    def hooks(self, fwd: nn.Module) -> list:
        """Register the statistics hooks on `fwd` (the layer or its forward copy)."""
        handles = [fwd.get_submodule(self.spec.block).register_forward_pre_hook(self._block_hook)]
        if self.gram_chunk:
            handles.append(fwd.get_submodule(self.bp).register_forward_pre_hook(self._calls_hook, with_kwargs=True))
        gname, _, dname = self.spec.proj_names
        for e in range(self.num_experts):
            ex = fwd.get_submodule(f"{self.bp}.{e}")
            handles.append(getattr(ex, gname).register_forward_hook(self._expert_hook(e, "in")))
            handles.append(getattr(ex, dname).register_forward_hook(self._expert_hook(e, "mid")))
        return handles

    def _acc(self, key: str, shape: tuple, device) -> torch.Tensor:
        t = self.st.get(key)
        if t is None:
            t = self.st[key] = torch.zeros(shape, device=device)
        return t

    def _block_hook(self, _mod, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        self.x_chunks.append(x2.detach())
        xf = x2.float()
        k = xf.shape[1]
        self._acc("abs_all", (k,), xf.device).add_(xf.abs().sum(0))
        self._acc("gram_all", (k, k), xf.device).addmm_(xf.t(), xf)
        self.n_all += xf.shape[0]

    def _calls_hook(self, mod, args, kwargs):
        """Record a call of the experts as (source, token ids or None, per-expert offsets): expert
        e's rows, in the order ExpertList.forward hands them over, are source[tok[o[e]:o[e+1]]]
        (top-k: the input, a view of the block's; a stable sort by expert keeps torch.where's
        token-ascending order) or source[o[e]:o[e+1]] (dense: only the routed rows are kept, not
        the E x T pre-scaled input)."""
        x = args[0].detach() if args else kwargs["hidden_states"].detach()
        e_all = self.num_experts
        if getattr(mod, "call", "topk") == "topk":
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            flat = idx.reshape(-1)
            key = torch.where((flat >= 0) & (flat < e_all), flat, e_all)  # dropped slots last
            counts = torch.bincount(key, minlength=e_all + 1)[:e_all]
            src, tok = x, torch.argsort(key, stable=True) // idx.shape[-1]
        else:
            xs = x.view(e_all, -1, x.shape[-1])
            keep = xs.abs().amax(dim=-1) > 0  # an unrouted token is a zero row, which the experts skip
            counts = keep.sum(dim=1)
            src, tok = xs[keep], None
        offsets = [0] + torch.cumsum(counts, 0).tolist()
        self.calls.append((src, tok, offsets))

    def _expert_hook(self, e: int, which: str):
        def hook(_mod, args, _out):
            x = args[0]
            k = x.shape[-1]
            self._acc(f"n_{which}", (self.num_experts,), x.device)[e] += x.numel() // k
            if which == "in" and self.gram_chunk:
                return  # the search rebuilds this Gram from the recorded calls
            xf = x.reshape(-1, k).float()
            self._acc(f"gram_{which}", (self.num_experts, k, k), xf.device)[e].addmm_(xf.t(), xf)
            if which == "mid":
                self._acc("abs_mid", (self.num_experts, k), xf.device)[e] += xf.abs().sum(0)

        return hook

    # ------------------------------------------------------------------ chunked input Grams
    def _gram_chunk(self) -> int | None:
        """Experts whose input Grams are built at once, or None when all E fit the budget (then
        the forward's hooks accumulate them). A multiple of _batched_loss's expert batch, so the
        loss runs the same products on the same slices as with all Grams at hand."""
        if self.q is None:
            return None
        i_dim, h = self.expert(0).linears()[0].weight.shape
        per = h * h * 4
        env = os.environ.get(GRAM_BUDGET_ENV)
        budget = int(float(env) * 2**30) if env else self.gram_budget
        if self.num_experts * per <= budget:
            return None
        ec, _ = _loss_split(self.q, 2 * i_dim, h, self.q.n_grid + 1)
        chunk = max(ec, budget // per // ec * ec)
        if not getattr(self.q, "_moe_chunk_logged", False):
            self.q._moe_chunk_logged = True
            log.info("%s: the per-expert input Grams [%d, %d, %d] fp32 take %.3g GiB, over the %.3g GiB budget "
                     "(%s): built %d experts at a time from the routed tokens", self.name, self.num_experts, h, h,
                     self.num_experts * per / 2**30, budget / 2**30, GRAM_BUDGET_ENV, chunk)
        return chunk

    # -> [e1 - e0, H, H] fp32
    def _gram_in_of(self, e0: int, e1: int, dev) -> torch.Tensor:
        """The input Grams of experts e0..e1-1 from the recorded calls: the same sums, in the same
        order, that the forward hooks would make."""
        k = self.calls[0][0].shape[-1]
        gram = torch.zeros(e1 - e0, k, k, device=dev)
        for src, tok, off in self.calls:
            for e in range(e0, e1):
                if off[e] == off[e + 1]:
                    continue
                rows = src[off[e] : off[e + 1]] if tok is None else src[tok[off[e] : off[e + 1]]]
                xf = rows.to(dev).float()
                gram[e - e0].addmm_(xf.t(), xf)
        return gram

    def _keep_blocks(self, gram: torch.Tensor, e0: int) -> None:
        """Keep the diagonal blocks of experts e0.. input Grams that the gate/up clip reads."""
        if not self.q.apply_clip:
            return
        k = gram.shape[-1]
        for idx in (0, 1):
            g = self._gsize(idx, k)
            if g not in self.blocks_in:
                self.blocks_in[g] = torch.empty(self.num_experts, k // g, g, g, device=gram.device)
            self.blocks_in[g][e0 : e0 + gram.shape[0]] = _diag_blocks(gram, g)

    # ------------------------------------------------------------------ weights
    def _stack(self, idx: int) -> torch.Tensor:
        """One linear of every expert as [E, N, K] fp32 (idx 0 gate, 1 up, 2 down)."""
        n = self.spec.proj_names[idx]
        return torch.stack([getattr(self.expert(e), n).weight.detach().float() for e in range(self.num_experts)])

    def _unstack(self, idx: int, w: torch.Tensor) -> None:
        n = self.spec.proj_names[idx]
        for e in range(self.num_experts):
            lin = getattr(self.expert(e), n)
            lin.weight.data = w[e].to(lin.weight.dtype)

    def _scale_each(self, idx: int, fn) -> None:
        """weight = fn(e, fp32 weight) for one linear of every expert, one expert at a time (a
        stacked fp32 copy of all experts is 15 GB for DeepSeek-V3)."""
        n = self.spec.proj_names[idx]
        for e in range(self.num_experts):
            lin = getattr(self.expert(e), n)
            lin.weight.data = fn(e, lin.weight.detach().float()).to(lin.weight.dtype)

    def _gsize(self, idx: int, k: int) -> int:
        return self.q._group_size(f"{self.name}.{self.bp}.0.{self.spec.proj_names[idx]}", k)

    # ------------------------------------------------------------------ cold experts
    @torch.no_grad()
    def _dense_stats_for_cold(self) -> torch.Tensor:
        """Experts with fewer than MIN_TOKENS tokens: replace their gate/up and down statistics by
        those of every calibration token run through them. Returns the cold mask [E]."""
        n_in = self.st["n_in"]
        cold = n_in.cpu() < MIN_TOKENS
        n_cold = int(cold.sum())
        if n_cold:
            log.info("%s: %d of %d experts got fewer than %d calibration tokens (%d got none); their clipping "
                     "and down_proj scales use all %d tokens run through them densely",
                     self.name, n_cold, self.num_experts, MIN_TOKENS, int((n_in.cpu() == 0).sum()), self.n_all)
        # The run's total, for callers and tests: how many experts were quantized from dense stats.
        self.q.moe_cold_experts = getattr(self.q, "moe_cold_experts", 0) + n_cold
        if not n_cold:
            return cold
        idx = torch.nonzero(cold).flatten().tolist()
        gname, uname, _ = self.spec.proj_names
        dev = self.st["gram_all"].device
        i_dim = getattr(self.expert(0), gname).weight.shape[0]
        gram = torch.zeros(len(idx), i_dim, i_dim, device=dev)
        absm = torch.zeros(len(idx), i_dim, device=dev)
        wg = torch.stack([getattr(self.expert(e), gname).weight.detach().float() for e in idx])
        wu = torch.stack([getattr(self.expert(e), uname).weight.detach().float() for e in idx])
        act = self.expert(idx[0]).act_fn
        step = max(1, self.q._batch(len(idx) * i_dim) // 4)
        for x in self.x_chunks:
            for t0 in range(0, x.shape[0], step):
                xf = x[t0 : t0 + step].to(dev).float()
                h = act(torch.matmul(xf, wg.transpose(1, 2))) * torch.matmul(xf, wu.transpose(1, 2))  # [C, t, I]
                gram.baddbmm_(h.transpose(1, 2), h)
                absm += h.abs().sum(1)
        for j, e in enumerate(idx):
            self.st["gram_mid"][e] = gram[j]
            self.st["abs_mid"][e] = absm[j]
            self.st["n_mid"][e] = self.n_all
        return cold

    # ------------------------------------------------------------------ search
    @torch.no_grad()
    def search_scales(self) -> None:
        if self.n_all == 0:
            raise ValueError(f"{self.name}: no calibration token reached the MoE block")
        dev = self.st["gram_all"].device
        widths = {"in": self.st["gram_all"].shape[0], "mid": self.expert(0).linears()[0].weight.shape[0]}
        for which, k in widths.items():
            if f"n_{which}" not in self.st:  # no expert saw a token: every expert is cold
                self.st[f"n_{which}"] = torch.zeros(self.num_experts, device=dev)
                if not (which == "in" and self.gram_chunk):
                    self.st[f"gram_{which}"] = torch.zeros(self.num_experts, k, k, device=dev)
        if "abs_mid" not in self.st:
            self.st["abs_mid"] = torch.zeros(self.num_experts, widths["mid"], device=dev)
        self.cold = self._dense_stats_for_cold()
        self.x_chunks = []
        self._search_input_scale()
        self.calls = []
        self._search_down_scales()

    def _search_input_scale(self) -> None:
        q, n = self.q, self.n_all
        x_mean = self.st["abs_all"] / n
        sig_all = self.st["gram_all"] / n
        gate0 = self.expert(0).linears()[0].weight
        i_dim = gate0.shape[0]
        gu = torch.empty(self.num_experts, 2 * i_dim, gate0.shape[1], device=gate0.device)  # [E, 2I, H] fp32
        for e in range(self.num_experts):  # filled in place: no stacked copies besides it
            gate, up, _ = self.expert(e).linears()
            gu[e, :i_dim] = gate.weight.detach()
            gu[e, i_dim:] = up.weight.detach()
        g = self._gsize(0, gu.shape[2])
        shared = [self.layer.get_submodule(s).weight.detach().float() for s in self.shared]
        sh = torch.cat(shared)[None] if shared else None
        sh_g = q._group_size(f"{self.name}.{self.shared[0]}", sh.shape[2]) if shared else g
        w_mean = None
        if q.duo_scaling:
            parts = [(gu, g)] + ([(sh, sh_g)] if sh is not None else [])
            acc, rows = torch.zeros_like(x_mean), 0
            for w, gs in parts:
                e, nn_, k = w.shape
                wa = w.abs().view(e, nn_, k // gs, gs)
                acc += (wa / wa.amax(dim=-1, keepdim=True).clamp(min=1e-8)).view(e, nn_, k).sum((0, 1))
                rows += e * nn_
            w_mean = acc / rows
        ratios = torch.arange(q.n_grid, device=x_mean.device, dtype=torch.float32) / q.n_grid
        cand = q.compute_scales(x_mean, w_mean, ratios)
        cand = torch.cat([cand, torch.ones_like(cand[:1])])
        loss = self._expert_losses(gu, cand, g).sum(0)
        if sh is not None:
            loss += _batched_loss(q, sh, sig_all[None], cand[None], sh_g).sum(0)
        if not torch.isfinite(loss).any():
            raise FloatingPointError(f"AWQ scale search for the experts of {self.name} produced no finite loss")
        s = cand[int(torch.nan_to_num(loss, nan=float("inf")).argmin())]
        del gu, cand, loss
        self.fold_input_scale(s)
        ss = s[:, None] * s[None, :]
        self.st["gram_all"] /= ss
        if "gram_in" in self.st:
            self.st["gram_in"] /= ss
        for g, blk in self.blocks_in.items():
            blk /= _diag_blocks(ss[None], g)
        self.st["abs_all"] /= s

    # gu [E, 2I, H] fp32 · cand [C, H]  ->  [E, C]
    def _expert_losses(self, gu: torch.Tensor, cand: torch.Tensor, g: int) -> torch.Tensor:
        """Each expert's output error on its own tokens per candidate; each expert's error weighs
        by its share of the tokens (its Gram over all n tokens)."""
        n, e_all = self.n_all, gu.shape[0]
        if not self.gram_chunk:
            return _batched_loss(self.q, gu, self.st["gram_in"] / n, cand[None].expand(e_all, -1, -1), g)
        parts = []
        for e0 in range(0, e_all, self.gram_chunk):
            e1 = min(e_all, e0 + self.gram_chunk)
            gram = self._gram_in_of(e0, e1, gu.device)
            self._keep_blocks(gram, e0)
            parts.append(_batched_loss(self.q, gu[e0:e1], gram.div_(n), cand[None].expand(e1 - e0, -1, -1), g))
            del gram
        return torch.cat(parts)

    # s [H] fp32
    @torch.no_grad()
    def fold_input_scale(self, s: torch.Tensor) -> None:
        """The norm divides by s; every reader of its output multiplies its weight by s: the
        experts' and shared expert's gate/up, and the full-precision router (and shared-expert
        gate), which then see x / s and compute exactly what they did."""
        self.s_in = s if self.s_in is None else self.s_in * s
        norm = self.layer.get_submodule(self.spec.norm)
        norm.weight.data = (norm.weight.float() / s).to(norm.weight.dtype)
        if getattr(norm, "bias", None) is not None:
            norm.bias.data = (norm.bias.float() / s).to(norm.bias.dtype)
        for path in self.shared + self.floats:
            m = self.layer.get_submodule(path)
            m.weight.data = (m.weight.float() * s.to(m.weight.device)).to(m.weight.dtype)
        self._scale_each(0, lambda e, w: w * s)
        self._scale_each(1, lambda e, w: w * s)

    # s [E, I] fp32
    @torch.no_grad()
    def fold_down_scales(self, s: torch.Tensor) -> None:
        """Expert e's up_proj rows divide by s[e], its down_proj columns multiply."""
        self._scale_each(1, lambda e, w: w / s[e][:, None])
        self._scale_each(2, lambda e, w: w * s[e][None, :])

    def _search_down_scales(self) -> None:
        q = self.q
        wd = self._stack(2)  # [E, H, I]
        g = self._gsize(2, wd.shape[2])
        cnt = self.st["n_mid"].clamp(min=1)[:, None]
        x_mean = self.st["abs_mid"] / cnt
        sig = self.st["gram_mid"] / cnt[:, :, None]
        ratios = torch.arange(q.n_grid, device=wd.device, dtype=torch.float32) / q.n_grid
        cands = []
        for e in range(self.num_experts):
            w_mean = None
            if q.duo_scaling:
                n, k = wd[e].shape
                wa = wd[e].abs().view(n, k // g, g)
                w_mean = (wa / wa.amax(dim=-1, keepdim=True).clamp(min=1e-8)).view(n, k).mean(0)
            c = q.compute_scales(x_mean[e], w_mean, ratios)
            cands.append(torch.cat([c, torch.ones_like(c[:1])]))
        cand = torch.stack(cands)  # [E, C, I]
        loss = _batched_loss(q, wd, sig, cand, g)  # [E, C]
        best = torch.nan_to_num(loss, nan=float("inf")).argmin(dim=1)
        s = cand[torch.arange(self.num_experts, device=cand.device), best]  # [E, I]
        self.fold_down_scales(s)
        self.st["gram_mid"] /= s[:, :, None] * s[:, None, :]

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip(self) -> None:
        n = self.n_all
        sig_all = self.st["gram_all"] / n
        cold = self.cold.to(sig_all.device)[:, None, None, None]
        cnt_in = self.st["n_in"].clamp(min=1)[:, None, None, None]
        cnt_mid = self.st["n_mid"].clamp(min=1)[:, None, None, None]
        for idx in (0, 1, 2):
            if self.q.config.skips(f"{self.name}.{self.bp}.0.{self.spec.proj_names[idx]}"):
                continue  # kept in full precision: clipping would only lose accuracy
            w = self._stack(idx)
            g = self._gsize(idx, w.shape[2])
            # Only the Grams' diagonal g x g blocks weigh a group's rounding error.
            if idx == 2:
                blocks = _diag_blocks(self.st["gram_mid"], g) / cnt_mid
            else:
                own = self.blocks_in[g] if self.gram_chunk else _diag_blocks(self.st["gram_in"], g)
                blocks = torch.where(cold, _diag_blocks(sig_all[None], g), own / cnt_in)
            mx = _batched_clip(self.q, w, blocks, g)
            del blocks
            self._unstack(idx, _clamp(w, mx))
        for path in self.shared:
            if self.q.config.skips(f"{self.name}.{path}"):
                continue
            lin = self.layer.get_submodule(path)
            w = lin.weight.detach().float()[None]
            g = self.q._group_size(f"{self.name}.{path}", w.shape[2])
            mx = _batched_clip(self.q, w, _diag_blocks(sig_all[None], g), g)
            lin.weight.data = _clamp(w, mx)[0].to(lin.weight.dtype)
        self.st = {}
        self.blocks_in = {}


    # ------------------------------------------------------------------ end of the layer
    @torch.no_grad()
    def finish(self, pack: bool) -> None:
        """After the layer is cast back to its dtype: the full-precision consumers get their
        original dtype and values, times the input scale computed in fp32; then (pack) the experts
        are packed."""
        for path, tensors in self.float_state.items():
            m = self.layer.get_submodule(path)
            for n, orig in tensors.items():
                val = orig
                if n == "weight" and self.s_in is not None:
                    val = (orig.float() * self.s_in.to(orig.device)).to(orig.dtype)
                val = val.to(getattr(m, n).device)
                if n in m._parameters:
                    m._parameters[n].data = val
                else:
                    m._buffers[n] = val
        self.float_state = {}
        if pack:
            self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """Pack every expert's linears, one quantize-and-pack per projection over all experts'
        rows (a per-expert WQLinear.from_linear would cost 3 * E small calls per layer);
        bit-identical to it: the rounding is row-wise."""
        from fastawq import reference
        from fastawq.modules import WQLinear

        cfg = self.q.config
        for idx, pname in enumerate(self.spec.proj_names):
            if cfg.skips(f"{self.name}.{self.bp}.0.{pname}"):
                continue
            w = torch.stack([getattr(self.expert(e), pname).weight.detach() for e in range(self.num_experts)])
            e_all, n, k = w.shape
            g = self._gsize(idx, k)
            dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16
            qweight, scales, qzeros = reference.quantize_awq(w.view(e_all * n, k), g, cfg.zero_point, dtype)
            w8 = n // reference.PACK
            for e in range(e_all):
                lin = WQLinear(k, n, g, False, device=w.device, dtype=dtype)
                lin.qweight.copy_(qweight[:, e * w8 : (e + 1) * w8])
                lin.qzeros.copy_(qzeros[:, e * w8 : (e + 1) * w8])
                lin.scales.copy_(scales[:, e * n : (e + 1) * n])
                setattr(self.expert(e), pname, lin)


def _maybe_submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _clamp(w: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """w clamped to ±mx per group, in place."""
    e, n, k = w.shape
    m = mx.unsqueeze(-1)
    return w.view(e, n, mx.shape[2], -1).clamp_(-m, m).view(e, n, k)


def _loss_split(q: "AwqQuantizer", n: int, k: int, c_all: int) -> tuple[int, int]:
    """(experts, candidates) per batch of _batched_loss for [N, K] weights, within the
    quantizer's batch budget (experts capped by E by the caller)."""
    per = q._batch(n * k)  # (expert, candidate) pairs per batch
    if per >= c_all:
        return max(1, per // c_all), c_all
    return 1, per


# sigma [E, K, K]  ->  its diagonal g x g blocks [E, K // g, g, g] (a copy)
def _diag_blocks(sigma: torch.Tensor, g: int) -> torch.Tensor:
    e_all, k, _ = sigma.shape
    ng = k // g
    return sigma.view(e_all, ng, g, ng, g).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).contiguous()


# w [E, N, K] fp32 · sigma [E, K, K] · s [E, C, K]  ->  loss [E, C]
def _batched_loss(q: "AwqQuantizer", w: torch.Tensor, sigma: torch.Tensor, s: torch.Tensor, g: int) -> torch.Tensor:
    """trace((Q(W s)/s - W) S (Q(W s)/s - W)^T) per expert and candidate, chunked to the
    quantizer's batch budget."""
    e_all, n, k = w.shape
    c_all = s.shape[1]
    loss = torch.zeros(e_all, c_all, device=w.device)
    ec, cc = _loss_split(q, n, k, c_all)
    ec = min(ec, e_all)
    for e0 in range(0, e_all, ec):
        we = w[e0 : e0 + ec, None]
        for c0 in range(0, c_all, cc):
            sc = s[e0 : e0 + ec, c0 : c0 + cc, None, :]
            d = _round_(we * sc, g, q.config.w_bit, q.config.zero_point).div_(sc).sub_(we)
            m, c = d.shape[0], d.shape[1]
            a = torch.bmm(d.view(m, c * n, k), sigma[e0 : e0 + m])
            loss[e0 : e0 + m, c0 : c0 + c] += a.mul_(d.view(m, c * n, k)).view(m, c, n * k).sum(-1)
    return loss


# w [E, N, K] fp32 · blocks [E, K // g, g, g] (S's diagonal blocks)  ->  max |w| per group [E, N, K // g]
def _batched_clip(q: "AwqQuantizer", w: torch.Tensor, blocks: torch.Tensor, g: int) -> torch.Tensor:
    """AwqQuantizer.search_best_clip for every expert at once: per group, the shrink of max |w|
    whose rounding error, weighed by the group's diagonal block of S, is least."""
    e_all, n, k = w.shape
    ng = k // g
    wg = w.view(e_all, n, ng, g)
    org_max = wg.abs().amax(dim=-1)
    steps = int(q.max_shrink * q.n_grid)
    best_err = torch.full_like(org_max, float("inf"))
    best_max = org_max.clone()
    ec = max(1, min(e_all, q._batch(n * k)))
    for j in range(steps):
        shrink = 1.0 - j / q.n_grid
        for e0 in range(0, e_all, ec):
            sl = slice(e0, e0 + ec)
            mx = org_max[sl] * shrink
            cw = torch.maximum(torch.minimum(wg[sl], mx[..., None]), -mx[..., None])
            d = _round_(cw, g, q.config.w_bit, q.config.zero_point).sub_(wg[sl])  # [m, N, ng, g]
            m = d.shape[0]
            dd = d.permute(0, 2, 1, 3).reshape(m * ng, n, g)
            err = (torch.bmm(dd, blocks[sl].reshape(m * ng, g, g)) * dd).sum(-1).view(m, ng, n).transpose(1, 2)
            better = err < best_err[sl]
            best_err[sl] = torch.where(better, err, best_err[sl])
            best_max[sl] = torch.where(better, mx, best_max[sl])
    return best_max
