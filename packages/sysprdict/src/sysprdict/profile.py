"""The profiler: real training steps over a grid, recorded into the versioned dataset.

Single-process configurations run in this process (one thread).  Data-parallel ones (world size
> 1) spawn gloo ranks on localhost, each with one thread, a timeout on the process group, and a
clear error naming a rank that died; rank 0 also measures the gloo all-reduce bandwidth, which the
communication model of the time predictor uses.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import logging
import os
import platform
import queue as queue_mod
import socket
import statistics
import time
from collections.abc import Iterable

import torch

from .layers import PRECISIONS
from .train import OPTIMIZERS, TrainingSession, measure_training
from .zoo import FAMILIES, MODALITY, Shape, build, parse_model_name

log = logging.getLogger(__name__)

__all__ = ["GridPoint", "ProfileError", "default_grid", "profile_grid", "run_point"]


class ProfileError(RuntimeError):
    """A profiling run that failed (a dead rank, a timeout)."""


@dataclasses.dataclass(frozen=True)
class GridPoint:
    model: str
    batch: int
    seq_len: int = 32
    image_size: int = 32
    precision: str = "fp32"
    optimizer: str = "adamw"
    checkpointing: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        parse_model_name(self.model)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: {self.precision!r} is not known; use one of {list(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: {self.optimizer!r} is not known; use one of {list(OPTIMIZERS)}")
        if self.world_size < 1 or self.world_size > 8:
            raise ValueError(f"world_size: {self.world_size!r} is not valid; use 1..8 gloo ranks")
        Shape(self.batch, self.seq_len, self.image_size)


def default_grid(quick: bool = True) -> list[GridPoint]:
    """The bench/demo grid: every family, two or three sizes, fp32/bf16/fp16 (+ mixed when not
    quick), one or two batch sizes, AdamW and SGD alternating."""
    fams = FAMILIES
    sizes = ["s", "m"] if quick else ["s", "m", "l"]
    batches = [2] if quick else [2, 4]
    precs = ["fp32", "bf16", "fp16"] if quick else list(PRECISIONS)
    pts = []
    for i, (fam, size, b, prec) in enumerate(itertools.product(fams, sizes, batches, precs)):
        opt = "adamw" if i % 3 else "sgd"
        pts.append(GridPoint(f"{fam}-{size}", b, 32 if size == "s" else 48, 32, prec, opt))
    # data-parallel points (2 gloo ranks): an extra, non-headline check of compute + all-reduce
    pts += [GridPoint("llama-s", 2, 32, 32, "fp32", "adamw", world_size=2)]
    pts += [GridPoint("vit-s", 2, 32, 32, "bf16", "sgd", world_size=2)]
    return pts


def _row(p: GridPoint, res_time: float, times: list[float], cpu: float, peak: int, breakdown: dict, rss: int) -> dict:
    family, size = parse_model_name(p.model)
    return {
        **dataclasses.asdict(p),
        "family": family,
        "size": size,
        "modality": MODALITY[family],
        "step_time_s": float(res_time),
        "step_times_s": [float(t) for t in times],
        "step_cpu_s": float(cpu),
        "peak_bytes": int(peak),
        "breakdown": breakdown,
        "rss_peak_delta_bytes": int(rss),
        "threads": torch.get_num_threads(),
        "host": platform.node(),
        "torch": torch.__version__,
        "emulated": False,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def run_point(p: GridPoint, steps: int = 3, timeout_s: float = 300.0) -> dict:
    """Measure one grid point (in process, or as gloo ranks when world_size > 1)."""
    if p.world_size == 1:
        zm = build(p.model, image_size=p.image_size)
        r = measure_training(
            zm, Shape(p.batch, p.seq_len, p.image_size), p.precision, p.optimizer, p.checkpointing, steps
        )
        return _row(p, r.step_time_s, r.step_times_s, r.step_cpu_s, r.peak_bytes, r.breakdown, r.rss_peak_delta_bytes)
    return _run_ddp(p, steps, timeout_s)


def profile_grid(points: Iterable[GridPoint], steps: int = 3, progress: bool = True, rounds: int = 1) -> list[dict]:
    """Measure every point.  With `rounds` > 1 the single-process points stay set up (warmed up)
    and their timed steps are taken in `rounds` interleaved passes over the grid (`steps` each,
    alternate passes in reverse order): a stretch of interference from other tenants of the
    machine then slows one pass of every point instead of every step of a few, and each point's
    minimum CPU time comes from its least disturbed pass."""
    if rounds < 1:
        raise ValueError(f"rounds: {rounds} must be >= 1 timing pass over the grid")
    points = list(points)
    from tqdm import tqdm

    rows: list[dict | None] = [None] * len(points)
    sessions: dict[int, tuple[TrainingSession, tuple]] = {}
    bar = tqdm(total=len(points) * rounds, desc="profile", disable=not progress, leave=False)
    for i, p in enumerate(points):
        if p.world_size > 1:
            rows[i] = run_point(p, steps)
        else:
            s = _session(p)
            s.time_steps(steps)
            sessions[i] = (s, s.measure_memory())
        bar.update(rounds if p.world_size > 1 else 1)
    order = sorted(sessions)
    for r in range(1, rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            sessions[i][0].time_steps(steps)
            bar.update(1)
    bar.close()
    for i, (s, mem) in sessions.items():
        res = s.result(*mem)
        rows[i] = _row(points[i], res.step_time_s, res.step_times_s, res.step_cpu_s, *mem)
        rows[i]["rounds"] = rounds
    return [r for r in rows if r is not None]


def _session(p: GridPoint) -> TrainingSession:
    zm = build(p.model, image_size=p.image_size)
    return TrainingSession(zm, Shape(p.batch, p.seq_len, p.image_size), p.precision, p.optimizer, p.checkpointing)


# ---------------------------------------------------------------- data parallel (gloo) ----------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, ws: int, port: int, p: GridPoint, steps: int, q, timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .train import _step, make_optimizer

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=ws,
            timeout=dt.timedelta(seconds=timeout_s),
        )
        from .layers import precision_setup

        param_dtype, ac = precision_setup(p.precision)
        zm = build(p.model, image_size=p.image_size)
        zm.module.to(param_dtype)
        ddp = DDP(zm.module)
        dzm = dataclasses.replace(zm, module=ddp)
        batch = zm.make_batch(Shape(p.batch, p.seq_len, p.image_size), dtype=param_dtype, seed=rank)
        opt = make_optimizer(p.optimizer, ddp.parameters())
        scaler = torch.amp.GradScaler("cpu") if p.precision == "fp16" else None
        _step(dzm, batch, opt, scaler, ac)
        times, cpu = [], []
        for _ in range(steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(dzm, batch, opt, scaler, ac)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        # all-reduce bandwidth of this process group (for the communication model)
        buf = torch.zeros(1 << 20)
        dist.all_reduce(buf)
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(buf)
        ar = (time.perf_counter() - t0) / 3
        algbw = buf.numel() * 4 * 2 * (ws - 1) / ws / ar
        t = torch.tensor([statistics.median(times), min(cpu)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            q.put(("ok", rank, (float(t[0]), float(t[1])), times, algbw))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the parent by rank
        q.put(("error", rank, f"{type(e).__name__}: {e}", None, None))
        raise SystemExit(1) from None


def _run_ddp(p: GridPoint, steps: int, timeout_s: float) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, p.world_size, port, p, steps, q, min(timeout_s, 120.0)), daemon=True)
        for r in range(p.world_size)
    ]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + timeout_s
    result = None
    try:
        while result is None:
            try:
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "error":
                    raise ProfileError(f"data-parallel run of {p.model}: rank {msg[1]} failed: {msg[2]}")
                result = msg
                break
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                try:  # the dead rank usually left its reason on the queue
                    msg = q.get(timeout=2.0)
                    if msg[0] == "error":
                        raise ProfileError(f"data-parallel run of {p.model}: rank {msg[1]} failed: {msg[2]}")
                except queue_mod.Empty:
                    pass
                raise ProfileError(
                    f"data-parallel run of {p.model}: rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                )
            if time.monotonic() > deadline:
                raise ProfileError(f"data-parallel run of {p.model}: timed out after {timeout_s:.0f}s")
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
                pr.join()
    _, _, (t, cpu), times, algbw = result
    row = _row(p, t, times, cpu, 0, {}, 0)
    row["allreduce_bandwidth_bytes_per_s"] = algbw
    return row
