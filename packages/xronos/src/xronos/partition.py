"""Heterogeneity-aware partitioning, the core of Xronos.

A decoder layer under tensor parallelism has two synchronisation points: the all-reduce after the
attention output projection and the one after the MLP down projection. Every rank waits at each of
them for the slowest rank, so a layer costs ``max_r attn_r + max_r mlp_r`` (plus the collective
itself, equal for all ranks because the all-reduced tensor has the full size whatever the shards).
This module chooses how many attention units (one unit = one KV-head group: ``heads/kv_heads`` query
heads with their key/value head, so grouped-query attention stays intact on every rank) and how many
MLP column blocks each rank holds so that this sum is minimal, under each rank's memory budget and
with at least ``min_units`` of each per rank.

The per-rank cost model is affine per segment, ``seconds = fixed_s + per_unit_s * units`` (fitted
by :mod:`xronos.profile` from timed shard GEMMs, or derived from relative speeds). The search is
exact: for every candidate attention time it finds the smallest MLP time for which a feasible
allocation exists (a small dynamic programme over ranks couples the two through memory), and keeps
the best sum. Without memory limits the two segments decouple and a greedy water-fill is exact.
Equal costs give the even split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ModelShape",
    "RankCost",
    "Partition",
    "PartitionError",
    "partition",
    "even_partition",
    "costs_from_speeds",
    "segment_objective",
    "offsets",
]


class PartitionError(ValueError):
    """A partition is impossible (heads cannot be split, memory cannot fit, bad input)."""


@dataclass(frozen=True)
class ModelShape:
    """The sharded dimensions of a decoder-only transformer, and what a unit costs in memory."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    mlp_block: int = 16
    attn_bias: bool = False
    bytes_per_param: int = 16  # fp32 weight + grad + two AdamW moments

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise PartitionError(f"{name} must be a positive integer, not {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise PartitionError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.mlp_block <= 0 or self.intermediate_size % self.mlp_block:
            raise PartitionError(
                f"mlp_block ({self.mlp_block}) must be a positive divisor of intermediate_size "
                f"({self.intermediate_size})"
            )

    @classmethod
    def from_config(cls, config, mlp_block: int = 16, bytes_per_param: int = 16) -> ModelShape:
        """Read the shape from a transformers config (Llama, Qwen2, Mistral-like)."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type.startswith("qwen2")
        return cls(
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            mlp_block=mlp_block,
            attn_bias=bias,
            bytes_per_param=bytes_per_param,
        )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (per attention unit)."""
        return self.num_heads // self.num_kv_heads

    @property
    def attn_units(self) -> int:
        return self.num_kv_heads

    @property
    def mlp_units(self) -> int:
        return self.intermediate_size // self.mlp_block

    def attn_unit_params(self) -> int:
        """Parameters of one KV group in one layer: q and o rows/columns of its heads, k and v of its head."""
        q = self.group_size * self.head_dim
        kv = 2 * self.head_dim
        params = (2 * q + kv) * self.hidden_size
        if self.attn_bias:
            params += q + kv
        return params

    def mlp_unit_params(self) -> int:
        """Parameters of one MLP block in one layer: gate and up rows, down columns."""
        return 3 * self.mlp_block * self.hidden_size

    def attn_unit_bytes(self) -> int:
        return self.attn_unit_params() * self.num_layers * self.bytes_per_param

    def mlp_unit_bytes(self) -> int:
        return self.mlp_unit_params() * self.num_layers * self.bytes_per_param


@dataclass(frozen=True)
class RankCost:
    """Seconds one rank needs per layer for each segment: ``fixed_s + per_unit_s * units``.

    ``memory_bytes`` is what the rank can give to its shards (None: unlimited).
    """

    attn_per_unit_s: float
    mlp_per_unit_s: float
    attn_fixed_s: float = 0.0
    mlp_fixed_s: float = 0.0
    memory_bytes: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("attn_per_unit_s", "mlp_per_unit_s"):
            v = getattr(self, f)
            if not (v > 0 and math.isfinite(v)):
                raise PartitionError(f"RankCost.{f} must be a positive finite number of seconds, not {v!r}")
        for f in ("attn_fixed_s", "mlp_fixed_s"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise PartitionError(f"RankCost.{f} must be >= 0 seconds, not {v!r}")
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise PartitionError(f"RankCost.memory_bytes must be >= 0 or None, not {self.memory_bytes!r}")

    def attn_time(self, units: int) -> float:
        return self.attn_fixed_s + self.attn_per_unit_s * units

    def mlp_time(self, units: int) -> float:
        return self.mlp_fixed_s + self.mlp_per_unit_s * units


@dataclass(frozen=True)
class Partition:
    """Per-rank shard sizes. ``attn_units[r]`` KV groups and ``mlp_units[r]`` MLP blocks on rank r."""

    shape: ModelShape
    attn_units: tuple[int, ...]
    mlp_units: tuple[int, ...]
    predicted_layer_s: float | None = None
    rank_times: tuple[tuple[float, float], ...] = field(default=(), compare=False)

    @property
    def world_size(self) -> int:
        return len(self.attn_units)

    @property
    def q_heads(self) -> tuple[int, ...]:
        return tuple(u * self.shape.group_size for u in self.attn_units)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        return self.attn_units

    @property
    def q_sizes(self) -> tuple[int, ...]:
        """Output features of q_proj (= input features of o_proj) on each rank."""
        return tuple(h * self.shape.head_dim for h in self.q_heads)

    @property
    def kv_sizes(self) -> tuple[int, ...]:
        return tuple(h * self.shape.head_dim for h in self.kv_heads)

    @property
    def mlp_sizes(self) -> tuple[int, ...]:
        return tuple(u * self.shape.mlp_block for u in self.mlp_units)

    def vocab_sizes(self, vocab: int, block: int = 8) -> tuple[int, ...]:
        """Vocabulary rows per rank for a split embedding / LM head, in blocks of ``block`` rows.

        The LM head is a GEMM of the same shape family as the MLP projections (hidden x rows), so it is
        split in proportion to the MLP columns the partition gives each rank (largest remainder);
        every rank gets at least one block when there are enough. An even MLP split gives an even one.
        """
        if vocab <= 0:
            raise PartitionError(f"vocab must be a positive number of tokens, not {vocab!r}")
        n = self.world_size
        blocks, rest = divmod(vocab, block)
        weights = [max(u, 0) for u in self.mlp_units]
        total = sum(weights) or n
        raw = [blocks * (w if sum(weights) else 1) / total for w in weights]
        counts = [int(x) for x in raw]
        if blocks >= n:
            for i in range(n):
                if counts[i] == 0:
                    counts[i] = 1
            while sum(counts) > blocks:
                i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - raw[i])
                counts[i] -= 1
        for i in sorted(range(n), key=lambda i: counts[i] - raw[i])[: max(0, blocks - sum(counts))]:
            counts[i] += 1
        sizes = [c * block for c in counts]
        sizes[-1] += rest
        return tuple(sizes)

    def describe(self) -> dict:
        return {
            "q_heads": list(self.q_heads),
            "kv_heads": list(self.kv_heads),
            "mlp_columns": list(self.mlp_sizes),
            "predicted_layer_s": self.predicted_layer_s,
        }


def segment_objective(
    costs: list[RankCost], attn: list[int] | tuple[int, ...], mlp: list[int] | tuple[int, ...]
) -> float:
    """Seconds per layer of an allocation: the slowest rank at each of the two synchronisation points."""
    return max(c.attn_time(a) for c, a in zip(costs, attn)) + max(c.mlp_time(m) for c, m in zip(costs, mlp))


def costs_from_speeds(
    speeds: list[float], shape: ModelShape, unit_s: float = 1e-3, memory_bytes: Sequence[float | None] | None = None
) -> list[RankCost]:
    """A cost model from relative speeds alone: time per unit proportional to parameters / speed."""
    if not speeds:
        raise PartitionError("speeds must name at least one rank")
    for i, s in enumerate(speeds):
        if not (s > 0 and math.isfinite(s)):
            raise PartitionError(f"speeds[{i}] must be a positive relative speed, not {s!r}")
    mem = memory_bytes or [None] * len(speeds)
    if len(mem) != len(speeds):
        raise PartitionError(f"memory_bytes has {len(mem)} entries but speeds has {len(speeds)}")
    a = shape.attn_unit_params() / shape.mlp_unit_params()
    return [
        RankCost(attn_per_unit_s=unit_s * a / s, mlp_per_unit_s=unit_s / s, memory_bytes=m, name=f"rank{i}")
        for i, (s, m) in enumerate(zip(speeds, mem))
    ]


def even_partition(shape: ModelShape, world_size: int) -> Partition:
    """The Megatron-style split: units as equal as possible (the first ranks take any remainder)."""
    _check_world(shape, world_size, 1)

    def split(n: int) -> tuple[int, ...]:
        q, r = divmod(n, world_size)
        return tuple(q + (1 if i < r else 0) for i in range(world_size))

    return Partition(shape, split(shape.attn_units), split(shape.mlp_units))


def _check_world(shape: ModelShape, world_size: int, min_units: int) -> None:
    if world_size < 1:
        raise PartitionError(f"world size must be >= 1, not {world_size}")
    if shape.attn_units < world_size * min_units:
        raise PartitionError(
            f"the model's {shape.num_heads} attention heads in {shape.num_kv_heads} KV groups cannot be split "
            f"across {world_size} ranks (each rank needs at least {min_units} KV group); use at most "
            f"{shape.attn_units // max(min_units, 1)} ranks"
        )
    if shape.mlp_units < world_size * min_units:
        raise PartitionError(
            f"intermediate_size {shape.intermediate_size} in blocks of {shape.mlp_block} gives "
            f"{shape.mlp_units} blocks, fewer than {world_size} ranks; use a smaller mlp_block"
        )


def _waterfill(n: int, lo: list[int], caps: list[int], time_of) -> list[int] | None:
    """Give out n units one at a time to the rank whose time after taking it is smallest (exact for min-max)."""
    alloc = list(lo)
    left = n - sum(alloc)
    if left < 0 or any(lo_i > c for lo_i, c in zip(lo, caps)):
        return None
    while left > 0:
        best, best_t = -1, math.inf
        for r, (a, c) in enumerate(zip(alloc, caps)):
            if a < c:
                t = time_of(r, a + 1)
                if t < best_t - 1e-15:
                    best, best_t = r, t
        if best < 0:
            return None
        alloc[best] += 1
        left -= 1
    return alloc


def _units_within(fixed: float, per_unit: float, limit_t: float, hi: int) -> int:
    """Largest units in [0, hi] with fixed + per_unit * units <= limit_t (with a float tolerance)."""
    if fixed > limit_t * (1 + 1e-12):
        return -1
    u = math.floor((limit_t * (1 + 1e-12) - fixed) / per_unit + 1e-9)
    return max(-1, min(hi, u))


def partition(shape: ModelShape, costs: list[RankCost], min_units: int = 1) -> Partition:
    """Shard sizes minimising the per-layer time of the slowest rank at both synchronisation points.

    With ``g_r`` attention units and ``m_r`` MLP units on rank r, it solves exactly::

        min  max_r attn_r(g_r) + max_r mlp_r(m_r)
        s.t. sum_r g_r = G,  sum_r m_r = N,  g_r >= min_units,  m_r >= min_units,
             g_r * attn_unit_bytes + m_r * mlp_unit_bytes <= memory_r

    Without memory limits the two maxima decouple and a water-fill of each is exact. With them,
    :class:`_MemorySearch` finds the attention split and MLP time of the least sum; the MLP units are
    then water-filled under the caps that split and time leave each rank.
    """
    world = len(costs)
    _check_world(shape, world, min_units)
    if min_units < 0:
        raise PartitionError(f"min_units must be >= 0, not {min_units}")
    _check_memory(shape, costs, min_units)
    G, N = shape.attn_units, shape.mlp_units
    lo = [min_units] * world
    attn_t = lambda r, u: costs[r].attn_time(u)  # noqa: E731
    mlp_t = lambda r, u: costs[r].mlp_time(u)  # noqa: E731

    if all(c.memory_bytes is None for c in costs):
        attn = _waterfill(G, lo, [G] * world, attn_t)
        mlp = _waterfill(N, lo, [N] * world, mlp_t)
        assert attn is not None and mlp is not None
        return _finish(shape, costs, attn, mlp)

    search = _MemorySearch(shape, costs, min_units)
    g, t_m = search.best()
    caps = [min(search.mlp_cap(r, g[r]), search.mlp_within(r, t_m)) for r in range(world)]
    mlp = _waterfill(N, lo, caps, mlp_t)
    assert mlp is not None
    # g is already optimal for its attention time: no rebalancing of attention within the same memory
    return _finish(shape, costs, g, mlp)


def _check_memory(shape: ModelShape, costs: list[RankCost], min_units: int) -> None:
    """Fail early, naming the rank, when a rank cannot hold its smallest shard or all ranks the model."""
    bg, bm = shape.attn_unit_bytes(), shape.mlp_unit_bytes()
    need = (min_units * bg + min_units * bm) if min_units else 0
    for r, c in enumerate(costs):
        if c.memory_bytes is not None and c.memory_bytes < need:
            raise PartitionError(
                f"rank {r} has {c.memory_bytes:.0f} bytes for shards but its smallest shard "
                f"({min_units} KV group + {min_units} MLP block) needs {need} bytes"
            )
    total_need = shape.attn_units * bg + shape.mlp_units * bm
    total_mem = sum(c.memory_bytes for c in costs if c.memory_bytes is not None)
    if all(c.memory_bytes is not None for c in costs) and total_mem < total_need:
        raise PartitionError(
            f"the model's shards need {total_need} bytes in all but the ranks offer only {total_mem:.0f}"
        )


class _MemorySearch:
    """The exact search when ranks have memory limits, which couple a rank's two segments.

    At the optimum the attention time is ``attn_r(g)`` for some rank r and count g, and the MLP time
    ``mlp_r(m)`` for some r and m, so only those values are candidates. A candidate attention time
    ``t_a`` caps each rank at ``a_hi[r]`` attention units (its time and its memory); a candidate MLP
    time ``t_m`` is feasible when some split of the G attention units within ``a_hi`` leaves room, in
    every rank's memory and within ``t_m``, for N MLP units in all. Feasibility only grows with
    ``t_m``, so the least feasible one is found by bisection; ``t_a`` ascends, so the search stops
    once ``t_a`` alone reaches the best sum.
    """

    def __init__(self, shape: ModelShape, costs: list[RankCost], min_units: int) -> None:
        self.costs = costs
        self.min_units = min_units
        self.world = len(costs)
        self.G, self.N = shape.attn_units, shape.mlp_units
        self.bg, self.bm = shape.attn_unit_bytes(), shape.mlp_unit_bytes()
        self.a_caps = [self.attn_cap(r) for r in range(self.world)]

    def attn_cap(self, r: int) -> int:
        """Most attention units rank r's memory holds beside its smallest MLP share."""
        m = self.costs[r].memory_bytes
        G = self.G
        return G if m is None else min(G, math.floor((m - self.min_units * self.bm) / self.bg)) if self.bg else G

    def mlp_cap(self, r: int, g: int) -> int:
        """Most MLP units rank r's memory holds beside ``g`` attention units."""
        m = self.costs[r].memory_bytes
        return self.N if m is None else min(self.N, math.floor((m - g * self.bg) / self.bm))

    def mlp_within(self, r: int, t_m: float) -> int:
        """Most MLP units rank r computes within ``t_m`` seconds (-1 when not even its fixed cost fits)."""
        return _units_within(self.costs[r].mlp_fixed_s, self.costs[r].mlp_per_unit_s, t_m, self.N)

    def attn_limits(self, t_a: float) -> list[int]:
        """Most attention units each rank holds within ``t_a`` seconds and its memory."""
        return [
            min(self.a_caps[r], _units_within(c.attn_fixed_s, c.attn_per_unit_s, t_a, self.G))
            for r, c in enumerate(self.costs)
        ]

    def candidates(self) -> tuple[list[float], list[float]]:
        """Every attention and every MLP time some rank takes at an allowed unit count, ascending."""
        lo, costs = self.min_units, self.costs
        t_a = sorted({c.attn_time(g) for r, c in enumerate(costs) for g in range(lo, self.a_caps[r] + 1)})
        t_m = sorted({c.mlp_time(m) for c in costs for m in range(lo, self.N + 1)})
        return t_a, t_m

    def best(self) -> tuple[list[int], float]:
        """The attention split and MLP time of the least ``t_a + t_m``; raises when nothing fits memory."""
        t_a_cands, t_m_cands = self.candidates()
        best_val, best_alloc = math.inf, None
        for t_a in t_a_cands:
            if t_a >= best_val:
                break
            a_hi = self.attn_limits(t_a)
            if any(a < self.min_units for a in a_hi) or sum(a_hi) < self.G:
                continue
            t_m = self.least_mlp_time(a_hi, t_m_cands)
            if t_m is not None and t_a + t_m < best_val - 1e-15:
                alloc = self.feasible(a_hi, t_m)
                assert alloc is not None  # least_mlp_time returns only a feasible time
                best_val, best_alloc = t_a + t_m, (alloc, t_m)
        if best_alloc is None:
            raise PartitionError(
                "no partition fits every rank's memory; give the ranks more memory, add ranks or shrink the model"
            )
        return best_alloc

    def least_mlp_time(self, a_hi: list[int], t_m_cands: list[float]) -> float | None:
        """Bisect the ascending candidates for the least feasible MLP time (None: not even the largest)."""
        lo_i, hi_i = 0, len(t_m_cands) - 1
        if self.feasible(a_hi, t_m_cands[hi_i]) is None:
            return None
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            if self.feasible(a_hi, t_m_cands[mid]) is not None:
                hi_i = mid
            else:
                lo_i = mid + 1
        return t_m_cands[lo_i]

    def feasible(self, a_hi: list[int], t_m: float) -> list[int] | None:
        """Attention units g (g_r <= a_hi[r], sum G) leaving room for N MLP units within t_m, or None."""
        tables = self._most_mlp(a_hi, t_m)
        return None if tables is None else self._pick_attn(a_hi, t_m, tables)

    def _most_mlp(self, a_hi: list[int], t_m: float) -> list[dict[int, int]] | None:
        """Dynamic programme over ranks: ``tables[r][s]`` = most MLP units ranks < r hold beside s attention units.

        None when the ranks cannot hold all G attention units and N MLP units together.
        """
        G, min_units = self.G, self.min_units
        best = {0: 0}
        tables = []
        for r in range(self.world):
            u_t = self.mlp_within(r, t_m)
            nxt: dict[int, int] = {}
            for s, v in best.items():
                for g in range(min_units, a_hi[r] + 1):
                    if s + g > G:
                        break
                    cap = min(self.mlp_cap(r, g), u_t)
                    if cap < min_units:
                        continue
                    val = v + cap
                    if nxt.get(s + g, -1) < val:
                        nxt[s + g] = val
            tables.append(best)
            best = nxt
            if not best:
                return None
        if best.get(G, -1) < self.N:
            return None
        return tables

    def _pick_attn(self, a_hi: list[int], t_m: float, tables: list[dict[int, int]]) -> list[int] | None:
        """Backtrack from the last rank; among feasible shares, the one closest to speed-proportional.

        Many attention splits meet the same two times; preferring the share proportional to each rank's
        attention speed gives equal ranks the even split.
        """
        inv = [1.0 / c.attn_per_unit_s for c in self.costs]
        target = [self.G * w / sum(inv) for w in inv]
        g_alloc = [0] * self.world
        s_left, n_left = self.G, self.N
        for r in range(self.world - 1, -1, -1):
            prev = tables[r]
            u_t = self.mlp_within(r, t_m)
            options = []
            for g in range(self.min_units, min(a_hi[r], s_left) + 1):
                cap = min(self.mlp_cap(r, g), u_t)
                if cap < self.min_units or (s_left - g) not in prev:
                    continue
                if prev[s_left - g] + cap >= n_left:
                    options.append((abs(g - target[r]), g, cap))
            if not options:
                return None
            _, g, cap = min(options)
            g_alloc[r] = g
            s_left -= g
            n_left = max(0, n_left - cap)
        return g_alloc


def _finish(shape: ModelShape, costs: list[RankCost], attn: list[int], mlp: list[int]) -> Partition:
    times = tuple((c.attn_time(a), c.mlp_time(m)) for c, a, m in zip(costs, attn, mlp))
    return Partition(shape, tuple(attn), tuple(mlp), segment_objective(costs, attn, mlp), times)


def offsets(sizes: tuple[int, ...] | list[int]) -> list[int]:
    """Start index of each rank's shard given the shard sizes."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
