"""Distributed pieces of `eagle3 train`: the process group (DDP of the drafter) and FSDP sharding of the target.

Under `torchrun`, every rank trains the same drafter on rows `rank::world` of each global batch and DDP averages
the gradients; the frozen target is either replicated (default) or sharded with FSDP2 (`shard_target`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from eagle3.config import ConfigError
from eagle3.target import decoder_parts


@dataclass
class Dist:
    """This process's place in a torchrun job (rank 0 of 1 without one) and the collectives the trainer uses."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def on_main(self, fn, device: torch.device):
        """Run `fn` on rank 0 only; a ConfigError there stops every rank (instead of leaving them waiting)."""
        err, result = None, None
        if self.main:
            try:
                result = fn()
            except ConfigError as e:
                err = e
        if self.world > 1:
            flag = torch.tensor([0.0 if err is None else 1.0], device=device)
            dist.all_reduce(flag)
            if flag.item() and err is None:
                raise ConfigError("rank 0 stopped with a configuration error; see its output")
        if err is not None:
            raise err
        return result


# A CUDA training step leaves the host little to do (collating the batch, launching kernels), yet torch's intra-op
# pool has a thread per core. Two trainings side by side on one host then run at about half speed, most likely
# the pools' threads competing with the kernel-launching ones; with 8 threads each, each runs as fast as one
# alone.
CUDA_HOST_THREADS = 8


def cuda_host_threads(env: Mapping[str, str], current: int) -> int | None:
    """How many intra-op threads a CUDA training should keep (None: leave torch's count): at most
    CUDA_HOST_THREADS, unless OMP_NUM_THREADS chooses (torchrun sets it to 1 for each of its processes)."""
    if "OMP_NUM_THREADS" in env or current <= CUDA_HOST_THREADS:
        return None
    return CUDA_HOST_THREADS


def init_dist(device_hint: str | None) -> Dist:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU), or a one-process `Dist` without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), local_rank, owns_group=False)
    use_cuda = torch.cuda.is_available() and (device_hint is None or device_hint.startswith("cuda"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, owns_group=True)


def shard_target(model: nn.Module, device: torch.device, world: int) -> tuple[int, int]:
    """Shard the frozen target's weights over the `world` ranks; returns (this rank's, all) parameter counts.

    FSDP2 (`torch.distributed.fsdp.fully_shard`): it works on a "cpu" device mesh with gloo in torch 2.13
    (tested on 2 CPU processes, so FSDP1 is not needed as a fallback) and is FSDP's current API for CUDA/NCCL;
    it leaves the modules in place (no wrapper), unlike FSDP1. One unit per decoder layer, then the root
    (embedding, final norm, lm_head). A forward all-gathers each unit's weights, runs it and frees them again,
    so between forwards a rank holds 1/world of the weights, and during one the root unit and a layer or two in
    full. `reshard_after_forward=True` also for the root: left at its default, FSDP keeps the root's gathered
    weights after forward for the backward that a frozen target never runs (checked: they stay unsharded).
    Activations are not sharded, so `Target`'s pre-hooks on the decoder layers see full hidden states; the
    modules stay the same objects (FSDP2 swaps their class in place), so hooks registered before or after this
    keep firing. Every rank must then run the same number of target forwards (see
    `eagle3.training.trainer._Trainer._step`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.requires_grad_(False)
    full = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_parts(model)[0]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # moves what is left (buffers too) to `device`
    local = sum(p.to_local().numel() for p in model.parameters())
    return local, full
