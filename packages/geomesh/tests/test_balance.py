import math
from dataclasses import replace

import pytest

import hwtopo
from geomesh.balance import (
    BalanceError,
    MemoryModel,
    Rebalancer,
    WorkerProfile,
    plan,
    profiles_from_cluster,
    token_weights,
    uniform_plan,
)


def _profiles(speeds, base=1000.0):
    return [WorkerProfile(f"w{i}", s * base) for i, s in enumerate(speeds)]


@pytest.mark.parametrize("speeds", [(1.0, 0.7, 0.4), (1.0, 0.13, 0.5, 0.91), (1.0, 1.0), (0.3, 0.29, 0.31)])
def test_balancer_equalizes_phases_on_synthetic_speeds(speeds):
    profiles = _profiles(speeds)
    p = plan(profiles, seq_len=32, target_tokens=32 * 8 * 3 * 20, max_batch=16, preferred_batch=8)
    assert p.imbalance < 0.06
    for w, prof in zip(p.workers, profiles):
        assert w.phase_s == pytest.approx(w.tokens / prof.tokens_per_s)
        assert abs(w.phase_s - p.phase_s) / p.phase_s < 0.05
        assert 1 <= w.batch <= 16 and w.inner_steps >= 1
    assert abs(p.tokens - p.target_tokens) / p.target_tokens < 0.05
    # faster workers process more tokens
    order = sorted(range(len(speeds)), key=lambda i: speeds[i])
    toks = [p.workers[i].tokens for i in order]
    assert toks == sorted(toks) or len(set(speeds)) < len(speeds)
    assert sum(w.weight for w in p.workers) == pytest.approx(1.0)


def test_uniform_plan_is_imbalanced_by_speed_ratio():
    p = uniform_plan(_profiles((1.0, 0.7, 0.4)), seq_len=32, batch=8, inner_steps=20)
    assert p.imbalance == pytest.approx(0.6)
    assert [w.weight for w in p.workers] == pytest.approx([1 / 3] * 3)


def test_memory_caps_batch_and_missing_memory_is_a_clear_error():
    mem = MemoryModel(fixed_bytes=1000, bytes_per_sample=100)
    profiles = [WorkerProfile("big", 1000, memory_bytes=10_000), WorkerProfile("small", 1000, memory_bytes=1_350)]
    p = plan(profiles, seq_len=10, target_tokens=4000, memory=mem)
    assert p.worker("small").batch <= 3
    assert p.imbalance < 0.06
    with pytest.raises(BalanceError, match="'tiny'.*batch 1"):
        plan([*profiles, WorkerProfile("tiny", 1000, memory_bytes=1050)], seq_len=10, target_tokens=4000, memory=mem)


def test_unknown_memory_caps_nothing():
    """A worker whose memory is unknown (the default, inf) is planned as uncapped, not a NaN crash."""
    mem = MemoryModel(fixed_bytes=1000, bytes_per_sample=100)
    capped = plan([WorkerProfile("a", 1000, memory_bytes=10_000), WorkerProfile("b", 1000)], 10, 4000, memory=mem)
    free = plan([WorkerProfile("a", 1000, memory_bytes=10_000), WorkerProfile("b", 1000)], 10, 4000)
    assert capped.worker("b").batch == free.worker("b").batch
    assert mem.max_batch(float("inf")) >= 1 << 20 and mem.max_batch(999) == 0


def test_bad_input_names_the_field():
    with pytest.raises(BalanceError, match=r"profiles\[1\].tokens_per_s"):
        plan([WorkerProfile("a", 1), WorkerProfile("b", -2)], seq_len=4, target_tokens=100)
    with pytest.raises(BalanceError, match="unique"):
        plan([WorkerProfile("a", 1), WorkerProfile("a", 2)], seq_len=4, target_tokens=100)
    with pytest.raises(BalanceError, match="seq_len"):
        plan(_profiles((1,)), seq_len=0, target_tokens=100)
    with pytest.raises(BalanceError, match="target_tokens"):
        plan(_profiles((1, 1)), seq_len=64, target_tokens=100)
    with pytest.raises(BalanceError, match="preferred_batch"):
        plan(_profiles((1, 1)), seq_len=4, target_tokens=100, preferred_batch=0)
    with pytest.raises(BalanceError, match="preferred_steps"):
        plan(_profiles((1, 1)), seq_len=4, target_tokens=100, preferred_steps=0)


