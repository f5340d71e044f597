"""Heavy kernels timed on this machine at the exact shape and dtype a model runs them.

A step's dense matmuls, convolutions and fused attention dominate its time, and their speed per
FLOP depends on shape and dtype in ways no fit over a few training models can extrapolate: on a
CPU with AMX, large bf16 matmuls are several times faster per FLOP than small ones, while an fp16
convolution backward has no fast kernel and is tens of times slower than bf16.  So the decomposition
records each such forward op as a replayable spec (`kernel_spec`: the op, its tensors' shapes,
strides, dtypes and which need gradients, its other arguments), and `kernel_seconds` replays it on
random data, forward plus the backward autograd runs for it, one thread (as the ground truth runs),
and keeps the minimum process CPU time.  Only the kernel is run, never the model or its step; a
spec above `REPLAY_MAX_BYTES` of operands or `REPLAY_MAX_FLOPS` is not replayed (the caller costs
it another way).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

__all__ = [
    "KERNEL_SECONDS",
    "REPLAY_MAX_BYTES",
    "REPLAY_MAX_FLOPS",
    "kernel_seconds",
    "kernel_spec",
    "one_thread",
    "replayable",
    "spec_info",
    "time_kernels",
]

REPLAYED_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")
"""Forward ops replayed (CPU kernels with autograd formulas); other heavy ops are costed by the fit."""
REPLAY_MAX_BYTES = 256 * 2**20
"""Operands above this are not replayed (a 70B model's projections would take seconds each)."""
REPLAY_MAX_FLOPS = 4e9
"""Nor are forward ops above this many FLOPs (a tenth of a second or more each at one thread)."""
KERNEL_SECONDS: dict[str, float] = {}
"""Replayed forward + backward seconds per spec, measured once per process."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a kernel timing at one intra-op thread, as the ground truth's steps run: with more, the
    process CPU time also counts threads spinning at barriers, which a busy machine inflates."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _arg_spec(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return {
            "shape": list(x.shape),
            "stride": list(x.stride()),
            "dtype": str(x.dtype).replace("torch.", ""),
            "grad": bool(x.requires_grad),
        }
    if x is None or isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, (list, tuple)) and all(isinstance(y, (bool, int, float)) for y in x):
        return list(x)
    raise TypeError(type(x).__name__)


def kernel_spec(name: str, args: tuple, kwargs: dict, dtype: str, flops: int, mm_shape: tuple | None) -> str | None:
    """A JSON spec of one forward heavy op that `kernel_seconds` can replay, or None (an op not in
    `REPLAYED_OPS`, or an argument that is not a tensor, number, None or list of numbers)."""
    if name not in REPLAYED_OPS:
        return None
    try:
        a = [_arg_spec(x) for x in args]
        kw = {k: _arg_spec(v) for k, v in kwargs.items()}
    except TypeError:
        return None
    cls = "sdpa" if name.startswith("_scaled") else "matmul"
    info = {"op": name, "args": a, "kwargs": kw, "dtype": dtype, "flops": flops, "class": cls}
    info["mm"] = ":".join(map(str, mm_shape)) if mm_shape else None
    return json.dumps(info, sort_keys=True)


def spec_info(spec: str) -> dict:
    """The decoded spec: op, args, kwargs, dtype, flops, class ("matmul"/"sdpa"), mm ("b:m:k:n")."""
    return json.loads(spec)


def _operand_bytes(info: dict) -> int:
    total = 0
    for a in [*info["args"], *info["kwargs"].values()]:
        if isinstance(a, dict) and "shape" in a:
            total += math.prod(a["shape"]) * (2 if a["dtype"] in ("bfloat16", "float16") else 4)
    return total


def replayable(spec: str) -> bool:
    """Whether `kernel_seconds` will replay `spec` (within `REPLAY_MAX_BYTES` and `REPLAY_MAX_FLOPS`)."""
    info = spec_info(spec)
    return _operand_bytes(info) <= REPLAY_MAX_BYTES and info["flops"] <= REPLAY_MAX_FLOPS


def _materialize(a: Any, gen) -> Any:
    import torch

    if not (isinstance(a, dict) and "shape" in a):
        return a
    dt = getattr(torch, a["dtype"])
    shape, stride = a["shape"], a["stride"]
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    if dt.is_floating_point:
        base = (torch.randn(max(extent, 1), generator=gen) * 0.5).to(dt)
    else:
        base = torch.ones(max(extent, 1), dtype=dt)
    t = torch.as_strided(base, shape, stride).detach()
    return t.requires_grad_(a["grad"] and dt.is_floating_point)


def _replay_fn(info: dict):
    """The timed callable: the op forward, then the gradients autograd computes for its inputs."""
    import torch

    gen = torch.Generator().manual_seed(0)
    args = [_materialize(a, gen) for a in info["args"]]
    kwargs = {k: _materialize(v, gen) for k, v in info["kwargs"].items()}
    op = getattr(torch.ops.aten, info["op"]).default
    needs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.no_grad():
        probe = op(*args, **kwargs)
    first = probe[0] if isinstance(probe, (tuple, list)) else probe
    go = torch.randn(first.shape, generator=gen).to(first.dtype)

    def run() -> None:
        out = op(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if needs:
            torch.autograd.grad(out, needs, go)

    return run


def kernel_seconds(spec: str) -> float:
    """Forward + backward seconds of the op `spec` describes, replayed on this machine at one
    thread (cached per process in `KERNEL_SECONDS`)."""
    if spec not in KERNEL_SECONDS:
        from .timepred import _best_cpu_s

        with one_thread():
            KERNEL_SECONDS[spec] = _best_cpu_s(_replay_fn(spec_info(spec)))
    return KERNEL_SECONDS[spec]


def time_kernels(specs: list[str], passes: int = 3) -> int:
    """Time every replayable spec in `specs` in `passes` interleaved passes over all of them, keeping
    each one's minimum: on a shared machine the load comes and goes, and passes spread over the whole
    run catch each kernel in a quiet moment more often than repeats of it back to back.  Returns how
    many specs were timed."""
    from .timepred import _best_cpu_s

    todo = sorted({s for s in specs if replayable(s)})
    with one_thread():
        for _ in range(passes):
            for spec in todo:  # operands rebuilt each pass: only one kernel's are alive at a time
                t = _best_cpu_s(_replay_fn(spec_info(spec)))
                KERNEL_SECONDS[spec] = min(KERNEL_SECONDS.get(spec, t), t)
    return len(todo)
