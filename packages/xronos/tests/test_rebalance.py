import contextlib

import pytest
import torch
from dist_helpers import RESHARD_CASES, small_cfg

from xronos.partition import costs_from_speeds, even_partition
from xronos.rebalance import Rebalancer
from xronos.train import TPTrainer


@contextlib.contextmanager
def _collectives(measured, reshard_s=None):
    """Rank 0's view of a 2-rank rebalance: all_reduce returns ``measured`` (and ``reshard_s``, the
    ranks' times of a calibrating reshard, for a vector of that length); reshards are recorded."""
    import xronos.rebalance as rbmod

    class Calls(list):  # the partitions resharded to, and whether each gathered every tensor
        forces: list

    calls = Calls()
    calls.forces = []
    orig_all_reduce, orig_repart = rbmod.all_reduce, rbmod.repartition

    def fake_all_reduce(v, g=None, **kw):
        src = reshard_s if reshard_s is not None and len(v) == len(reshard_s) else measured
        return v.copy_(torch.tensor(src, dtype=torch.float64))

    rbmod.all_reduce = fake_all_reduce
    rbmod.repartition = lambda trainer, p, force=False: (calls.append(p), calls.forces.append(force))
    try:
        yield calls
    finally:
        rbmod.all_reduce, rbmod.repartition = orig_all_reduce, orig_repart


