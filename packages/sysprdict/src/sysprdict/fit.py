"""Out-of-memory guard: the largest batch (and the settings) predicted to fit a memory limit.

A trainer calls `check_fits(...)` before starting, or `largest_batch(...)` to size its batch.  The
memory predictor is evaluated on exact decompositions (fake-tensor traces, no real memory); a safety
`margin` (default 10%) is kept between the predicted peak and the limit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import hwtopo

from .layers import decompose
from .memory import MemoryPrediction, TrainSetup, predict_memory, with_overhead
from .zoo import Shape, ZooModel, build

log = logging.getLogger(__name__)

__all__ = ["FitResult", "OutOfMemoryPredicted", "check_fits", "largest_batch"]


class OutOfMemoryPredicted(RuntimeError):
    """The configuration is predicted to exceed the memory limit."""


@dataclasses.dataclass
class FitResult:
    model: str
    fits: bool
    batch: int
    seq_len: int
    image_size: int
    precision: str
    optimizer: str
    checkpointing: bool
    limit_bytes: float
    predicted_peak_bytes: float
    margin_bytes: float
    margin_fraction: float
    peak_event: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if not self.fits:
            return (
                f"{self.model}: nothing fits in {hwtopo.format_bytes(self.limit_bytes)} "
                f"(batch 1 needs {hwtopo.format_bytes(self.predicted_peak_bytes)})"
            )
        return (
            f"{self.model}: batch {self.batch} ({self.precision}, {self.optimizer}, "
            f"checkpointing {'on' if self.checkpointing else 'off'}) -> predicted peak "
            f"{hwtopo.format_bytes(self.predicted_peak_bytes)} of {hwtopo.format_bytes(self.limit_bytes)}, "
            f"margin {hwtopo.format_bytes(self.margin_bytes)} ({self.margin_fraction:.0%})"
        )


def _limit(memory: float | str) -> float:
    v = hwtopo.parse_bytes(memory, "memory") if isinstance(memory, str) else float(memory)
    if v <= 0:
        raise ValueError(f"memory: {memory!r} is not a positive size; use e.g. 24GiB")
    return v


def _predict(
    zm: ZooModel, b: int, seq_len: int, image_size: int, precision: str, setup: TrainSetup, overhead=None
) -> MemoryPrediction:
    d = decompose(zm, Shape(b, seq_len, image_size), precision)
    pred = predict_memory(d, setup)
    return with_overhead(pred, d, overhead) if overhead is not None else pred


def check_fits(
    model: str | ZooModel,
    memory: float | str,
    batch: int,
    seq_len: int = 64,
    image_size: int = 32,
    precision: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: bool = False,
    zero_stage: int = 0,
    world_size: int = 1,
    margin: float = 0.1,
    overhead=None,
) -> MemoryPrediction:
    """Raise OutOfMemoryPredicted if the configuration's predicted peak (+margin) exceeds `memory`
    (the real peak, tensors + runtime, with a fitted `overhead.RuntimeOverhead`)."""
    zm = build(model, image_size=image_size) if isinstance(model, str) else model
    limit = _limit(memory)
    setup = TrainSetup(optimizer, checkpointing, zero_stage, world_size)
    pred = _predict(zm, batch, seq_len, image_size, precision, setup, overhead)
    if pred.peak_bytes * (1 + margin) > limit:
        raise OutOfMemoryPredicted(
            f"{zm.name} batch {batch}: predicted peak {hwtopo.format_bytes(pred.peak_bytes)} (+{margin:.0%} margin) "
            f"exceeds {hwtopo.format_bytes(limit)}"
        )
    return pred


def _largest_fitting(
    peak: Callable[[int], MemoryPrediction], p1: MemoryPrediction, budget: float, max_batch: int
) -> tuple[int, MemoryPrediction]:
    """The largest batch (<= ``max_batch``) whose predicted peak fits ``budget``, given that batch 1 fits:
    a linear guess from batches 1 and 2, doubling past it while it fits, then bisection on exact traces."""
    p2 = peak(2)
    slope = max(p2.peak_bytes - p1.peak_bytes, 1.0)
    guess = int(min(max_batch, 1 + (budget - p1.peak_bytes) // slope))
    lo, lo_pred = 1, p1  # largest known to fit
    hi = guess + 1  # smallest known (or assumed) not to fit
    g = peak(guess) if guess > 1 else p1
    if guess > 1 and g.peak_bytes <= budget:
        lo, lo_pred = guess, g
        while hi <= max_batch:
            gh = peak(hi)
            if gh.peak_bytes > budget:
                break
            lo, lo_pred, hi = hi, gh, hi * 2
        hi = min(hi, max_batch + 1)
    elif guess > 1:
        hi = guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        pm = peak(mid)
        if pm.peak_bytes <= budget:
            lo, lo_pred = mid, pm
        else:
            hi = mid
    return lo, lo_pred


def largest_batch(
    model: str | ZooModel,
    memory: float | str,
    seq_len: int = 64,
    image_size: int = 32,
    precision: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: bool | None = None,
    zero_stage: int = 0,
    world_size: int = 1,
    margin: float | None = 0.1,
    max_batch: int = 1 << 16,
    overhead=None,
) -> FitResult:
    """The largest batch whose predicted peak x (1 + margin) fits `memory`.  With
    `checkpointing=None` gradient checkpointing is tried when nothing fits without it.  With a
    fitted `overhead.RuntimeOverhead` the peak is the process's real peak (tensors + runtime), and
    `margin=None` takes the overhead's own margin (its largest under-prediction in training)."""
    if margin is None:
        if overhead is None:
            raise ValueError("margin: None is only valid with a fitted overhead (its own margin)")
        margin = overhead.margin
    if margin < 0:
        raise ValueError(f"margin: {margin!r} must be >= 0")
    zm = build(model, image_size=image_size) if isinstance(model, str) else model
    limit = _limit(memory)
    budget = limit / (1 + margin)
    choices = [checkpointing] if checkpointing is not None else [False, True]
    best: FitResult | None = None
    for ck in choices:
        setup = TrainSetup(optimizer, ck, zero_stage, world_size)

        def peak(b: int, setup=setup) -> MemoryPrediction:
            return _predict(zm, b, seq_len, image_size, precision, setup, overhead)

        p1 = peak(1)
        if p1.peak_bytes > budget:
            best = best or FitResult(
                zm.name, False, 0, seq_len, image_size, precision, optimizer, ck, limit, p1.peak_bytes, 0.0, 0.0
            )
            continue
        lo, lo_pred = _largest_fitting(peak, p1, budget, max_batch)
        res = FitResult(
            zm.name,
            True,
            lo,
            seq_len,
            image_size,
            precision,
            optimizer,
            ck,
            limit,
            lo_pred.peak_bytes,
            limit - lo_pred.peak_bytes,
            (limit - lo_pred.peak_bytes) / limit,
            lo_pred.peak_event,
        )
        return res
    assert best is not None
    return best
