import pytest
import torch

from bicache import depth, diffusion
from bicache.engine import Engine, PrefixStore, common_prefix_len


@pytest.fixture(scope="module")
def policy(dlm):
    cal = depth.calibrate(dlm, shared_rows=[0, 3, 7], requests_per_fraction=2, groups=1)
    return depth.DepthPolicy(cal, bound=float(max(max(r) for r in cal.drift)))  # reuse everything allowed


def test_common_prefix():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0


def test_engine_batches_shared_prefixes_and_reuses(dlm, policy):
    from bicache.task import TableTask

    task = TableTask(dlm.spec, seed=11)  # its own seed: the shared fixture's state depends on test order
    a = task.burst(4, 8, group=0)
    b = task.burst(4, 10, group=1)
    mixed = [a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]]
    eng = Engine(dlm, mode="bicache", policy=policy, max_batch=2)
    out = eng.run([r.prompt for r in mixed])
    # each batch holds requests of one group: its prefix is the group's shared prefix
    for c, r in zip(out, mixed):
        assert c.prefix_len == r.prefix_len
        assert c.depth == policy.depth(r.prefix_len / len(r.prompt))
        assert c.explain["depth"] == c.depth
    assert len(eng.store.entries) == 2
    assert eng.store.hits == 2  # the second batch of each group reused the entry
    s = eng.stats.summary()
    assert s["requests"] == 8 and s["generated_tokens"] == 32 and s["tokens_per_s"] > 0


def test_engine_nocache_matches_direct_decode(dlm, task):
    reqs = task.burst(3, 3)
    eng = Engine(dlm, mode="none", max_batch=8)
    out = eng.run([r.prompt for r in reqs])
    ref = diffusion.generate(dlm, torch.tensor([r.prompt for r in reqs]), eng.cfg)
    assert [c.tokens for c in out] == ref.tolist()


def test_engine_depth_zero_equals_nocache(dlm, task, policy):
    reqs = task.burst(4, 3)
    prompts = [r.prompt for r in reqs]
    a = Engine(dlm, mode="none", max_batch=4).run(prompts)
    b = Engine(dlm, mode="fixed", fixed_depth=0, max_batch=4).run(prompts)
    assert [c.tokens for c in a] == [c.tokens for c in b]


def test_engine_errors(dlm, policy):
    eng = Engine(dlm, mode="none")
    with pytest.raises(ValueError, match="empty"):
        eng.submit([])
    with pytest.raises(ValueError, match="longer than the model"):
        eng.submit([2] * dlm.max_length)
    with pytest.raises(ValueError, match="token ids"):
        eng.submit([2, 10_000])
    with pytest.raises(ValueError, match="DepthPolicy"):
        Engine(dlm, mode="bicache")
    with pytest.raises(ValueError, match="mode must be"):
        Engine(dlm, mode="bogus")
    from bicache.model import DiffusionLM

    other = DiffusionLM.random(seed=3, layers=2, hidden=32, heads=2)
    with pytest.raises(ValueError, match="mismatched cache and model"):
        Engine(other, mode="bicache", policy=policy)


def test_prefix_store_longest_match_and_eviction(dlm, task):
    from bicache.kvcache import fill_entry

    reqs = task.burst(2, 10)
    x = torch.tensor([reqs[0].prompt + [dlm.mask_id] * 4])
    short, _ = fill_entry(dlm, x, 5)
    long, _ = fill_entry(dlm, x, reqs[0].prefix_len)
    store = PrefixStore()
    store.add(short)
    store.add(long)
    assert store.lookup([r.prompt for r in reqs]) is long
    assert store.lookup([[0] * 20]) is None
    tiny = PrefixStore(capacity_bytes=long.nbytes())
    tiny.add(short)
    tiny.add(long)
    assert list(tiny.entries) == [long.tokens]


def _order(eng, labelled):
    """Submit (label, prompt, cfg) in order; the labels in the order their requests complete."""
    done = []
    for label, prompt, cfg in labelled:
        eng.submit(prompt, cfg).add_done_callback(lambda _f, label=label: done.append(label))
    eng.drain()
    return done


def test_light_request_is_served_before_queued_heavy_ones(dlm, task):
    heavy = diffusion.DecodeConfig(gen_length=32, block_length=32, steps=32)
    light = diffusion.DecodeConfig(gen_length=4, block_length=2, steps=4)
    reqs = task.burst(7, 3)
    eng = Engine(dlm, mode="none", max_batch=2)
    labelled = [(f"h{i}", r.prompt, heavy) for i, r in enumerate(reqs[:6])] + [("light", reqs[6].prompt, light)]
    # first in, first out would serve it last, after three batches of heavy ones
    assert _order(eng, labelled) == ["light", "h0", "h1", "h2", "h3", "h4", "h5"]


def test_a_heavy_request_is_overtaken_at_most_max_skips_times(dlm, task):
    heavy = diffusion.DecodeConfig(gen_length=16, block_length=16, steps=16)
    reqs = task.burst(5, 3)
    eng = Engine(dlm, mode="none", max_batch=1, max_skips=2)
    labelled = [("heavy", reqs[0].prompt, heavy)] + [(f"l{i}", r.prompt, None) for i, r in enumerate(reqs[1:], 1)]
    assert _order(eng, labelled) == ["l1", "l2", "heavy", "l3", "l4"]


def test_full_queue_raises_until_a_batch_is_served(dlm, task):
    from bicache.engine import QueueFull

    reqs = task.burst(4, 3)
    eng = Engine(dlm, mode="none", max_batch=1, max_queue=2)
    first = [eng.submit(r.prompt) for r in reqs[:2]]
    with pytest.raises(QueueFull, match=r"queue is full \(2 requests waiting\)") as info:
        eng.submit(reqs[2].prompt)
    assert info.value.retry_after_s >= 1
    assert eng.step()
    assert first[0].done() and not first[1].done()
    eng.submit(reqs[2].prompt)  # room again
    eng.drain()
    # offline runs longer than the queue serve every request, in input order
    out = eng.run([r.prompt for r in reqs])
    ref = Engine(dlm, mode="none", max_batch=1).run([r.prompt for r in reqs])
    assert [c.tokens for c in out] == [c.tokens for c in ref]
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        Engine(dlm, mode="none", max_queue=0)
