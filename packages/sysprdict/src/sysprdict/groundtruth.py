"""Ground truth independent of the predictors: one fresh process per configuration.

What a user pays is measured, never the predictor's own accounting:

  CPU peak    the process's peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs
              just before the model is built) minus the resident set measured at that moment, so
              the interpreter and imported libraries are not counted but everything the model,
              its optimizer, its batch and the runtime add (allocator caching, lazily created
              kernels' scratch, autograd's saved tensors) is
  GPU peak    the CUDA caching allocator's `max_memory_reserved` and `max_memory_allocated`
  step time   the median over timed steps after warm-up steps, wall and process CPU time, with the
              thread count pinned and recorded

Each configuration runs in its own child of a fork server that imported torch and transformers
once (`multiprocessing`'s forkserver), so a configuration never inherits another's heap, and the
per-process start-up cost is paid once.  A workload is named by an importable builder
("module:function") that returns a step callable, so a test can measure a workload whose peak is
known.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import multiprocessing as mp
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["GroundTruthError", "Measurement", "measure", "measure_many", "touch_buffer", "training_step"]

_PRELOAD = [
    "torch",
    "transformers",
    "sysprdict.groundtruth",
    "sysprdict.zoo",
    "sysprdict.layers",
    *(
        f"transformers.models.{m}.modeling_{m}"
        for m in ("llama", "qwen2", "qwen2_moe", "gpt2", "clip", "siglip", "vit", "llava", "qwen2_vl")
        + ("gpt_neox", "opt", "dinov2", "phi")
    ),
]
"""Imported once by the fork server: the zoo's and the held-out architectures' modeling code."""


class GroundTruthError(RuntimeError):
    """A configuration whose measurement failed (its process died, raised, or timed out)."""


@dataclasses.dataclass
class Measurement:
    """What one configuration cost, measured in its own process."""

    cpu_peak_bytes: int
    step_time_s: float
    step_cpu_s: float
    step_times_s: list[float]
    threads: int
    rss_before_bytes: int
    gpu_max_reserved_bytes: int | None = None
    gpu_max_allocated_bytes: int | None = None
    device: str = "cpu"
    tensor_accounting_bytes: int | None = None
    """MemTracker's peak of the tensors over one more step (a diagnostic, never the ground truth)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.M)
    if m is None:
        raise GroundTruthError(f"/proc/self/status has no {field} line; a Linux /proc is needed")
    return int(m.group(1)) * 1024


