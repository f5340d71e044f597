"""Real training steps on this machine, measured: step time, MemTracker peak, peak RSS cross-check.

This is the ground truth both predictors are trained and judged on.  A step is forward + backward +
optimizer step + zero_grad(set_to_none), at a precision setting (see `layers.PRECISIONS`).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time

import psutil
import torch
from torch import nn

from .layers import precision_setup
from .zoo import Shape, ZooModel

__all__ = ["OPTIMIZERS", "StepResult", "make_optimizer", "measure_training", "set_checkpointing"]

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
    mods = [m for m in zm.module.modules() if hasattr(m, "gradient_checkpointing_enable")]
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


def _step(zm: ZooModel, batch: dict, opt, scaler, autocast_dtype) -> tuple[object, torch.Tensor]:
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else torch.autocast("cpu", enabled=False)
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
    param_dtype, autocast_dtype = precision_setup(precision)
    zm.module.to(param_dtype)
    zm.module.train()
    set_checkpointing(zm, checkpointing) if checkpointing else None
    batch = zm.make_batch(shape, dtype=param_dtype)
    opt = make_optimizer(optimizer, [p for p in zm.module.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    for _ in range(warmup):
        _step(zm, batch, opt, scaler, autocast_dtype)
    times, cpu = [], []
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = _step(zm, batch, opt, scaler, autocast_dtype)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak, breakdown, rss = 0, {}, 0
    if track_memory:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(zm.module, opt, *batch.values())
        sampler = _RssSampler()
        sampler.start()
        with mt:
            out, loss = _step(zm, batch, opt, scaler, autocast_dtype)
            del out
        rss = sampler.stop()
        snap = mt.get_tracker_snapshot("peak")
        dev = next(iter(snap), None)
        if dev is not None:
            peak = int(snap[dev]["Total"])
            breakdown = {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items()}
    if checkpointing:
        set_checkpointing(zm, False)
    return StepResult(statistics.median(times), times, min(cpu), peak, breakdown, rss, float(loss))


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