def test_profiles_from_hwtopo_cluster():
    c = hwtopo.load("geo-3region")
    profiles = profiles_from_cluster(c, tokens_per_s_at_speed_1=5000)
    by = {p.name: p for p in profiles}
    assert by["use-a100"].tokens_per_s == 5000 and by["aps-t4"].tokens_per_s == pytest.approx(2000)
    assert by["aps-t4"].memory_bytes == hwtopo.parse_bytes("16GiB")
    mem = MemoryModel(fixed_bytes=hwtopo.parse_bytes("10GiB"), bytes_per_sample=hwtopo.parse_bytes("1GiB"))
    p = plan(profiles, seq_len=1024, target_tokens=1024 * 64, memory=mem)
    assert p.worker("aps-t4").batch <= 6
    assert p.imbalance < 0.06


def test_token_weights():
    assert token_weights([100, 300]) == [0.25, 0.75]
    assert token_weights([0, 0]) == [0.5, 0.5]
    with pytest.raises(BalanceError):
        token_weights([-1, 2])


def test_rebalance_on_drift():
    profiles = _profiles((1.0, 0.7, 0.4))
    p0 = plan(profiles, seq_len=16, target_tokens=16 * 4 * 60, max_batch=8, preferred_batch=4)
    rb = Rebalancer(p0, threshold=0.15, ema=1.0, max_batch=8, preferred_batch=4)
    # measured as planned: no re-plan
    rb.observe_all({w.name: (w.tokens, w.phase_s) for w in p0.workers})
    assert rb.maybe_replan() is None
    # worker 0 slows to half speed: its measured phase doubles, the plan moves tokens away from it
    w0 = p0.workers[0]
    rb.observe(w0.name, w0.tokens, 2 * w0.phase_s)
    assert rb.drift() == pytest.approx(0.5)
    p1 = rb.maybe_replan()
    assert p1 is not None and rb.replans == 1
    assert p1.worker("w0").tokens < w0.tokens
    true_rates = {"w0": 500.0, "w1": 700.0, "w2": 400.0}
    phases = [w.tokens / true_rates[w.name] for w in p1.workers]
    assert (max(phases) - min(phases)) / max(phases) < 0.06
    assert not math.isclose(p0.phase_s, p1.phase_s)


def test_fit_profile_recovers_rate_and_overhead():
    from geomesh.balance import fit_profile

    true = WorkerProfile("w", tokens_per_s=2000.0, step_overhead_s=0.01)
    samples = [(b, true.step_time_s(b, 16)) for b in (2, 4, 8)]
    p = fit_profile("w", samples, seq_len=16)
    assert p.tokens_per_s == pytest.approx(2000.0) and p.step_overhead_s == pytest.approx(0.01)
    one = fit_profile("w", [(4, 0.5)], seq_len=16)
    assert one.tokens_per_s == pytest.approx(128.0) and one.step_overhead_s == 0
    with pytest.raises(BalanceError, match="'w'"):
        fit_profile("w", [(0, 1.0)], seq_len=16)


def test_plan_accounts_for_step_overhead():
    # with a large fixed cost per step, ignoring it would give the small-batch worker far too many steps
    profiles = [
        WorkerProfile("fast", 4000.0, step_overhead_s=0.02),
        WorkerProfile("slow", 1000.0, step_overhead_s=0.05),
    ]
    p = plan(profiles, seq_len=32, target_tokens=32 * 8 * 2 * 10, max_batch=16, preferred_batch=8)
    phases = [w.inner_steps * prof.step_time_s(w.batch, 32) for w, prof in zip(p.workers, profiles)]
    assert (max(phases) - min(phases)) / max(phases) < 0.06
    assert p.imbalance == pytest.approx((max(phases) - min(phases)) / max(phases))


