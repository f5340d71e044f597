"""Run one function on N local ranks, the way torchrun would, and get their results back.

    def step(rank, world, lr):              # every rank runs this, its process group already joined
        ...
        return {"loss": loss, "grad": grad}  # tensors, numbers, strings, lists and dicts

    results = hwtopo.launch.spawn(step, world=4, args=(1e-3,))

Each rank is a fresh process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...) that
joins the default process group through a file store in a private directory, so nothing listens
on a network interface; gloo and NCCL are told to use loopback. A rank dies with its launcher
(PR_SET_PDEATHSIG), results travel as ``torch.save`` files read back with ``weights_only=True``
(no code runs on load), and a failure raises :class:`RankError` naming the rank that failed first
and how, not a survivor that only saw its peer vanish. The same ``fn`` runs under ``torchrun`` or
``accelerate launch`` by calling :func:`init_from_env` first. torch is imported lazily: hwtopo does
not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RankError",
    "spawn",
    "init_from_env",
    "pick_backend",
    "free_port",
    "is_launched",
    "restart_count",
    "rendezvous_store",
]

log = logging.getLogger(__name__)

RDZV_VAR = "HWTOPO_RDZV"  # the file store a rank started by spawn() joins; unset under torchrun
RESTART_VAR = "HWTOPO_RESTART_COUNT"  # how many times spawn() has started this rank again (0: first start)
BACKEND_VAR = "MLSYSKIT_BACKEND"  # gloo or nccl, overriding the automatic choice
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Messages a rank reports when a peer vanished: a consequence, never the first cause.
_PEER_FAILURE = ("Connection reset", "Connection closed", "Broken pipe", "timed out", "Timeout", "gloo/transport")
_PR_SET_PDEATHSIG = 1


class RankError(RuntimeError):
    """A rank raised, died or outlived its time; ``rank``, ``host`` and ``exitcode`` say which and how."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None, tb: str = ""):
        super().__init__(message)
        self.rank = rank
        self.host = socket.gethostname()
        self.exitcode = exitcode
        self.traceback = tb


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may take it before you bind it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_launched() -> bool:
    """True inside a rank of :func:`spawn`, ``torchrun`` or ``accelerate launch``."""
    return RDZV_VAR in os.environ or all(v in os.environ for v in _TORCHRUN_VARS)


def restart_count() -> int:
    """How many times :func:`spawn` has started this rank again after it died (0 on its first start)."""
    return int(os.environ.get(RESTART_VAR, "0"))


def rendezvous_store(timeout_s: float = 120.0):
    """A client of the store this rank's job rendezvoused through (spawn's file store, or torchrun's
    TCP store at MASTER_ADDR:MASTER_PORT): how a restarted rank, which cannot join the default
    group its peers formed, finds them again."""
    import torch.distributed as dist

    timeout = _dt.timedelta(seconds=timeout_s)
    init = os.environ.get(RDZV_VAR)
    if init is not None:
        store = dist.FileStore(init.removeprefix("file://"), -1)  # -1: never delete the peers' file
        store.set_timeout(timeout)
        return store
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RankError(f"environment variable {missing[0]} is not set: start with torchrun or hwtopo.launch.spawn")
    port = int(os.environ["MASTER_PORT"])
    return dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False, timeout=timeout)


def pick_backend(backend: str = "auto") -> str:
    """``gloo`` or ``nccl``: ``$MLSYSKIT_BACKEND`` if set, else NCCL when this rank has its own GPU."""
    choice = os.environ.get(BACKEND_VAR) or backend
    if choice not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, not {choice!r} (from ${BACKEND_VAR} or the call)")
    if choice != "auto":
        return choice
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "gloo"


