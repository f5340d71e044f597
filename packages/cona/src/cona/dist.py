"""Ranks and process groups for cona: hwtopo's launcher, the rank's device, sub-groups.

``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` local ranks joined in one
process group (gloo on CPU, NCCL on GPU; ``$MLSYSKIT_BACKEND`` overrides) and returns each rank's
return value; a rank that raises or dies makes it raise ``RankFailure`` naming the rank.
"""

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


def backend() -> str:
    """The backend a new group would use here: ``$MLSYSKIT_BACKEND``, else NCCL with a GPU per rank."""
    return pick_backend()


def select_device(backend_name: str, env=None, cuda_count: int | None = None, rank: int = 0) -> torch.device:
    """The device a rank computes on: the CPU under gloo; under NCCL the GPU numbered ``LOCAL_RANK``
    (set by torchrun, and by ``launch`` for its ranks), else ``rank`` modulo the visible GPUs."""
    if backend_name != "nccl":
        return torch.device("cpu")
    env = os.environ if env is None else env
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count < 1:
        raise RuntimeError("the nccl backend needs a CUDA device but none is visible (set MLSYSKIT_BACKEND=gloo)")
    raw = env.get("LOCAL_RANK")
    if raw is None:
        return torch.device("cuda", rank % count)
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be a non-negative integer, got {raw!r}") from None
    if not 0 <= local < count:
        raise ValueError(f"LOCAL_RANK={local} names no visible GPU (valid: 0..{count - 1})")
    return torch.device("cuda", local)


def current_device() -> torch.device:
    """This process's device, from the initialised process group's backend (CPU when there is none)."""
    if not dist.is_initialized():
        return select_device(backend())
    return select_device(str(dist.get_backend()), rank=dist.get_rank())


def group(ranks: tuple[int, ...]):
    """The process group of ``ranks`` (created once per process; every rank must ask in the same order)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    return _GROUPS[ranks]


def launch(fn, world: int, *args, timeout_s: float = 600.0, pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1):
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks; their return values, by rank.

    Return values must be plain data (tensors, numbers, strings, lists, dicts): they are read back
    without running code. A SIGTERM or SIGKILL to the launching process ends the ranks too.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return spawn(fn, world, args, threads=threads, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