def test_preferred_steps_keeps_h_equal_and_moves_batch():
    p = plan(_profiles((1.0, 0.5, 0.25)), seq_len=16, target_tokens=16 * 7 * 8 * 3, max_batch=32, preferred_steps=8)
    assert [w.inner_steps for w in p.workers] == [8, 8, 8]
    assert [w.batch for w in p.workers] == [12, 6, 3]
    assert p.imbalance < 0.01


def test_tokens_meet_target_when_chosen_batches_differ_in_efficiency():
    # a large per-step overhead makes big batches far more efficient than the reference batch
    profiles = [
        WorkerProfile("a", 30000.0, step_overhead_s=0.02),
        WorkerProfile("b", 20000.0, step_overhead_s=0.02),
        WorkerProfile("c", 8000.0, step_overhead_s=0.03),
    ]
    p = plan(profiles, seq_len=64, target_tokens=12288, max_batch=16, preferred_batch=8, preferred_steps=8)
    assert abs(p.tokens / p.target_tokens - 1) < 0.05
    assert p.imbalance < 0.06


def test_sync_overhead_is_part_of_each_cycle():
    """A slow worker's own sync work (codec, outer step) takes longer: it must get less inner work."""
    base = [WorkerProfile(f"w{i}", s * 1000.0) for i, s in enumerate((1.0, 0.7, 0.4))]
    ovh = [replace(p, sync_overhead_s=o) for p, o in zip(base, (0.1, 0.2, 0.5))]
    kw = dict(seq_len=8, target_tokens=8 * 8 * 3 * 40, max_batch=64, preferred_batch=8)
    p0, p1 = plan(base, **kw), plan(ovh, **kw)
    cycles = [pr.cycle_time_s(w.batch, w.inner_steps, 8) for pr, w in zip(ovh, p1.workers)]
    assert (max(cycles) - min(cycles)) / max(cycles) < 0.03
    assert [w.phase_s for w in p1.workers] == pytest.approx(cycles)
    # the slow worker gives up inner time to pay for its sync work
    assert p1.workers[2].tokens < p0.workers[2].tokens
    # the old plan, timed with these overheads, would leave someone waiting
    old = [pr.cycle_time_s(w.batch, w.inner_steps, 8) for pr, w in zip(ovh, p0.workers)]
    assert (max(old) - min(old)) / max(old) > 0.03
    with pytest.raises(BalanceError, match=r"profiles\[0\].sync_overhead_s"):
        plan([replace(base[0], sync_overhead_s=-1.0)], 8, 64)


def test_rebalancer_replans_on_measured_sync_overhead():
    profiles = [WorkerProfile(f"w{i}", s * 1000.0) for i, s in enumerate((1.0, 0.4))]
    p = plan(profiles, seq_len=8, target_tokens=8 * 8 * 2 * 40, max_batch=64, preferred_batch=8)
    rb = Rebalancer(p, threshold=0.5, ema=1.0, max_batch=64, preferred_batch=8)
    for w, prof in zip(p.workers, profiles):  # throughput exactly as planned, no overhead: keep the plan
        rb.observe(w.name, w.tokens, w.tokens / prof.tokens_per_s, 0.0)
    assert rb.maybe_replan() is None
    # now the slow worker spends 15% of a cycle in its own sync work
    slow = p.workers[1]
    rb.observe(slow.name, slow.tokens, slow.tokens / profiles[1].tokens_per_s, 0.15 * p.phase_s)
    assert rb.predicted_imbalance() > 0.1
    new = rb.maybe_replan()
    assert new is not None and new.workers[1].tokens < slow.tokens
    assert rb.predicted_imbalance() < 0.05
    # a negative (not yet measured) overhead is ignored
    rb.observe(slow.name, slow.tokens, 1.0, -1.0)
    assert rb.overheads[slow.name] == pytest.approx(0.15 * p.phase_s)


