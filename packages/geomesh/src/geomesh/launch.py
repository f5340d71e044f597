"""geomesh's ranks on ``hwtopo.launch``, with its failures still :class:`GeoMeshError`.

``spawn(fn, world, args)`` is ``hwtopo.launch.spawn``: ranks with torchrun's environment joined
through a file store (gloo on CPU, NCCL when every rank has its own GPU and ``backend="auto"``), a
timeout on the process group, results read back without running code, ranks that die with the
launcher, and an error naming the rank that failed first. What geomesh adds is the error type: a
launcher failure is a :class:`LaunchError`, both ``hwtopo.launch.RankError`` and ``GeoMeshError``.
A rank that lives in a network namespace enters it in ``setup`` (``NetnsWan.enter``). Under
``torchrun`` call :func:`init_from_env` in your script instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from hwtopo import launch as _launch
from hwtopo.launch import RankError, free_port

from .diloco import GeoMeshError

__all__ = ["LaunchError", "spawn", "free_port", "init_from_env"]


class LaunchError(RankError, GeoMeshError):
    """A rank failed, died or timed out (``rank``, ``host``, ``exitcode`` say which and how)."""


@contextlib.contextmanager
def _as_geomesh() -> Iterator[None]:
    try:
        yield
    except RankError as e:
        if isinstance(e, GeoMeshError):
            raise
        raise LaunchError(str(e), e.rank, e.exitcode, e.traceback) from None


def init_from_env(backend: str = "auto", timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the default process group from torchrun's (or spawn's) environment; (rank, world)."""
    with _as_geomesh():
        return _launch.init_from_env(backend, timeout_s)


def spawn(fn: Callable[..., Any], world: int, args: tuple = (), **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks; their return values by rank.

    ``kwargs`` are those of ``hwtopo.launch.spawn`` (``backend``, ``timeout_s``, ``pg_timeout_s``,
    ``threads``, ``start_method``, ``setup``, ``env``, ``max_restarts``: a killed rank started again,
    which rejoins through ``Quorum(join=hwtopo.launch.restart_count() > 0)``). ``start_method="fork"`` starts much faster
    (no re-import of torch) and suits tests and benches.
    """
    with _as_geomesh():
        return _launch.spawn(fn, world, args, **kwargs)