@pytest.mark.slow
def test_reshard_mid_training_is_exact(train_runs):
    runs = [r["reshard"] for r in train_runs]
    for lora, kw in RESHARD_CASES.items():
        cfg = small_cfg(**kw)
        ref = TPTrainer(cfg, None if not cfg.lora_r else even_partition(cfg.shape(), 1))
        losses = [ref.step()["loss"] for _ in range(6)]  # 2 steps, reshard, 2 steps, MLP-only reshard, 2
        from xronos.shard import gather_state_dict

        ref_state = gather_state_dict(ref.model)
        assert runs[0][lora]["heads"] == (2, 32) and runs[1][lora]["heads"] == (6, 96)
        for r in runs:
            assert r[lora]["losses"] == pytest.approx(losses, rel=1e-5)
            for k, v in ref_state.items():
                torch.testing.assert_close(r[lora]["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_rebalancer_moves_work_away_from_a_slowed_rank():
    cfg = small_cfg()
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    rb = Rebalancer(shape, costs, every=2, threshold=0.05, total_steps=100)

    class Fake:  # a 2-rank trainer seen from rank 0: rank 1 measured 3x slower than modelled
        part = even_partition(shape, 2)
        step_idx = 2

    pred = [
        shape.num_layers * (c.attn_time(a) + c.mlp_time(m))
        for c, a, m in zip(costs, Fake.part.attn_units, Fake.part.mlp_units)
    ]
    # whole-step compute (no per-segment records): both segments of rank 1 are rescaled by 3
    measured = [pred[0], 0.0, 3.0 * pred[1], 0.0, 0.0, 0.0]  # + each rank's last reshard time
    with _collectives(measured) as calls:
        rb.observe({"step_s": 1.0, "comm_s": 0.0})
        assert rb.maybe_repartition(Fake) is None  # not enough steps yet
        rb.observe({"step_s": 1.0, "comm_s": 0.0})
        new = rb.maybe_repartition(Fake)
    assert new is not None and calls == [new]
    assert new.mlp_units[0] > new.mlp_units[1] and rb.history[-1]["factors"][1] == pytest.approx(3.0)


def _seg_record(attn_s, mlp_s, layers):
    """A fake TP step record whose all-reduces close attention/MLP segments of the given lengths."""
    t, syncs = 0.0, []
    order = ["attn", "mlp"] * layers + ["mlp", "attn"] * layers + ["clip"]
    for tag in order:
        t += attn_s / (2 * layers) if tag == "attn" else mlp_s / (2 * layers) if tag == "mlp" else 0.001
        syncs.append(("ar", -1, t, t + 0.0005, tag))
        t += 0.0005
    return {"t0": 0.0, "t1": t + 0.002, "step_s": t + 0.002, "comm_s": 0.0005 * len(order), "syncs": syncs}


def test_rebalancer_corrects_each_segment_on_its_own():
    cfg = small_cfg()
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100)
    part = even_partition(shape, 2)
    L = shape.num_layers
    pred = [(L * c.attn_time(a), L * c.mlp_time(m)) for c, a, m in zip(costs, part.attn_units, part.mlp_units)]
    # rank 1's MLP runs 2x slower than modelled, its attention as modelled: only the MLP split moves
    rb.observe(_seg_record(pred[0][0], pred[0][1], L))
    measured = [pred[0][0], pred[0][1], pred[1][0], 2.0 * pred[1][1], 0.0, 0.0]

    class Fake:
        step_idx = 1

    Fake.part = part
    with _collectives(measured):
        new = rb.maybe_repartition(Fake)
    ev = rb.history[-1]
    assert ev["by_segment"] and ev["factors"][1][0] == pytest.approx(1.0) and ev["factors"][1][1] == pytest.approx(2.0)
    assert new is not None and new.attn_units == part.attn_units and new.mlp_units[0] > new.mlp_units[1]


def _calibration_setup(cfg):
    """Two equal ranks on the even partition at step 2, and each rank's predicted (attn, mlp) seconds."""
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    part = even_partition(shape, 2)
    L = shape.num_layers
    pred = [(L * c.attn_time(a), L * c.mlp_time(m)) for c, a, m in zip(costs, part.attn_units, part.mlp_units)]

    class Fake:
        step_idx = 2

    Fake.part = part
    return shape, costs, part, L, pred, Fake


def test_calibration_starts_from_the_partition_the_observed_steps_give():
    shape, costs, part, L, pred, Fake = _calibration_setup(small_cfg())
    # nothing observed (or correct=False): a reshard to the same partition, which only measures the cost
    rb = Rebalancer(shape, costs, every=4, total_steps=100)
    with _collectives([], reshard_s=[0.2, 0.3]) as calls:
        assert rb.calibrate(Fake) == pytest.approx(0.3)
    assert calls == [part] and rb.reshard_cost_s == pytest.approx(0.3) and rb.history == []
    assert calls.forces == [True]  # nothing moves: every tensor is gathered, so the cost is a real reshard's
    # rank 1's MLP measured 2x slower than profiled in the observed steps: the calibrating reshard goes to
    # the corrected partition (even though a 0.3 s reshard would not pay for itself on its own)
    rb = Rebalancer(shape, costs, every=4, total_steps=3, reshard_cost_s=1e3)
    rb.observe(_seg_record(pred[0][0], pred[0][1], L))
    measured = [pred[0][0], pred[0][1], pred[1][0], 2.0 * pred[1][1], 0.0, 0.0]
    with _collectives(measured, reshard_s=[0.2, 0.3]) as calls:
        assert rb.calibrate(Fake, correct=True) == pytest.approx(0.3)
    ev = rb.history[-1]
    assert ev["calibration"] and ev["resharded"] and ev["reshard_s"] == pytest.approx(0.3)
    assert len(calls) == 1 and calls[0].attn_units == part.attn_units and calls[0].mlp_units[0] > calls[0].mlp_units[1]
    assert calls.forces == [False]  # a real move gathers what moves
    assert rb.left == [(tuple(part.attn_units), tuple(part.mlp_units))] and not rb.window
    # measured as profiled: the calibration confirms the start-up partition
    rb = Rebalancer(shape, costs, every=4, total_steps=100)
    rb.observe(_seg_record(pred[0][0], pred[0][1], L))
    with _collectives([pred[0][0], pred[0][1], pred[1][0], pred[1][1], 0.0, 0.0], reshard_s=[0.1, 0.1]) as calls:
        rb.calibrate(Fake, correct=True)
    assert calls == [part] and not rb.history[-1]["resharded"] and rb.left == [] and calls.forces == [True]
    with pytest.raises(ValueError, match="min_windows"):
        Rebalancer(shape, costs, windows=3, min_windows=4)


def test_flat_gather_rebuilds_uneven_and_empty_shards(monkeypatch):
    """One padded all_gather brings back every full tensor, rank 0's view of 3 ranks, one holding nothing."""
    import xronos.layers as lmod

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 3, generator=g), torch.randn(5, 8, generator=g), torch.randn(8, generator=g)]
    dims = [0, 1, 0]
    sizes = [(0, 8, 0), (2, 5, 1), (3, 1, 4)]  # rows of dim 0, columns of dim 1, entries

    def shard(t, d, sz, r):
        return t.narrow(d, sum(sz[:r]), sz[r])

    def flat(r):
        return torch.cat([shard(t, d, sz, r).reshape(-1) for t, d, sz in zip(full, dims, sizes)])

    def fake_all_gather(parts, padded, group=None):
        for r, out in enumerate(parts):
            out.zero_()
            out[: flat(r).numel()].copy_(flat(r))

    monkeypatch.setattr(lmod, "_active", lambda group: True)
    monkeypatch.setattr(lmod.dist, "all_gather", fake_all_gather)
    got = lmod.gather_uneven_many([(shard(t, d, sz, 0), d, sz) for t, d, sz in zip(full, dims, sizes)], None)
    assert all(torch.equal(a, b) for a, b in zip(got, full))