def _simulate_clock(clock_for, speeds, cycle, phases, jitter, seed=0):
    """Workers whose step times jitter by +-jitter; returns each phase's end times relative to the deadline."""
    import random

    rng = random.Random(seed)
    ends = []
    clocks = [clock_for(i, s) for i, s in enumerate(speeds)]
    t0 = 0.0
    for _ in range(phases):
        row = []
        for c, s in zip(clocks, speeds):
            c.begin(t0)
            now = t0
            while (b := c.next_batch(now)) > 0:
                dt = (0.002 + b * 8 / (1000.0 * s)) * (1 + rng.uniform(-jitter, jitter))
                now += dt
                c.observe_step(b * 8, dt)
            row.append(now - c.deadline)
        ends.append(row)
        t0 += cycle + 0.1
    return ends, clocks


def test_phase_clock_ends_phases_together_despite_jitter():
    """Fixed (b, H) plans drift apart by the step-time jitter; the clock ends phases within a small step."""
    from geomesh.balance import PhaseClock

    speeds = (1.0, 0.7, 0.4)
    profiles = [WorkerProfile(f"w{i}", s * 1000.0, step_overhead_s=0.002) for i, s in enumerate(speeds)]
    p = plan(profiles, seq_len=8, target_tokens=8 * 8 * 3 * 10, max_batch=16, preferred_batch=8, preferred_steps=10)

    def clock(i, s):  # the profile is off by 30%: the clock learns the real step time from its steps
        wrong = replace(profiles[i], tokens_per_s=profiles[i].tokens_per_s * 1.3)
        return PhaseClock(p.phase_s, p.workers[i].batch, wrong, seq_len=8)

    ends, clocks = _simulate_clock(clock, speeds, p.phase_s, phases=8, jitter=0.15)
    for row in ends[2:]:  # after a step or two of measurement
        # past the deadline by at most the jitter of one step
        assert all(e <= 0.15 * c.estimate(c.batch) for e, c in zip(row, clocks)), row
        assert max(row) - min(row) < 0.03 * p.phase_s, row
    # the same jitter under the fixed plan: phases spread by several percent of a cycle
    import random

    rng = random.Random(0)
    fixed = [
        sum((0.002 + w.batch * 8 / pr.tokens_per_s) * (1 + rng.uniform(-0.15, 0.15)) for _ in range(w.inner_steps))
        for w, pr in zip(p.workers, profiles)
    ]
    assert (max(fixed) - min(fixed)) > 0.03 * p.phase_s


def test_phase_clock_cycle_keeps_tokens_near_target_and_validates():
    from geomesh.balance import PhaseClock

    prof = WorkerProfile("w0", 1000.0)
    c = PhaseClock(1.0, 8, prof, seq_len=8, target_tokens=3000, ema=1.0)
    # three workers at 1000 / 700 / 400 tokens/s, 0.1 s of post-sync work each: (3000 + 210) / 2100
    got = c.update([1000, 700, 400], [1.0, 1.0, 1.0], [0.1, 0.1, 0.1])
    assert got == pytest.approx(3210 / 2100)
    assert c.update([1000, 700, 400], [1.0, 1.0, 1.0], [0.1, -1.0, 0.1]) == got  # not measured yet: unchanged
    c.step_s = 0.1
    c.set_batch(4)  # the measured step time is rescaled by the profile's shape
    assert c.estimate(4) == pytest.approx(0.05)
    with pytest.raises(BalanceError, match="cycle_s"):
        PhaseClock(0.0, 8, prof, seq_len=8)
    with pytest.raises(BalanceError, match="batch"):
        PhaseClock(1.0, 0, prof, seq_len=8)
