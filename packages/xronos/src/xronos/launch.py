"""Local multi-process launch (spawn) and torchrun-style env rendezvous, with dead-rank detection.

Each worker runs with one thread, optionally slowed to a relative speed (emulated heterogeneity):
``emulate="dilate"`` (default) installs ``hwtopo.dilate``: the rank computes at full speed and sleeps
``(1/speed - 1)`` x its thread CPU time at every synchronisation point (the collectives, sends and
receives, the ends of timed regions call ``hwtopo.sync_point()``), so every compute segment is
steadily ``1/speed`` as long; ``emulate="cgroup"`` uses the CPU quota of ``hwtopo.throttle``. The
worker joins a gloo group with a timeout, runs ``fn`` and
writes its result atomically to a per-rank file. The parent polls the workers: a rank that exits
with an error or dies stops the run with a message naming the rank, never a hang.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "WorkerError",
    "spawn",
    "worker_env",
    "free_port",
    "init_group",
    "init_from_env",
    "emulate_speed",
    "pin_ranks",
    "EMULATIONS",
    "emulation_label",
]

log = logging.getLogger(__name__)

# cgroup quota period for emulated slow ranks. hwtopo uses 100 ms; a TP step synchronises every few
# milliseconds, so a long period turns a steady 0.5x into bursts of full speed and full stops. The
# kernel's smallest quota is 1 ms, so the period is the shortest that keeps the quota at 1 ms.
THROTTLE_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000


def throttle_period_us(speed: float) -> int:
    """Shortest cgroup period (<= THROTTLE_PERIOD_US) whose quota at ``speed`` is at least 1 ms.

    ``XRONOS_THROTTLE_PERIOD_US`` overrides it (a fixed period for every throttled rank, for studying
    how the emulation's granularity shows up in the waits).
    """
    fixed = os.environ.get("XRONOS_THROTTLE_PERIOD_US")
    if fixed:
        return max(int(fixed), int(math.ceil(MIN_QUOTA_US / speed)))
    return min(THROTTLE_PERIOD_US, max(MIN_QUOTA_US, int(round(MIN_QUOTA_US / speed))))


# glibc malloc for the workers: keep freed memory in the heap instead of returning it to the kernel
# (mmap/munmap of every large activation, trimming the heap top). Otherwise each training step
# re-faults thousands of fresh pages (1.7k-28k minor faults a step measured on the bench's model), and
# in a VM that returns freed pages to the host each fault is slow and uneven: step-to-step jitter of
# the compute between two synchronisations. Applies to every rank and so to every variant alike;
# an explicit GLIBC_TUNABLES in the environment wins.
WORKER_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296"}


def worker_env() -> dict:
    """The environment entries :func:`spawn` adds to its workers (those not already set here)."""
    return {k: v for k, v in WORKER_ENV.items() if k not in os.environ}


class WorkerError(RuntimeError):
    """A rank failed, died or timed out; the message names the rank."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, port: int, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
    """Join a gloo process group over TCP with a timeout on rendezvous and every collective."""
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("XRONOS_BACKEND") == "nccl" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
    )


