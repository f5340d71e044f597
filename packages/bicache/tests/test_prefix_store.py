import random
from collections import OrderedDict

import pytest
import torch

from bicache.kvcache import PrefixEntry
from bicache.prefix_store import PrefixStore, Reservoir


def _entry(tokens, nbytes):
    """An entry whose tensors take exactly ``nbytes`` (a multiple of 4) bytes."""
    return PrefixEntry(tuple(tokens), keys=[torch.zeros(nbytes // 4)], values=[], hidden=[])


def _brute_longest(stored, prompts):
    """The reference: scan every stored prefix, keep the longest that fits every prompt."""
    best = None
    for tokens in stored:
        fits = all(len(p) > len(tokens) and tuple(p[: len(tokens)]) == tokens for p in prompts)
        if fits and (best is None or len(tokens) > len(best)):
            best = tokens
    return best


def _random_prompts(rng, stored):
    """A batch sharing a prefix: often a stored prefix extended, sometimes unrelated tokens."""
    base = list(rng.choice(list(stored))) if stored and rng.random() < 0.7 else []
    base = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
    return [base + [rng.randrange(3) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("seed", range(6))
def test_lookup_and_eviction_match_a_brute_force_lru_scan(seed):
    rng = random.Random(seed)
    capacity = 4 * rng.randint(5, 40)
    store = PrefixStore(capacity_bytes=capacity)
    ref: OrderedDict[tuple[int, ...], int] = OrderedDict()  # tokens -> bytes, least recent first
    for _ in range(400):
        if rng.random() < 0.45:
            tokens = tuple(rng.randrange(3) for _ in range(rng.randint(1, 9)))  # 3 symbols: many shared runs
            size = 4 * rng.randint(1, 12)
            stored = store.add(_entry(tokens, size))
            assert stored == (size <= capacity)
            if stored:
                ref.pop(tokens, None)
                ref[tokens] = size
                while sum(ref.values()) > capacity:
                    ref.popitem(last=False)
        else:
            prompts = _random_prompts(rng, ref)
            want = _brute_longest(ref, prompts)
            got = store.lookup(prompts)
            assert (got.tokens if got is not None else None) == want
            if want is not None:
                ref.move_to_end(want)
        assert list(store.entries) == list(ref)  # same entries, same recency order
        assert store.nbytes() == sum(ref.values()) == sum(e.nbytes() for e in store.entries.values())
        assert store.nbytes() <= capacity
        assert store.node_count() <= 2 * len(store)  # evicted prefixes leave no dead branches
    for tokens in list(ref):  # evicting everything leaves an empty tree
        store._remove(tokens)
    assert store.node_count() == 0 and store.nbytes() == 0


def test_lookup_respects_every_prompt_and_leaves_each_a_token():
    store = PrefixStore()
    for tokens in [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (7,)]:
        store.add(_entry(tokens, 8))
    assert store.lookup([[1, 2, 3, 4, 5, 6, 0]]).tokens == (1, 2, 3, 4, 5, 6)
    assert store.lookup([[1, 2, 3, 4, 5, 6]]).tokens == (1, 2, 3, 4)  # the whole prompt is never a prefix
    assert store.lookup([[1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 9, 9, 9, 9]]).tokens == (1, 2)
    assert store.lookup([[7, 1], [8, 1]]) is None
    assert store.lookup([]) is None
    assert (store.hits, store.misses) == (3, 2)


def test_replacing_an_entry_keeps_the_byte_count_and_an_oversized_one_is_refused():
    store = PrefixStore(capacity_bytes=40)
    store.add(_entry((1, 2, 3), 16))
    store.add(_entry((1, 2), 16))
    store.add(_entry((1, 2, 3), 32))  # same tokens: replaces, evicts (1, 2) to fit
    assert list(store.entries) == [(1, 2, 3)] and store.nbytes() == 32 and store.evictions == 1
    assert not store.add(_entry((5,), 44))
    assert list(store.entries) == [(1, 2, 3)] and store.nbytes() == 32
    with pytest.raises(ValueError, match="at least one token"):
        store.add(_entry((), 4))
    with pytest.raises(ValueError, match="capacity_bytes must be an integer >= 0"):
        PrefixStore(capacity_bytes=-1)


def test_reservoir_is_exact_below_capacity_and_bounded_above():
    small = Reservoir(capacity=100)
    for x in range(10):
        small.add(float(x))
    assert small.quantile(0.5) == 5.0 and small.quantile(0.95) == 9.0 and small.quantile(0.0) == 0.0
    big = Reservoir(capacity=200, seed=1)
    values = [float(i) for i in range(20_000)]
    random.Random(2).shuffle(values)
    for x in values:
        big.add(x)
    assert len(big.samples) == 200 and len(big) == 20_000
    assert big.max == 19_999.0 and big.mean() == pytest.approx(9999.5)
    # a uniform sample's median lies near the true one (±1500 is > 4 standard errors at 200 samples)
    assert abs(big.quantile(0.5) - 10_000) < 1500
    assert Reservoir().quantile(0.5) == 0.0
    with pytest.raises(ValueError, match="quantile q"):
        big.quantile(1.5)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Reservoir(capacity=0)
