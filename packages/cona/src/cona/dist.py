"""Ranks and process groups: hwtopo's launcher, the rank's device, cached sub-groups."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from hwtopo.launch import RankError, pick_backend, spawn

__all__ = ["launch", "RankFailure", "group", "backend", "select_device", "current_device", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 120.0
_GROUPS: dict[tuple[int, ...], object] = {}

RankFailure = RankError
backend = pick_backend  # $MLSYSKIT_BACKEND, else NCCL with a GPU per rank, else gloo


def select_device(backend_name: str, env=None, cuda_count: int | None = None, rank: int = 0) -> torch.device:
    """The CPU under gloo; under NCCL the GPU numbered ``LOCAL_RANK`` (torchrun and ``launch`` set it), else
    ``rank`` modulo the visible GPUs."""
    if backend_name != "nccl":
        return torch.device("cpu")
    raw = (os.environ if env is None else env).get("LOCAL_RANK")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count < 1:
        raise RuntimeError("the nccl backend needs a CUDA device but none is visible (set MLSYSKIT_BACKEND=gloo)")
    if raw is None:
        return torch.device("cuda", rank % count)
    if not (raw.isdigit() and int(raw) < count):
        raise ValueError(f"LOCAL_RANK must name a visible GPU (0..{count - 1}), got {raw!r}")
    return torch.device("cuda", int(raw))


def current_device() -> torch.device:
    """This process's device, from the process group's backend (CPU when there is none)."""
    if not dist.is_initialized():
        return select_device(backend())
    return select_device(str(dist.get_backend()), rank=dist.get_rank())


def group(ranks: tuple[int, ...]):
    """The process group of ``ranks``, created once per process (every rank must ask in the same order)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    return _GROUPS[ranks]


def launch(fn, world: int, *args, timeout_s: float = 600.0, pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1):
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks joined in one process group; their return values
    (plain data, read back without running code), by rank. A rank that raises or dies raises ``RankFailure``
    naming it; a SIGTERM or SIGKILL to the launching process ends the ranks too."""
    return spawn(fn, world, args, threads=threads, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
