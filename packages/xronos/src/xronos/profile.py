"""Lightweight profiling: each rank times its real shard computations and fits a cost model.

For a few shard sizes a rank times the forward+backward of one layer's attention shard (q/k/v/o
projections plus scaled-dot-product attention over its heads) and MLP shard (gate/up/down), fits
``seconds = fixed + per_unit * units`` by least squares, adds what every rank repeats in full (the
RMSNorms, and the LM head spread over the layers) to the fixed part, and times one all-reduce of a
layer's activations. Seconds, not minutes. :func:`costs_from_cluster` reads speeds and memory from an
``hwtopo`` cluster spec instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hwtopo import resume_point, sync_point

from .layers import _active
from .partition import ModelShape, PartitionError, RankCost, costs_from_speeds

__all__ = ["fit_affine", "time_call", "profile_rank", "profile_group", "costs_from_cluster"]


def fit_affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a >= 0`` and ``b > 0`` (refit through the origin if a < 0)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("fit_affine needs at least two (x, y) points")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0 or b <= 0:
        a = 0.0
        b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, max(b, 1e-12)


def time_call(fn, min_time_s: float = 0.02, repeats: int = 3, warmup: bool = True) -> float:
    """Median seconds per call, each measurement running ``fn`` long enough to span ``min_time_s``.

    Each call ends at an ``hwtopo.sync_point()`` inside the timed region, so under the compute-dilation
    emulation the profile sees the rank's emulated speed (a no-op otherwise).
    """

    def call():
        fn()
        sync_point()

    sync_point()  # what ran before is not charged to this measurement
    if warmup:
        call()
    t0 = time.perf_counter()
    call()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_time_s / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def _attn_fn(shape: ModelShape, units: int, batch: int, seq: int):
    h, hd, rep = shape.hidden_size, shape.head_dim, shape.group_size
    x = torch.randn(batch, seq, h, requires_grad=True)
    wq = torch.randn(units * rep * hd, h, requires_grad=True)
    wk = torch.randn(units * hd, h, requires_grad=True)
    wv = torch.randn(units * hd, h, requires_grad=True)
    wo = torch.randn(h, units * rep * hd, requires_grad=True)

    def run():
        q = F.linear(x, wq).view(batch, seq, -1, hd).transpose(1, 2)
        k = F.linear(x, wk).view(batch, seq, -1, hd).transpose(1, 2)
        v = F.linear(x, wv).view(batch, seq, -1, hd).transpose(1, 2)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.linear(o.transpose(1, 2).reshape(batch, seq, -1), wo).sum().backward()

    return run


def _mlp_fn(shape: ModelShape, units: int, batch: int, seq: int):
    h, cols = shape.hidden_size, units * shape.mlp_block
    x = torch.randn(batch, seq, h, requires_grad=True)
    wg = torch.randn(cols, h, requires_grad=True)
    wu = torch.randn(cols, h, requires_grad=True)
    wd = torch.randn(h, cols, requires_grad=True)

    def run():
        F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd).sum().backward()

    return run


def _replicated_fns(shape: ModelShape, batch: int, seq: int, vocab: int):
    h = shape.hidden_size
    x = torch.randn(batch, seq, h, requires_grad=True)
    w = torch.ones(h, requires_grad=True)
    head = torch.randn(vocab, h, requires_grad=True)
    labels = torch.randint(0, vocab, (batch * seq,))

    def norm():
        (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w + x).sum().backward()

    def lm_head():
        F.cross_entropy(F.linear(x, head).view(-1, vocab), labels).backward()

    return norm, lm_head


def _sizes(total: int) -> list[int]:
    """Shard sizes to time: one unit, a quarter and a half of the layer (fewer when it is small)."""
    return sorted({1, max(1, round(total * 0.25)), max(1, round(total * 0.5))} | ({2} if total >= 2 else set()))


def profile_rank(
    shape: ModelShape, batch: int, seq: int, vocab: int = 256, min_time_s: float = 0.02, rounds: int = 5
) -> dict:
    """This rank's cost model (RankCost fields) and the raw timings it was fitted from.

    Sizes are timed round-robin for ``rounds`` rounds and the fastest round kept per size, so a burst
    of load from another program during one measurement does not skew the fit. Each measurement
    spans at least ``min_time_s`` (several periods of an emulation throttle).
    """
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a_units = sorted(set(range(1, min(shape.attn_units, 4) + 1)) | {max(1, shape.attn_units // 2)})
        m_units = _sizes(shape.mlp_units)
        norm, lm_head = _replicated_fns(shape, batch, seq, vocab)
        jobs = [("attn", u, _attn_fn(shape, u, batch, seq)) for u in a_units]
        jobs += [("mlp", u, _mlp_fn(shape, u, batch, seq)) for u in m_units]
        jobs += [("norm", 0, norm), ("lm_head", 0, lm_head)]
        best: dict[tuple[str, int], float] = {}
        for i in range(rounds):
            for kind, u, fn in jobs:
                t = time_call(fn, min_time_s, repeats=1, warmup=i == 0)
                best[(kind, u)] = min(best.get((kind, u), float("inf")), t)
    a_t = [best[("attn", u)] for u in a_units]
    m_t = [best[("mlp", u)] for u in m_units]
    norm_t, head_t = best[("norm", 0)], best[("lm_head", 0)]
    a0, a1 = fit_affine(a_units, a_t)
    m0, m1 = fit_affine(m_units, m_t)
    return {
        "attn_per_unit_s": a1,
        "mlp_per_unit_s": m1,
        "attn_fixed_s": a0 + norm_t + head_t / shape.num_layers,
        "mlp_fixed_s": m0 + norm_t,
        "samples": {"attn": list(zip(a_units, a_t)), "mlp": list(zip(m_units, m_t)), "norm": norm_t, "lm_head": head_t},
    }


def profile_group(
    shape: ModelShape,
    batch: int,
    seq: int,
    vocab: int = 256,
    group=None,
    memory_bytes: float | None = None,
    min_time_s: float = 0.02,
) -> tuple[list[RankCost], dict]:
    """Profile every rank (in parallel, on its own CPU) and share the cost models; same result on all ranks."""
    t0 = time.perf_counter()
    mine = profile_rank(shape, batch, seq, vocab, min_time_s)
    mine["memory_bytes"] = memory_bytes
    buf = torch.zeros(batch, seq, shape.hidden_size)
    if _active(group):
        sync_point()
        dist.barrier(group=group)
        resume_point()
        t1 = time.perf_counter()
        for _ in range(3):
            sync_point()
            dist.all_reduce(buf, group=group)
            resume_point()
        mine["allreduce_s"] = (time.perf_counter() - t1) / 3
        everyone: list = [None] * dist.get_world_size(group)
        mine["profile_s"] = time.perf_counter() - t0
        dist.all_gather_object(everyone, mine, group=group)
    else:
        mine["allreduce_s"] = 0.0
        mine["profile_s"] = time.perf_counter() - t0
        everyone = [mine]
    costs = [
        RankCost(
            attn_per_unit_s=d["attn_per_unit_s"],
            mlp_per_unit_s=d["mlp_per_unit_s"],
            attn_fixed_s=d["attn_fixed_s"],
            mlp_fixed_s=d["mlp_fixed_s"],
            memory_bytes=d["memory_bytes"],
            name=f"rank{i}",
        )
        for i, d in enumerate(everyone)
    ]
    return costs, {"ranks": everyone}


def costs_from_cluster(
    cluster, shape: ModelShape, machines: list[str] | None = None, memory_fraction: float = 0.5
) -> list[RankCost]:
    """Cost models from an hwtopo cluster spec: relative speeds, and a fraction of each machine's memory."""
    names = machines or [m.name for m in cluster.machines]
    speeds = cluster.relative_speeds()
    known = {m.name: m for m in cluster.machines}
    for n in names:
        if n not in known:
            raise PartitionError(f"machine {n!r} is not in the cluster spec; it has {', '.join(known)}")
    mem = [known[n].memory_bytes * memory_fraction if known[n].memory_bytes else None for n in names]
    return costs_from_speeds([speeds[n] for n in names], shape, memory_bytes=mem)