def test_model_built_without_init_keeps_a_tied_head():
    from xronos.shard import build_model

    config = small_cfg().model_config()
    config.tie_word_embeddings = True
    model = build_model(config, init=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_reshard_decision_weighs_saving_against_cost():
    from xronos.rebalance import reshard_decision

    # 4 layers, 10 ms -> 9 ms a layer: 4 ms a step saved
    assert reshard_decision(0.010, 0.009, 4, 200, 0.4)[0]  # 0.8 s saved over 200 steps > 0.4 s
    ok, why = reshard_decision(0.010, 0.009, 4, 16, 0.4)  # 0.064 s over 16 steps < 0.4 s
    assert not ok and "reshard cost" in why
    assert not reshard_decision(0.010, 0.009, 4, 0, 0.0)[0]  # nothing left to save
    assert not reshard_decision(0.010, 0.0099, 4, 10**6, 0.0, threshold=0.02)[0]  # 1 % gain under a 2 % threshold
    assert not reshard_decision(0.0, 0.0, 4, 100, 0.0)[0]


def test_reshard_decision_hysteresis_on_return():
    from xronos.rebalance import reshard_decision

    # a 3 % gain that pays off easily: taken for a new partition, refused back to the one just left
    assert reshard_decision(0.010, 0.0097, 4, 10**4, 0.1, returning=False)[0]
    ok, why = reshard_decision(0.010, 0.0097, 4, 10**4, 0.1, returning=True, hysteresis=0.05)
    assert not ok and "hysteresis" in why
    # noisy factors (20 % spread) raise the bar above the hysteresis; a clear 50 % gain still returns
    assert not reshard_decision(0.010, 0.0065, 4, 10**4, 0.1, returning=True, noise=0.2, hysteresis=0.05)[0]
    assert reshard_decision(0.010, 0.005, 4, 10**4, 0.1, returning=True, noise=0.2, hysteresis=0.05)[0]


def _drive(rb, part, measured, steps_at):
    """One maybe_repartition call of rank 0 with the given all-reduced vector; the partition it chose."""

    class Fake:
        step_idx = steps_at

    Fake.part = part
    with _collectives(measured) as calls:
        for _ in range(rb.every):
            rb.observe({"step_s": 1.0, "comm_s": 0.0})
        new = rb.maybe_repartition(Fake)
    assert calls == ([new] if new is not None else [])
    return new


def _even_pair():
    """Two equal ranks on the even partition and each rank's predicted whole-step compute seconds."""
    shape = small_cfg().shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    part = even_partition(shape, 2)
    pred = [
        shape.num_layers * (c.attn_time(a) + c.mlp_time(m)) for c, a, m in zip(costs, part.attn_units, part.mlp_units)
    ]
    return shape, costs, part, pred


def test_rebalancer_skips_a_reshard_that_does_not_pay_off_and_learns_the_measured_cost():
    shape, costs, part, pred = _even_pair()
    slow = [pred[0], 0.0, 3.0 * pred[1], 0.0]
    # a reshard costing 1000 s never pays off in 100 steps: the partition stays
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100, reshard_cost_s=1000.0)
    assert _drive(rb, part, slow + [0.0, 0.0], 2) is None
    assert not rb.history[-1]["resharded"] and "reshard cost" in rb.history[-1]["decision"]
    # the same drift with a cheap reshard is worth it; a later measured reshard time (max over ranks)
    # replaces the estimate
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100, reshard_cost_s=0.001)
    new = _drive(rb, part, slow + [0.0, 0.0], 2)
    assert new is not None and rb.history[-1]["resharded"]
    rb._last_reshard_s = 0.25
    _drive(rb, new, slow + [0.25, 7.5], 3)
    assert rb.reshard_cost_s == pytest.approx(7.5) and rb.history[-1]["reshard_cost_s"] == pytest.approx(7.5)


