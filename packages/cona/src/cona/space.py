"""The strategy space: dp x tp x pp = world, micro-batch, global batch (via accumulation).

A strategy is feasible when the model's dimensions divide for it (heads, KV heads and MLP width by
tp; layers by at least pp), the global batch splits into dp x micro-batch x accumulation, and the
per-rank memory estimate (weights, grads, Adam state, activations of the micro-batches in flight)
fits the memory one rank has (this machine's or a rank's share of an hwtopo spec).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import hwtopo

__all__ = [
    "Strategy",
    "ModelDims",
    "StrategyError",
    "check_strategy",
    "memory_per_rank_bytes",
    "rank_memory_budget",
    "enumerate_strategies",
]


class StrategyError(ValueError):
    """A strategy (or world size) that cannot run for this model or cluster; the message says why."""


@dataclass(frozen=True, order=True)
class Strategy:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def accum(self) -> int:
        """Micro-batches each data-parallel replica runs per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def name(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}-mb{self.micro_batch}-gb{self.global_batch}"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """'dp2-tp1-pp1-mb4-gb16' -> Strategy."""
        try:
            parts = dict((p[:2], int(p[2:])) for p in text.split("-"))
            return cls(parts["dp"], parts["tp"], parts["pp"], parts["mb"], parts["gb"])
        except (KeyError, ValueError):
            raise StrategyError(f"strategy {text!r} is not of the form 'dp2-tp1-pp1-mb4-gb16'") from None


@dataclass(frozen=True)
class ModelDims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq_len: int

    @classmethod
    def from_config(cls, config, seq_len: int) -> ModelDims:
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            seq_len=seq_len,
        )

    @property
    def layer_params(self) -> int:
        hd = self.hidden // self.heads
        attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden


def check_strategy(s: Strategy, dims: ModelDims, world: int | None = None) -> None:
    """Raise StrategyError naming the first dimension that does not divide (or the world mismatch)."""
    for f in fields(s):
        if getattr(s, f.name) < 1:
            raise StrategyError(f"{s.name}: {f.name} must be >= 1")
    if world is not None and s.world != world:
        raise StrategyError(f"{s.name}: dp*tp*pp = {s.world} but the world has {world} ranks")
    if dims.heads % s.tp:
        raise StrategyError(f"{s.name}: num_attention_heads={dims.heads} is not divisible by tp={s.tp}")
    if dims.kv_heads % s.tp:
        raise StrategyError(f"{s.name}: num_key_value_heads={dims.kv_heads} is not divisible by tp={s.tp}")
    if dims.intermediate % s.tp:
        raise StrategyError(f"{s.name}: intermediate_size={dims.intermediate} is not divisible by tp={s.tp}")
    if s.pp > dims.layers:
        raise StrategyError(
            f"{s.name}: pp={s.pp} exceeds num_hidden_layers={dims.layers} (one layer per stage at least)"
        )
    if s.global_batch % (s.dp * s.micro_batch):
        raise StrategyError(
            f"{s.name}: global_batch={s.global_batch} is not a multiple of dp*micro_batch={s.dp * s.micro_batch}"
        )


def memory_per_rank_bytes(s: Strategy, dims: ModelDims, bytes_per_param: int = 4) -> float:
    """Peak bytes on the busiest rank: fp32 weights+grads+Adam (16 B/param) and stored activations."""
    per_stage_layers = -(-dims.layers // s.pp)
    sharded = per_stage_layers * (dims.layer_params - 2 * dims.hidden) / s.tp + per_stage_layers * 2 * dims.hidden
    ends = 2 * dims.vocab * dims.hidden + dims.hidden  # embed on the first stage, head on the last
    params = sharded + (ends if s.pp == 1 else ends / 2)
    state = params * bytes_per_param * 4
    tokens = s.micro_batch * dims.seq_len
    per_layer_act = tokens * (10 * dims.hidden + 3 * dims.intermediate / s.tp) * bytes_per_param
    per_layer_act += s.micro_batch * dims.heads / s.tp * dims.seq_len**2 * bytes_per_param
    in_flight = s.accum if s.pp > 1 else 1  # GPipe keeps every micro-batch's activations until backward
    logits = tokens * dims.vocab * bytes_per_param * 3
    return state + in_flight * (per_stage_layers * per_layer_act + logits)


def rank_memory_budget(cluster: hwtopo.Cluster | None, world: int) -> float:
    """Memory one rank may use: accelerator memory when there is one per rank, else host memory / ranks."""
    cluster = cluster or hwtopo.probe_cluster()
    accs = [a.memory_bytes for m in cluster.machines for a in m.accelerators if a.memory_bytes]
    if len(accs) >= world:
        return float(min(accs))
    total = cluster.total_memory_bytes
    if total <= 0:
        raise StrategyError(f"cluster {cluster.name!r} declares no memory; set machines[].memory")
    return total / world


def enumerate_strategies(
    dims: ModelDims,
    world: int,
    global_batches: list[int],
    micro_batches: list[int],
    memory_budget_bytes: float | None = None,
    cluster: hwtopo.Cluster | None = None,
) -> list[Strategy]:
    """Every feasible strategy for ``world`` ranks, sorted; raises StrategyError when none is."""
    if world < 1:
        raise StrategyError(f"world size must be >= 1, got {world}")
    if not global_batches or not micro_batches:
        raise StrategyError("global_batches and micro_batches must each list at least one size")
    budget = memory_budget_bytes if memory_budget_bytes is not None else rank_memory_budget(cluster, world)
    out, reasons = [], []
    for dp, tp in itertools.product(range(1, world + 1), repeat=2):
        if world % (dp * tp):
            continue
        for gb, mb in itertools.product(sorted(set(global_batches)), sorted(set(micro_batches))):
            s = Strategy(dp, tp, world // (dp * tp), mb, gb)
            try:
                check_strategy(s, dims, world)
            except StrategyError as e:
                reasons.append(str(e))
                continue
            need = memory_per_rank_bytes(s, dims)
            if need > budget:
                reasons.append(f"{s.name}: needs {hwtopo.format_bytes(need)} per rank")
            else:
                out.append(s)
    if not out:
        why = "; ".join(reasons[:3]) or "no (dp, tp, pp) factorization"
        raise StrategyError(f"no feasible strategy for world={world} ranks: {why}")
    return sorted(out)