def _reset_peak() -> None:
    """Reset VmHWM to the current resident set (Linux: clear_refs value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _resolve(builder: str) -> Callable:
    mod, _, fn = builder.partition(":")
    if not mod or not fn:
        raise ValueError(f"builder: {builder!r} must be 'module:function'")
    return getattr(importlib.import_module(mod), fn)


MAX_STEPS_FACTOR = 10
"""`measure` times at most this many x `steps` steps to reach its `min_time_s`."""


def _timed_steps(step: Callable[[], None], steps: int, min_time_s: float, cuda: bool, device: str):
    """(wall, CPU) seconds of each timed step: at least `steps`, then more until they used `min_time_s`
    of CPU time, at most `MAX_STEPS_FACTOR` x `steps` (a short step's median needs more samples)."""
    import torch

    times: list[float] = []
    cpu: list[float] = []
    while len(cpu) < steps or (sum(cpu) < min_time_s and len(cpu) < MAX_STEPS_FACTOR * steps):
        if cuda:
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


def _run(
    builder: str,
    kwargs: dict,
    steps: int,
    warmup: int,
    threads: int,
    device: str,
    diagnostic: bool,
    min_time_s: float = 0.0,
) -> dict:
    """The child's body: pin threads, note the resident set, build, step, read the peaks."""

    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()  # per-model notices would repeat once per process
    warnings.simplefilter("ignore")
    cuda = device.startswith("cuda")
    build = _resolve(builder)
    prepare = getattr(build, "prepare", None)
    if prepare is not None:  # code the builder imports lazily is the interpreter's, not the model's
        prepare(**kwargs)
    gc.collect()
    rss0 = _status_bytes("VmRSS")
    _reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step = build(**kwargs, device=device)
    for _ in range(warmup):
        step()
    times, cpu = _timed_steps(step, steps, min_time_s, cuda, device)
    peak = _status_bytes("VmHWM") - rss0
    out = Measurement(
        cpu_peak_bytes=max(peak, 0),
        step_time_s=statistics.median(times) if times else 0.0,
        step_cpu_s=statistics.median(cpu) if cpu else 0.0,
        step_times_s=times,
        threads=torch.get_num_threads(),
        rss_before_bytes=rss0,
        device=device,
    )
    if cuda:
        out.gpu_max_reserved_bytes = int(torch.cuda.max_memory_reserved(device))
        out.gpu_max_allocated_bytes = int(torch.cuda.max_memory_allocated(device))
    tracked = getattr(step, "tracked", None)
    if diagnostic and tracked is not None:  # after the peaks were read: its hooks cost memory too
        out.tensor_accounting_bytes = int(tracked())
    return out.as_dict()


def _child(conn, builder: str, kwargs: dict, *args) -> None:
    try:
        conn.send(("ok", _run(builder, kwargs, *args)))
    except BaseException as e:  # noqa: BLE001 - any failure is reported to the parent, by type
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _refuse_if_too_large(builder: str, kwargs: dict | None, predicted_bytes: float, device: str) -> None:
    if device.startswith("cuda"):
        import torch

        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if predicted_bytes > free:
        raise GroundTruthError(
            f"{builder}({kwargs}): predicted peak {predicted_bytes / 2**20:.0f} MiB exceeds the "
            f"{free / 2**20:.0f} MiB {device} has available; not started"
        )


_CTX: mp.context.ForkServerContext | None = None


def _context() -> mp.context.ForkServerContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


def measure(
    builder: str,
    kwargs: dict | None = None,
    steps: int = 3,
    warmup: int = 1,
    threads: int = 1,
    device: str = "cpu",
    timeout_s: float = 300.0,
    diagnostic: bool = False,
    predicted_bytes: float | None = None,
    min_time_s: float = 0.0,
) -> Measurement:
    """Measure one configuration in a fresh process: `builder` ("module:function") is called with
    `kwargs` and `device=` and returns a step callable, run `warmup` then `steps` times (more, up to
    `MAX_STEPS_FACTOR` x `steps`, until the timed steps used `min_time_s` of CPU time).  With
    `diagnostic`, a step callable that has a `tracked()` method also reports MemTracker's tensor
    peak, taken after the real peaks were read.  A configuration whose `predicted_bytes` exceed the
    memory this machine has available is refused before any process starts."""
    if steps < 1 or warmup < 0 or threads < 1:
        raise ValueError(f"steps/warmup/threads: {steps}/{warmup}/{threads}; use steps >= 1, warmup >= 0, threads >= 1")
    if not min_time_s >= 0:
        raise ValueError(f"min_time_s: {min_time_s}; use a number of seconds >= 0")
    if not all(builder.partition(":")[::2]):
        raise ValueError(f"builder: {builder!r} must be 'module:function'")
    if predicted_bytes is not None:
        _refuse_if_too_large(builder, kwargs, predicted_bytes, device)
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    # the thread pools a child starts follow OMP_NUM_THREADS, which it inherits from the server
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    proc = ctx.Process(
        target=_child,
        args=(child, builder, dict(kwargs or {}), steps, warmup, threads, device, diagnostic, min_time_s),
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise GroundTruthError(f"{builder}({kwargs}): no result within {timeout_s:.0f} s")
        status, payload = parent.recv()
    except EOFError:
        proc.join(5)
        raise GroundTruthError(f"{builder}({kwargs}): its process died (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()
    if status != "ok":
        raise GroundTruthError(f"{builder}({kwargs}): {payload}")
    return Measurement(**payload)


def measure_many(configs: list[dict], progress: bool = False, **kw) -> list[Measurement]:
    """`measure` each of `configs` (dicts of builder and kwargs), one process each, in order."""
    from hwtopo import console

    bar = console.progress(total=len(configs), desc="ground truth", quiet=not progress)
    out = []
    for c in configs:
        out.append(measure(c["builder"], c.get("kwargs"), **kw))
        bar.update(1)
    bar.close()
    return out


# ----------------------------------------------------------------------------- workloads ---------


def touch_buffer(nbytes: int, device: str = "cpu") -> Callable[[], None]:
    """A workload whose peak is known: one buffer of `nbytes`, every page written, kept alive."""
    import torch

    buf = torch.ones(int(nbytes), dtype=torch.uint8, device=device)

    def step() -> None:
        buf.add_(1)

    return step


def training_step(
    model: str,
    batch: int,
    seq_len: int = 32,
    image_size: int = 32,
    precision: str = "fp32",
    optimizer: str = "adamw",
    device: str = "cpu",
) -> Callable[[], None]:
    """One training step of zoo (or held-out) model `model` at a precision, as the profiler runs it:
    forward, backward, optimizer step, zero_grad(set_to_none); on `device`."""
    import torch

    from .layers import precision_setup
    from .train import _step, make_optimizer
    from .zoo import Shape, build

    param_dtype, ac = precision_setup(precision)
    zm = build(model, image_size=image_size)
    zm.module.to(device=device, dtype=param_dtype)
    zm.module.train()
    data = {k: v.to(device) for k, v in zm.make_batch(Shape(batch, seq_len, image_size), dtype=param_dtype).items()}
    opt = make_optimizer(optimizer, [p for p in zm.module.parameters() if p.requires_grad])
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    scaler = torch.amp.GradScaler(dev_type) if precision == "fp16" else None

    def step() -> None:
        _step(zm, data, opt, scaler, ac, dev_type)

    def tracked() -> int:
        from torch.distributed._tools.mem_tracker import MemTracker

        from .train import _quiet_mod_tracker

        mt = MemTracker()
        mt.track_external(zm.module, opt, *data.values())
        with warnings.catch_warnings(), mt:
            _quiet_mod_tracker()
            step()
        snap = mt.get_tracker_snapshot("peak")
        return int(sum(v["Total"] for v in snap.values()))

    step.tracked = tracked  # type: ignore[attr-defined]
    return step


def _prepare_training(model: str, image_size: int = 32, **_: object) -> None:
    """Build `model` once on the meta device (no memory): imports and registers its classes."""
    import torch

    from .zoo import build

    with torch.device("meta"):
        build(model, image_size=image_size)


training_step.prepare = _prepare_training  # type: ignore[attr-defined]