def test_rebalancer_does_not_flip_back_on_noise():
    cfg = small_cfg()
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    even = even_partition(shape, 2)
    L = shape.num_layers

    def vec(part, f1):  # rank 1 measured f1 x its modelled time on ``part``, rank 0 as modelled
        c0, c1 = costs
        return [
            L * (c0.attn_time(part.attn_units[0]) + c0.mlp_time(part.mlp_units[0])),
            0.0,
            f1 * L * (c1.attn_time(part.attn_units[1]) + c1.mlp_time(part.mlp_units[1])),
            0.0,
            0.0,
            0.0,
        ]

    # the tiny model's granularity: rank 1 30 % slower moves one MLP block (2.6 % predicted gain); the
    # way back to the even split, once rank 1 measures as modelled again, predicts a 14 % gain
    for hysteresis, returns in ((0.2, False), (0.1, True)):
        rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=10**4, windows=1, hysteresis=hysteresis)
        moved = _drive(rb, even, vec(even, 1.3), 1)
        assert moved is not None and moved.mlp_units[0] > moved.mlp_units[1]
        back = _drive(rb, moved, vec(moved, 1.0), 2)
        ev = rb.history[-1]
        if returns:
            assert back is not None and back.mlp_units == even.mlp_units
        else:
            assert back is None and not ev["resharded"] and "hysteresis" in ev["decision"]
    # a new partition (not one just left) needs no more than the threshold and the cost
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=10**4, windows=1, hysteresis=0.99)
    assert _drive(rb, even, vec(even, 1.3), 1) is not None


def test_calibration_margin_sets_the_gain_the_free_reshard_needs():
    """The calibrating reshard is paid either way: with a lower margin it moves for a smaller predicted gain."""
    shape, costs, part, L, pred, Fake = _calibration_setup(small_cfg(mlp_block=8))
    measured = [pred[0][0], pred[0][1], pred[1][0], 1.2 * pred[1][1], 0.0, 0.0]  # rank 1's MLP 20 % slower
    moved = {}
    for margin in (None, 0.0):
        rb = Rebalancer(shape, costs, every=4, total_steps=100, calibration_margin=margin)
        rb.observe(_seg_record(pred[0][0], pred[0][1], L))
        with _collectives(measured, reshard_s=[0.1, 0.1]):
            rb.calibrate(Fake, correct=True)
        ev = rb.history[-1]
        gain = 1 - ev["candidate_layer_s"] / ev["current_layer_s"]
        assert 0 < gain < rb.hysteresis  # a real but small predicted gain
        moved[margin] = ev["resharded"]
    assert moved == {None: False, 0.0: True}


def test_one_transient_window_cannot_move_the_partition_with_min_windows():
    """A reshard decision needs the median of ``min_windows`` windows: one window in which a rank ran 3x
    slower (a transient) moves the partition when one window decides, not when three do; a lasting
    drift still moves it once it holds the median."""
    shape, costs, part, pred = _even_pair()
    steady = [pred[0], 0.0, pred[1], 0.0, 0.0, 0.0]
    slow = [pred[0], 0.0, 3.0 * pred[1], 0.0, 0.0, 0.0]
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100, reshard_cost_s=0.001)
    assert _drive(rb, part, slow, 1) is not None  # min_windows=1: the first slow window decides
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100, reshard_cost_s=0.001, min_windows=3)
    assert _drive(rb, part, slow, 1) is None and "median of 3" in rb.history[-1]["decision"]
    assert _drive(rb, part, steady, 2) is None
    assert _drive(rb, part, steady, 3) is None  # median of (3x, 1x, 1x): as modelled
    rb = Rebalancer(shape, costs, every=1, threshold=0.01, total_steps=100, reshard_cost_s=0.001, min_windows=3)
    for step in (1, 2):
        assert _drive(rb, part, slow, step) is None
    new = _drive(rb, part, slow, 3)
    assert new is not None and new.mlp_units[0] > new.mlp_units[1]
