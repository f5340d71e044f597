"""Local multi-process launch (gloo on localhost) with clear errors for dead or stalled ranks.

``spawn(fn, world, args)`` starts ``world`` processes, each calling ``fn(rank, world, *args)`` after
``init_process_group`` (gloo on CPU, NCCL when every rank has a GPU and ``backend="auto"``), with a
timeout on the process group. It returns the ranks' return values in rank order. A rank that raises,
dies (signal, OOM kill) or outlives ``timeout_s`` ends the run with a ``GeoMeshError`` naming it;
the others are stopped. Under ``torchrun`` use ``init_from_env()`` in your script instead.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .diloco import GeoMeshError

__all__ = ["spawn", "free_port", "init_from_env"]

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_from_env(backend: str = "auto", timeout_s: float = 120.0) -> tuple[int, int]:
    """init_process_group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise GeoMeshError(f"environment variable {var} is not set; launch with torchrun or use geomesh.spawn")
    dist.init_process_group(_backend(backend), timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(
    rank: int, world: int, addr: str, port: int, backend: str, timeout_s: float, threads: int, fn, args, results, setup
) -> None:
    try:
        if setup is not None:
            setup(rank)  # e.g. enter this rank's network namespace before any socket exists
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        dist.init_process_group(
            _backend(backend),
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            out = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already torn down by a failing peer
                pass
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: tensors must not travel as shared-memory handles
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent by rank
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        raise SystemExit(1) from None


_PEER_FAILURES = ("Timeout", "timed out", "Connection reset", "Connection closed", "Broken pipe", "gloo/transport")


def _is_peer_failure(msg: str) -> bool:
    """True for errors a rank gets because another rank died, not its own root cause."""
    return any(s in msg for s in _PEER_FAILURES)


def spawn(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    *,
    backend: str = "auto",
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    start_method: str = "spawn",
    setup: Callable[[int], None] | None = None,
    master_addr: str = "127.0.0.1",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes; return their results by rank.

    ``start_method="fork"`` starts much faster (no re-import of torch) and suits tests and benches.
    ``setup(rank)`` runs first in each process (``NetnsWan.enter``); ``master_addr`` is rank 0's
    address for the rendezvous (its namespace address when ranks live in network namespaces).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, not {world!r}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, master_addr, port, backend, pg_timeout_s, threads, fn, args, results, setup),
            name=f"geomesh-rank{r}",
            daemon=False,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    error: str | None = None

    def dead_silent() -> str | None:
        for r, p in enumerate(procs):
            if r not in reported and not p.is_alive() and p.exitcode not in (0, None):
                return f"rank {r} (pid {p.pid}) died with exit code {p.exitcode} without reporting an error"
        return None

    errors: list[tuple[int, str]] = []

    def take(timeout: float) -> bool:
        try:
            rank, status, payload = results.get(timeout=timeout)
        except queue.Empty:
            return False
        reported.add(rank)
        if status == "ok":
            got[rank] = payload
        else:
            log.debug("rank %d traceback:\n%s", rank, payload)
            errors.append((rank, payload.splitlines()[0]))
        return True

    try:
        while len(got) < world:
            take(0.2)
            if errors or dead_silent() is not None:
                # a peer's death shows up on the others as a collective error: let the messages in,
                # then blame a rank that died silently before one that reported a broken collective
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    take(0.1)
                silent = dead_silent()
                own = [e for e in errors if not _is_peer_failure(e[1])] or errors
                error = silent or f"rank {own[0][0]} failed: {own[0][1]}"
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in got]
                error = f"rank(s) {missing} did not finish within {timeout_s:.0f} s (stalled worker or link)"
                break
    finally:
        for p in procs:
            if error is not None and p.is_alive():
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if error is not None:
        raise GeoMeshError(error.strip())
    return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]