def init_from_env(timeout_s: float = 60.0) -> tuple[int, int]:
    """torchrun / multi-node: rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise WorkerError(f"environment variable {missing[0]} is not set; launch with torchrun or set it")
    dist.init_process_group("gloo", init_method="env://", timeout=_dt.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


EMULATIONS = ("dilate", "cgroup")


def check_emulation(emulate: str) -> str:
    if emulate not in EMULATIONS:
        raise ValueError(f"emulate must be one of {', '.join(EMULATIONS)}, not {emulate!r}")
    return emulate


def emulation_label(emulate: str) -> str:
    """What every table and JSON says: 'dilation' (hwtopo.dilate) or 'cgroup' (hwtopo.throttle's quota)."""
    return "dilation" if check_emulation(emulate) == "dilate" else "cgroup"


def emulate_speed(speed: float, emulate: str = "dilate"):
    """Make this process run at ``speed`` of one CPU (emulated); an object with ``close()``, or None.

    ``dilate``: a process-wide ``hwtopo.Dilation`` measured on the calling thread (call this from the
    thread that computes); ``cgroup``: ``hwtopo.throttle``'s CPU quota with a short period.
    """
    check_emulation(emulate)
    if speed >= 1.0:
        return None
    import hwtopo

    if emulate == "dilate":
        return hwtopo.dilate(speed)

    # the shortest period whose quota is still >= the kernel's 1 ms minimum: finer-grained slices
    # (method="cgroup": no silent duty-cycle fallback under a 'cgroup' label; hwtopo names what is missing)
    return hwtopo.throttle(os.getpid(), speed=speed, cpus=1, method="cgroup", period_s=throttle_period_us(speed) / 1e6)


def _atomic_pickle(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def pin_ranks(shares: list[float], cpus: list[int] | None = None) -> list[int] | None:
    """A CPU for each rank such that no CPU carries more than one CPU's worth of quota, or None.

    First-fit decreasing over this process's allowed CPUs: an emulated rank pinned to its own core (or
    sharing one with ranks whose quotas fit beside it) is never pushed off by another rank's threads,
    so its speed is the quota, not the quota minus contention. None when the shares do not fit.
    """
    avail = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    load = {c: 0.0 for c in avail}
    out: list[int | None] = [None] * len(shares)
    for r in sorted(range(len(shares)), key=lambda r: -shares[r]):
        cpu = next((c for c in avail if load[c] + shares[r] <= 1.0 + 1e-9), None)
        if cpu is None:
            return None
        load[cpu] += shares[r]
        out[r] = cpu
    return out  # type: ignore[return-value]


def _worker(rank, world_size, port, fn, args, out_dir, speed, pg_timeout_s, cpu=None, emulate="dilate"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    out = Path(out_dir)
    throttle = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        throttle = emulate_speed(speed, emulate)
        init_group(rank, world_size, port, pg_timeout_s)
        result = fn(rank, world_size, *args)
        _atomic_pickle(result, out / f"rank{rank}.pkl")
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
        msg = f"{type(e).__name__}: {e}".strip()
        (out / f"rank{rank}.err").write_text(msg + "\n\n" + traceback.format_exc())
        os._exit(1)
    finally:
        if throttle is not None:
            throttle.close()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    # The result is written and every rank passed the barrier: leave without the interpreter's teardown. A
    # clean-clone CI run (2026-12-01) had a rank abort there ("terminate called without an active exception",
    # exit -6) after its work was done, in a C++ destructor, which failed a test that had passed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_PEER_FAILURES = ("Timeout", "timed out", "Connection reset", "Connection closed", "Broken pipe", "gloo/transport")


def _first_line(path: Path) -> str:
    """The one-line error a rank wrote before exiting ('' if it wrote none)."""
    return path.read_text().split("\n\n")[0] if path.exists() else ""


def _is_peer_failure(msg: str) -> bool:
    """True for errors a rank gets because another rank died (not its own root cause)."""
    return any(s in msg for s in _PEER_FAILURES)


def spawn(
    fn,
    world_size: int,
    args: tuple = (),
    speeds: list[float] | None = None,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
    cpus: list[int] | None = None,
    emulate: str = "dilate",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return each rank's result.

    ``cpus``: pin rank r to CPU ``cpus[r]`` (see :func:`pin_ranks`); None leaves placement to the OS.
    ``emulate``: how a rank with ``speeds[r] < 1`` is slowed ("dilate" or "cgroup", see the module doc).
    """
    check_emulation(emulate)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    speeds = list(speeds) if speeds is not None else [1.0] * world_size
    if len(speeds) != world_size:
        raise ValueError(f"speeds has {len(speeds)} entries but world_size is {world_size}")
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="xronos-") as tmp:
        procs = []
        extra = worker_env()
        os.environ.update(extra)  # inherited by the spawned interpreters (glibc reads it at start)
        try:
            for r in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(
                        r,
                        world_size,
                        port,
                        fn,
                        args,
                        tmp,
                        speeds[r],
                        pg_timeout_s,
                        None if cpus is None else cpus[r],
                        emulate,
                    ),
                    daemon=False,
                )
                p.start()
                procs.append(p)
        finally:
            for k in extra:
                os.environ.pop(k, None)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                codes = [p.exitcode for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    # peers of a failed rank fail too (connection reset, timeout): give them a moment to
                    # exit, then name the rank whose error is its own rather than a consequence
                    grace = time.monotonic() + 3.0
                    while time.monotonic() < grace and any(p.exitcode is None for p in procs):
                        time.sleep(0.05)
                    codes = [p.exitcode for p in procs]
                    bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                    errs = {r: _first_line(Path(tmp) / f"rank{r}.err") for r, _ in bad}
                    first = next((r for r, _ in bad if errs[r] and not _is_peer_failure(errs[r])), bad[0][0])
                    msg = errs[first]
                    code = codes[first]
                    detail = msg or f"exited with code {code}" + (" (killed by a signal)" if code < 0 else "")
                    raise WorkerError(f"rank {first} failed: {detail}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    waiting = [r for r, c in enumerate(codes) if c is None]
                    raise WorkerError(f"timed out after {timeout_s:.0f}s waiting for rank(s) {waiting}")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r in range(world_size):
            with open(Path(tmp) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
