"""AWQ over several processes (torch.distributed: NCCL on GPUs, gloo on CPUs).

Each rank runs its share of the calibration samples through the layer; the per-group statistics
(|x| sums, Gram matrices, token counts) are summed with all_reduce, so every rank holds the
statistics of all samples. The scale search of a layer's groups and the clipping search of its
linears are then dealt out round-robin, each result broadcast from the rank that computed it, and
every rank applies all of them in the single-process order. Rank 0 writes the checkpoint.

Same result as one process up to the summation order of the statistics: all_reduce adds the
ranks' partial sums, one process adds chunk after chunk, so Gram entries differ in the last fp32
bits and a near-tie in the grid search can fall the other way (tests/test_distributed.py bounds
the difference). Launch with `torchrun --nproc_per_node N` (add `--nnodes`/`--rdzv-endpoint` for
several hosts: the output folder must then be on a filesystem every node sees) or
`fastawq quantize --gpus N`.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastawq.models import ScaleGroup
from fastawq.quantize.awq import AwqQuantizer, InputStats, apply_clip
from fastawq.quantize.scale import apply_scale

log = logging.getLogger(__name__)


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str | None) -> str | None:
    """Join the process group torchrun describes in the environment; returns this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return device
    use_cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if use_cuda else "gloo")
    log.info("rank %d of %d on %s", dist.get_rank(), world, device or "cpu")
    return device or "cpu"


def my_share(samples: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of the calibration samples."""
    if world == 1:
        return samples
    if samples.shape[0] < world:
        raise ValueError(f"{samples.shape[0]} calibration samples cannot be split over {world} processes")
    return torch.tensor_split(samples, world)[rank].contiguous()


def broadcast_object(obj: Any) -> Any:
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def _independent(targets: list[tuple[ScaleGroup, list[str]]]) -> bool:
    """Can the groups be searched at once? Only if no group's linears are the op an earlier group
    folds its scale into: that group would otherwise search already-divided weights."""
    for j, (g, _) in enumerate(targets):
        if any(prev.prev in g.linears for prev, _ in targets[:j]):
            return False
    return True


class DistributedAwqQuantizer(AwqQuantizer):
    """AwqQuantizer whose statistics and searches are shared by the ranks of the process group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank, self.world = rank_world()

    def reduce_stats(self, stats: dict[str, InputStats]) -> None:
        for key in sorted(stats):
            st = stats[key]
            dist.all_reduce(st.abs_sum)
            dist.all_reduce(st.gram)
            n = torch.tensor([st.count], dtype=torch.float64, device=st.gram.device)
            dist.all_reduce(n)
            st.count = int(n.item())

    def _owner(self, j: int) -> int:
        return j % self.world

    def scale_layer(self, layer: nn.Module, name: str, groups: list[ScaleGroup], stats: dict) -> None:
        targets = self.scale_groups(name, groups)
        if not _independent(targets):
            log.debug("%s: scale groups depend on each other; every rank searches all of them", name)
            return super().scale_layer(layer, name, groups, stats)
        found = []
        for j, (g, consumers) in enumerate(targets):
            k = layer.get_submodule(consumers[0]).in_features
            if self._owner(j) == self.rank:
                s = self.search_best_scale(layer, name, g, consumers, stats[g.linears[0]]).float().contiguous()
            else:
                s = torch.empty(k, dtype=torch.float32, device=stats[g.linears[0]].gram.device)
            found.append(s)
        for j, s in enumerate(found):
            dist.broadcast(s, src=self._owner(j))
        for (g, _), s in zip(targets, found):
            apply_scale(layer, g, s)
            stats[g.linears[0]].rescale(s)

    def clip_layer(self, layer: nn.Module, name: str, groups: list[ScaleGroup], stats: dict) -> None:
        targets = self.clip_targets(name, groups)
        found = []
        for j, (lin_name, key) in enumerate(targets):
            lin = layer.get_submodule(lin_name)
            g = self._group_size(f"{name}.{lin_name}", lin.in_features)
            if self._owner(j) == self.rank:
                m = self.search_best_clip(lin, f"{name}.{lin_name}", stats[key]).float().contiguous()
            else:
                m = torch.empty(lin.out_features, lin.in_features // g, dtype=torch.float32, device=lin.weight.device)
            found.append(m)
        for j, m in enumerate(found):
            dist.broadcast(m, src=self._owner(j))
        for (lin_name, _), m in zip(targets, found):
            apply_clip(layer.get_submodule(lin_name), m)