def init_from_env(backend: str = "auto", timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the default process group from the environment spawn() or torchrun set; (rank, world).

    Every collective then times out after ``timeout_s`` instead of hanging on a dead peer.
    """
    import torch
    import torch.distributed as dist

    init = os.environ.get(RDZV_VAR)
    if init is None:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RankError(f"environment variable {missing[0]} is not set: start with torchrun or hwtopo.launch.spawn")
        init = "env://"
    name = pick_backend(backend)
    if name == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = _dt.timedelta(seconds=timeout_s)
    dist.init_process_group(name, init_method=init, rank=rank, world_size=world, timeout=timeout)
    return rank, world


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    world: int
    out_dir: str
    threads: int
    backend: str
    pg_timeout_s: float
    setup: Callable[[int], Any] | None
    init_group: bool


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); elsewhere a no-op."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _check_plain(value: Any, where: str = "result") -> None:
    """Raise TypeError unless ``value`` loads with ``torch.load(weights_only=True)`` as it is."""
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor, torch.Size)):
        return
    if isinstance(value, (list, tuple, set)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{where} key {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}: return tensors, numbers, strings, lists, tuples or dicts "
        "(e.g. dataclasses.asdict) so the launcher can read it back without running code"
    )


def _write_payload(path: Path, payload: dict) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _rank_main(rank: int, job: _Job) -> None:
    """Body of one rank: join, run, report, leave without the interpreter's teardown."""
    _die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    out = Path(job.out_dir) / f"rank{rank}.pt"
    handle = None
    try:
        handle = job.setup(rank) if job.setup is not None else None
        if job.init_group and restart_count() == 0:  # a restarted rank's peers formed the group without it
            init_from_env(job.backend, job.pg_timeout_s)
        value = job.fn(rank, job.world, *job.args)
        _check_plain(value)
        _write_payload(out, {"ok": True, "value": value})
        if dist.is_initialized():
            dist.barrier()  # nobody tears the group down while a peer still reduces
            dist.destroy_process_group()
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the launcher by rank
        _write_payload(out, {"ok": False, "error": f"{type(e).__name__}: {e}".strip(), "tb": traceback.format_exc()})
        code = 1
    finally:
        if handle is not None and hasattr(handle, "close"):
            handle.close()
    # torch's C++ destructors can abort at interpreter exit once a peer is gone: the work is reported
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_env(rank: int, world: int, threads: int, rdzv: str, extra: dict[str, str]) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        RDZV_VAR: rdzv,
        "OMP_NUM_THREADS": str(threads),
    }
    env.update({k: os.environ.get(k, "lo") for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")})
    env.update(extra)
    return env


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ while child interpreters start (they inherit it), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_payload(path: Path) -> dict | None:
    if not path.exists():
        return None
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without reporting a result"


class _Watch:
    """The launcher's view of its ranks: who reported what, who died, in which order."""

    def __init__(
        self,
        procs: list,
        out_dir: Path,
        restart: Callable[[int, int], Any] | None = None,
        max_restarts: int = 0,
    ):
        self.procs, self.out_dir = procs, out_dir
        self.payloads: dict[int, dict] = {}
        self.failed_at: dict[int, float] = {}
        # restart(rank, count) starts a rank again; at most max_restarts times over all ranks
        self.restart, self.restarts_left = restart, max_restarts
        self.restarts: list[int] = []

    def poll(self) -> None:
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            if r not in self.payloads:
                got = _read_payload(self.out_dir / f"rank{r}.pt")
                if got is not None:
                    self.payloads[r] = got
            died = r not in self.payloads and p.exitcode not in (None, 0)
            if died and self.restart is not None and self.restarts_left > 0:
                self.restarts_left -= 1
                self.restarts.append(r)
                log.warning("rank %d %s: starting it again", r, _describe_exit(p.exitcode))
                self.procs[r] = self.restart(r, self.restarts.count(r))
                continue
            failed = (r in self.payloads and not self.payloads[r]["ok"]) or died
            if failed:
                self.failed_at.setdefault(r, now)

    def done(self) -> bool:
        return len(self.payloads) == len(self.procs) and not self.failed_at

    def culprit(self) -> RankError:
        """The first cause: a rank that died silently or raised on its own, earliest seen first."""

        def consequence(r: int) -> bool:
            err = self.payloads.get(r, {}).get("error")
            return err is not None and any(s in err for s in _PEER_FAILURE)

        r = min(self.failed_at, key=lambda r: (consequence(r), self.failed_at[r], r))
        proc, payload = self.procs[r], self.payloads.get(r)
        where = f"rank {r} (pid {proc.pid}, host {socket.gethostname()})"
        if payload is None:
            return RankError(f"{where} {_describe_exit(proc.exitcode)}", r, proc.exitcode)
        return RankError(f"{where} failed: {payload['error']}", r, proc.exitcode, payload.get("tb", ""))


def _sigterm_to_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _supervise(watch: _Watch, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        watch.poll()
        if watch.done():
            return
        if watch.failed_at:
            grace = time.monotonic() + 2.0  # let peers of a dead rank report what they saw
            while time.monotonic() < grace and any(p.exitcode is None for p in watch.procs):
                time.sleep(0.05)
                watch.poll()
            err = watch.culprit()
            if err.traceback:
                log.debug("rank %s traceback:\n%s", err.rank, err.traceback)
            raise err
        if time.monotonic() > deadline:
            waiting = [r for r, p in enumerate(watch.procs) if r not in watch.payloads]
            raise RankError(f"rank(s) {waiting} did not finish within {timeout_s:g} s", waiting[0] if waiting else None)
        time.sleep(0.05)


def _stop(procs: list) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)


def spawn(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    *,
    threads: int = 1,
    backend: str = "auto",
    timeout_s: float = 600.0,
    pg_timeout_s: float = 120.0,
    setup: Callable[[int], Any] | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "spawn",
    init_group: bool = True,
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks; their return values, by rank.

    ``setup(rank)`` runs first in each rank (pin a CPU, slow it down, enter a namespace); what it
    returns is closed at the end if it has ``close()``. ``env`` is added to every rank's environment
    before its interpreter starts. ``init_group=False`` leaves joining to ``fn``
    (:func:`init_from_env`). ``fork`` starts faster than ``spawn`` where torch is not yet threaded.
    ``max_restarts``: a rank that dies without a result (killed, or exited without reporting) is
    started again, up to this many times over all ranks; the new process sees
    :func:`restart_count` > 0, does not join the default group (its peers formed it already) and
    finds them through :func:`rendezvous_store`. A rank that raised is a failure as before.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive integer, not {world!r}")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, not {threads!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative integer, not {max_restarts!r}")
    if timeout_s <= 0 or pg_timeout_s <= 0:
        raise ValueError(f"timeout_s and pg_timeout_s must be > 0, not {timeout_s!r} and {pg_timeout_s!r}")
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    main = threading.current_thread() is threading.main_thread()
    with tempfile.TemporaryDirectory(prefix="hwtopo-launch-") as tmp:
        job = _Job(fn, tuple(args), world, tmp, threads, backend, pg_timeout_s, setup, init_group)
        rdzv = f"file://{Path(tmp) / 'store'}"
        # typeshed types get_context(str) as BaseContext, which lacks the Process every real context has
        process = ctx.Process  # type: ignore[attr-defined]
        procs: list = []

        def start(r: int, restarts: int) -> Any:
            p = process(target=_rank_main, args=(r, job), name=f"rank{r}", daemon=False)
            extra = {**(env or {}), RESTART_VAR: str(restarts)}
            with _environ(_rank_env(r, world, threads, rdzv, extra)):
                p.start()
            return p

        previous = signal.signal(signal.SIGTERM, _sigterm_to_exit) if main else None
        try:
            for r in range(world):
                procs.append(start(r, 0))
            watch = _Watch(procs, Path(tmp), start, max_restarts)
            _supervise(watch, timeout_s)
            return [watch.payloads[r]["value"] for r in range(world)]
        finally:
            _stop(procs)
            if main:
                signal.signal(signal.SIGTERM, previous)
