"""Process launching and process groups: gloo on CPU (NCCL on GPU), timeouts, dead ranks named.

``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` spawned processes joined in
one process group and returns each rank's return value. A rank that raises or dies makes ``launch``
raise ``RankFailure`` naming the rank (the others are terminated), never hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "RankFailure", "group", "backend", "select_device", "current_device", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 120.0
_GROUPS: dict[tuple[int, ...], object] = {}


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message names it."""


def backend() -> str:
    return "nccl" if torch.cuda.is_available() and os.environ.get("CONA_BACKEND", "") != "gloo" else "gloo"


def select_device(backend_name: str, env=None, cuda_count: int | None = None, rank: int = 0) -> torch.device:
    """The device a rank computes on: the CPU under gloo; under NCCL the GPU numbered ``LOCAL_RANK``
    (set by torchrun, and by ``launch`` for its ranks), else ``rank`` modulo the visible GPUs."""
    if backend_name != "nccl":
        return torch.device("cpu")
    env = os.environ if env is None else env
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count < 1:
        raise RuntimeError("the nccl backend needs a CUDA device but none is visible (set CONA_BACKEND=gloo for CPU)")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, timeout_s, threads, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    _GROUPS.clear()
    os.environ["LOCAL_RANK"] = str(rank)  # every rank of launch runs on this machine
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        name = backend()
        if name == "nccl":
            torch.cuda.set_device(select_device(name, rank=rank))
        dist.init_process_group(
            name,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world, *args)
        payload = {"ok": True, "value": value}
    except BaseException as e:  # noqa: BLE001 - reported to the parent by rank
        payload = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = result_path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, result_path)
    if dist.is_initialized() and payload["ok"]:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0 if payload["ok"] else 1)


def _is_comm_error(msg: str) -> bool:
    return any(k in msg for k in ("gloo", "Connection reset", "Connection closed", "Timed out", "timed out"))


def _raise_root_cause(procs, out_dir, results) -> None:
    """The failure to report: a rank that died without a result, else one that raised by itself
    (not a peer's broken connection), lowest rank first."""
    time.sleep(1.0)  # let the other ranks notice and report
    for r in range(len(procs)):
        path = Path(out_dir) / f"rank{r}.pkl"
        if r not in results and path.exists():
            with open(path, "rb") as f:
                results[r] = pickle.load(f)
    dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
    if dead:
        r = dead[0]
        raise RankFailure(f"rank {r} died with exit code {procs[r].exitcode} before reporting a result")
    errs = sorted((_is_comm_error(v["error"]), r) for r, v in results.items() if not v["ok"])
    if errs:
        r = errs[0][1]
        raise RankFailure(f"rank {r} failed: {results[r]['error']}\n{results[r]['traceback']}")
    gone = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
    raise RankFailure(f"rank {gone[0]} exited without reporting a result")


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def launch(fn, world: int, *args, timeout_s: float = 600.0, pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1):
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; their return values, by rank.

    A SIGTERM to the launching process (from its main thread) ends it through its cleanup, which terminates the
    ranks: with the default action it died at once and left them running as orphans (a killed ``cona bench``'s
    ranks kept computing beside the next run)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="cona-launch-") as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, out_dir, pg_timeout_s, threads, fn, args), daemon=True)
            for r in range(world)
        ]
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminated) if main else None
        results: dict[int, dict] = {}
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            while len(results) < world:
                failed = False
                for r, p in enumerate(procs):
                    path = Path(out_dir) / f"rank{r}.pkl"
                    if r not in results and path.exists():
                        with open(path, "rb") as f:
                            results[r] = pickle.load(f)
                    failed |= (r in results and not results[r]["ok"]) or (r not in results and p.exitcode is not None)
                if failed:
                    _raise_root_cause(procs, out_dir, results)
                if time.monotonic() > deadline:
                    missing = [r for r in range(world) if r not in results]
                    raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f}s")
                time.sleep(0.05)
        except BaseException:  # a failure, an interrupt or a SIGTERM: the ranks stop now
            for p in procs:
                if p.is_alive():
                    p.terminate()
            raise
        finally:
            for p in [q for q in procs if q.pid is not None]:  # the started ones
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
            if main:
                signal.signal(signal.SIGTERM, previous)
        return [results[r]["value"] for r in range(world)]
