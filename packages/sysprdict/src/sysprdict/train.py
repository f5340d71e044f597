"""Real training steps on this machine, measured: step time, MemTracker peak, peak RSS cross-check.

This is the ground truth both predictors are trained and judged on.  A step is forward + backward +
optimizer step + zero_grad(set_to_none), at a precision setting (see `layers.PRECISIONS`).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import threading
import time
import warnings

import psutil
import torch
from torch import nn

from .layers import precision_setup
from .zoo import Shape, ZooModel

__all__ = ["OPTIMIZERS", "StepResult", "TrainingSession", "make_optimizer", "measure_training", "set_checkpointing"]

OPTIMIZERS = ("adamw", "sgd")


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """'adamw' (lr 1e-4) or 'sgd' (momentum 0.9); the single-tensor CPU implementations."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    raise ValueError(f"optimizer: {name!r} is not known; use one of {list(OPTIMIZERS)}")


def set_checkpointing(zm: ZooModel, on: bool) -> None:
    """Gradient checkpointing of every transformer block (transformers' own, non-reentrant)."""
    from transformers import PreTrainedModel

    mods = [m for m in zm.module.modules() if isinstance(m, PreTrainedModel)]
    if not mods and on:
        raise ValueError(f"checkpointing: model {zm.name} does not support gradient checkpointing")
    for m in mods[:1]:
        kwargs = {"use_reentrant": False}
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x name
            m.activation_checkpointing_enable(kwargs) if on else m.activation_checkpointing_disable()
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs) if on else (
                m.gradient_checkpointing_disable()
            )


@dataclasses.dataclass
class StepResult:
    step_time_s: float
    step_times_s: list[float]
    step_cpu_s: float
    peak_bytes: int
    breakdown: dict
    rss_peak_delta_bytes: int
    loss: float


class _RssSampler(threading.Thread):
    def __init__(self, period_s: float = 0.001):
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.period = period_s
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop_evt.set()
        self.join()
        return max(0, self.peak - self.base)


def _step(
    zm: ZooModel, batch: dict, opt, scaler, autocast_dtype, device_type: str = "cpu"
) -> tuple[object, torch.Tensor]:
    ctx = (
        torch.autocast(device_type, dtype=autocast_dtype)
        if autocast_dtype
        else torch.autocast(device_type, enabled=False)
    )
    with ctx:
        out = zm.module(**batch)
    loss = out.loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return out, loss.detach()


class TrainingSession:
    """One model set up for training at a precision (weights cast, optimizer, grad scaler, a fixed
    batch), warmed up, so timed steps can be taken in several rounds interleaved with other
    sessions (`profile.profile_grid`), and one memory-tracked step taken apart."""

    def __init__(
        self,
        zm: ZooModel,
        shape: Shape,
        precision: str = "fp32",
        optimizer: str = "adamw",
        checkpointing: bool = False,
        warmup: int = 1,
    ):
        param_dtype, self.autocast_dtype = precision_setup(precision)
        self.zm, self.checkpointing = zm, checkpointing
        zm.module.to(param_dtype)
        zm.module.train()
        self._ckpt(True)
        self.batch = zm.make_batch(shape, dtype=param_dtype)
        self.opt = make_optimizer(optimizer, [p for p in zm.module.parameters() if p.requires_grad])
        self.scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.loss = float("nan")
        for _ in range(warmup):
            self.step()
        self._ckpt(False)

    def _ckpt(self, on: bool) -> None:
        if self.checkpointing:
            set_checkpointing(self.zm, on)

    def step(self):
        return _step(self.zm, self.batch, self.opt, self.scaler, self.autocast_dtype)

    def time_steps(self, steps: int) -> None:
        """Take `steps` timed steps (wall and process CPU time), garbage collection paused."""
        self._ckpt(True)
        gc_on = gc.isenabled()
        gc.disable()
        try:
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                _, loss = self.step()
                self.times.append(time.perf_counter() - t0)
                self.cpu.append(time.process_time() - c0)
            self.loss = float(loss)
        finally:
            if gc_on:
                gc.enable()
            self._ckpt(False)

    def measure_memory(self) -> tuple[int, dict, int]:
        """MemTracker's peak (and its breakdown) over one step, and the peak RSS growth."""
        from torch.distributed._tools.mem_tracker import MemTracker

        self._ckpt(True)
        mt = MemTracker()
        mt.track_external(self.zm.module, self.opt, *self.batch.values())
        sampler = _RssSampler()
        sampler.start()
        with warnings.catch_warnings(), mt:
            _quiet_mod_tracker()
            out, loss = self.step()
            del out
        rss = sampler.stop()
        self._ckpt(False)
        self.loss = float(loss)
        snap = mt.get_tracker_snapshot("peak")
        dev = next(iter(snap), None)
        if dev is None:
            return 0, {}, rss
        return int(snap[dev]["Total"]), {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items()}, rss

    def result(self, peak: int = 0, breakdown: dict | None = None, rss: int = 0) -> StepResult:
        return StepResult(
            statistics.median(self.times), list(self.times), min(self.cpu), peak, breakdown or {}, rss, self.loss
        )


def measure_training(
    zm: ZooModel,
    shape: Shape,
    precision: str = "fp32",
    optimizer: str = "adamw",
    checkpointing: bool = False,
    steps: int = 3,
    warmup: int = 1,
    track_memory: bool = True,
) -> StepResult:
    """Train `zm` for `warmup + steps` steps on random data of `shape`; the memory peak is MemTracker's
    over one steady-state step (optimizer states already allocated), the times the median step's wall
    time and the smallest step's process CPU time (one thread: CPU time is the step's compute time
    even when other tenants of a shared machine stretch the wall time; the minimum is the least
    disturbed by their cache and SMT interference, as timeit reports)."""
    s = TrainingSession(zm, shape, precision, optimizer, checkpointing, warmup)
    s.time_steps(steps)
    return s.result(*(s.measure_memory() if track_memory else ()))


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _quiet_mod_tracker() -> None:
    """Silence ModTracker's "hierarchy tracking maybe messed up" warning (raised when a module is
    re-entered in backward, as activation checkpointing does): it concerns the per-module attribution,
    never the per-category totals read here. Call inside ``warnings.catch_warnings()``."""
    warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
