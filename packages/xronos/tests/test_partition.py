import math

import pytest

from xronos.partition import (
    ModelShape,
    PartitionError,
    RankCost,
    costs_from_speeds,
    even_partition,
    partition,
    segment_objective,
)


def compositions(n, k, lo):
    if k == 1:
        if n >= lo:
            yield (n,)
        return
    for first in range(lo, n - lo * (k - 1) + 1):
        for rest in compositions(n - first, k - 1, lo):
            yield (first, *rest)


def brute(shape, costs, min_units=1):
    best = math.inf
    for a in compositions(shape.attn_units, len(costs), min_units):
        for m in compositions(shape.mlp_units, len(costs), min_units):
            ok = all(
                c.memory_bytes is None or ai * shape.attn_unit_bytes() + mi * shape.mlp_unit_bytes() <= c.memory_bytes
                for c, ai, mi in zip(costs, a, m)
            )
            if ok:
                best = min(best, segment_objective(costs, a, m))
    return best


def small_shape(kv=4, heads=8, inter=64, block=8):
    return ModelShape(
        hidden_size=16,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=4,
        intermediate_size=inter,
        num_layers=2,
        mlp_block=block,
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equal_speeds_give_even_split(world):
    shape = ModelShape(
        hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=192, num_layers=2, mlp_block=16
    )
    p = partition(shape, costs_from_speeds([1.0] * world, shape))
    e = even_partition(shape, world)
    assert sorted(p.attn_units) == sorted(e.attn_units)
    assert sorted(p.mlp_units) == sorted(e.mlp_units)
    assert max(p.mlp_units) - min(p.mlp_units) <= 1


def test_faster_rank_gets_more():
    shape = small_shape()
    p = partition(shape, costs_from_speeds([1.0, 0.5], shape))
    assert p.mlp_units[0] > p.mlp_units[1]
    assert p.attn_units[0] >= p.attn_units[1]
    assert sum(p.mlp_sizes) == shape.intermediate_size and sum(p.q_heads) == shape.num_heads
    assert sum(p.kv_heads) == shape.num_kv_heads
    # grouped KV: every rank keeps heads/kv query heads per KV head
    assert all(q == 2 * k for q, k in zip(p.q_heads, p.kv_heads))


@pytest.mark.parametrize("seed", range(12))
def test_optimal_against_brute_force(seed):
    import random

    rng = random.Random(seed)
    world = rng.choice([2, 3])
    kv = rng.choice([3, 4, 5])
    shape = small_shape(kv=kv, heads=kv * rng.choice([1, 2]), inter=8 * rng.choice([5, 6, 7]), block=8)
    costs = []
    total = shape.attn_units * shape.attn_unit_bytes() + shape.mlp_units * shape.mlp_unit_bytes()
    for _ in range(world):
        mem = None
        if seed % 2 == 0:  # memory-limited cases: roughly the fair share, sometimes tight
            mem = total / world * rng.uniform(0.8, 1.8)
        costs.append(
            RankCost(
                attn_per_unit_s=rng.uniform(0.5, 3.0),
                mlp_per_unit_s=rng.uniform(0.2, 2.0),
                attn_fixed_s=rng.uniform(0, 1),
                mlp_fixed_s=rng.uniform(0, 1),
                memory_bytes=mem,
            )
        )
    expected = brute(shape, costs)
    if math.isinf(expected):
        with pytest.raises(PartitionError):
            partition(shape, costs)
        return
    p = partition(shape, costs)
    assert segment_objective(costs, p.attn_units, p.mlp_units) == pytest.approx(expected, rel=1e-9)
    assert p.predicted_layer_s == pytest.approx(expected, rel=1e-9)
    for c, a, m in zip(costs, p.attn_units, p.mlp_units):
        assert a >= 1 and m >= 1
        if c.memory_bytes is not None:
            assert a * shape.attn_unit_bytes() + m * shape.mlp_unit_bytes() <= c.memory_bytes


def test_memory_limit_moves_work_to_slow_rank():
    shape = small_shape(kv=4, heads=4, inter=64, block=8)
    fast_unlimited = partition(shape, costs_from_speeds([1.0, 0.25], shape))
    limit = 2 * shape.attn_unit_bytes() + 4 * shape.mlp_unit_bytes()
    costs = costs_from_speeds([1.0, 0.25], shape, memory_bytes=[limit, None])
    p = partition(shape, costs)
    assert p.mlp_units[0] < fast_unlimited.mlp_units[0]
    assert p.attn_units[0] * shape.attn_unit_bytes() + p.mlp_units[0] * shape.mlp_unit_bytes() <= limit
    assert p.predicted_layer_s == pytest.approx(brute(shape, costs))


def test_errors_are_one_clear_sentence():
    shape = small_shape(kv=2, heads=4)
    with pytest.raises(PartitionError, match="cannot be split across 3 ranks"):
        partition(shape, costs_from_speeds([1, 1, 1], shape))
    with pytest.raises(PartitionError, match="num_kv_heads"):
        ModelShape(hidden_size=8, num_heads=6, num_kv_heads=4, head_dim=2, intermediate_size=16, num_layers=1)
    with pytest.raises(PartitionError, match="mlp_block"):
        ModelShape(
            hidden_size=8, num_heads=4, num_kv_heads=4, head_dim=2, intermediate_size=20, num_layers=1, mlp_block=8
        )
    with pytest.raises(PartitionError, match=r"speeds\[1\]"):
        costs_from_speeds([1.0, -0.5], shape)
    tiny = [shape.attn_unit_bytes() + shape.mlp_unit_bytes()] * 2
    with pytest.raises(PartitionError, match="offer only"):
        partition(shape, costs_from_speeds([1, 1], shape, memory_bytes=tiny))
    with pytest.raises(PartitionError, match="rank 1"):
        partition(shape, costs_from_speeds([1, 1], shape, memory_bytes=[None, 10]))


def test_from_config_reads_gqa_and_qwen_bias():
    from transformers import LlamaConfig, Qwen2Config

    s = ModelShape.from_config(
        LlamaConfig(
            hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
        )
    )
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.group_size, s.attn_bias) == (8, 2, 8, 4, False)
    q = ModelShape.from_config(
        Qwen2Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
        )
    )
    assert q.attn_bias
