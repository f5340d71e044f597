"""The profiler: real training steps over a grid, recorded into the versioned dataset.

Single-process configurations run in this process (one thread).  Data-parallel ones (world size
> 1) run as gloo ranks through hwtopo.launch.spawn (one thread each, a timeout on the process group,
an error naming the rank that failed); rank 0 also reports the gloo all-reduce bandwidth, which the
communication model of the time predictor uses.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import logging
import platform
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
    from hwtopo import console

    rows: list[dict | None] = [None] * len(points)
    sessions: dict[int, tuple[TrainingSession, tuple]] = {}
    bar = console.progress(total=len(points) * rounds, desc="profile", quiet=not progress)
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
        row = _row(points[i], res.step_time_s, res.step_times_s, res.step_cpu_s, *mem)
        row["rounds"] = rounds
        rows[i] = row
    return [r for r in rows if r is not None]


def _session(p: GridPoint) -> TrainingSession:
    zm = build(p.model, image_size=p.image_size)
    return TrainingSession(zm, Shape(p.batch, p.seq_len, p.image_size), p.precision, p.optimizer, p.checkpointing)


# ---------------------------------------------------------------- data parallel (gloo) ----------


def _ddp_rank(rank: int, world: int, p: GridPoint, steps: int) -> dict:
    """One gloo rank of a data-parallel point (run by hwtopo.launch.spawn, its group joined)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .layers import precision_setup
    from .train import _step, make_optimizer

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
    t = torch.tensor([statistics.median(times), min(cpu)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    algbw = buf.numel() * 4 * 2 * (world - 1) / world / ar
    return {"time_s": float(t[0]), "cpu_s": float(t[1]), "times_s": times, "allreduce_bytes_per_s": algbw}


def _run_ddp(p: GridPoint, steps: int, timeout_s: float) -> dict:
    """Measure a data-parallel point on `world_size` local gloo ranks; a failed rank is named."""
    from hwtopo.launch import RankError, spawn

    try:
        results = spawn(
            _ddp_rank,
            p.world_size,
            (p, steps),
            backend="gloo",
            timeout_s=timeout_s,
            pg_timeout_s=min(timeout_s, 120.0),
        )
    except RankError as e:
        raise ProfileError(f"data-parallel run of {p.model}: {e}") from e
    r0 = results[0]
    row = _row(p, r0["time_s"], r0["times_s"], r0["cpu_s"], 0, {}, 0)
    row["allreduce_bandwidth_bytes_per_s"] = r0["allreduce_bytes_per_s"]
    return row
