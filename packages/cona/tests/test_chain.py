import logging
import math

import pytest

from cona.chain import Chainer, goodput, remaining_time, robust_choice, switch_gain
from cona.gns import GradientNoiseScale
from cona.space import Strategy

SMALL = Strategy(2, 1, 1, 4, 8)
BIG = Strategy(2, 1, 1, 16, 64)
TP = Strategy(1, 2, 1, 8, 64)
TPUT = {SMALL: 100.0, BIG: 200.0, TP: 150.0}


def _set_phi(gns, phi, g2=1.0):
    s = phi * g2
    gns.update(g2 + s / 4, 4, g2 + s / 64, 64)


def test_goodput_formula():
    assert goodput(100.0, 8, 2.0, 8) == pytest.approx(100.0)
    assert goodput(200.0, 64, 2.0, 8, "tuned") == pytest.approx(200 * 10 / 66)
    assert goodput(200.0, 64, 2.0, 8) == pytest.approx(200 * math.sqrt(10 / 66))  # square-root LR rule (default)


def test_initial_choice_follows_the_lr_rule_training_uses():
    """The bench's measured throughputs (2 ranks, samples/s) and step-0 noise-scale range (22..44): Pollux's
    tuned-LR model credits gb32 with 1.4-1.6x gb64's per-sample progress and starts there; under the
    square-root LR rule every variant trains with, gb32 is worth only 1.2-1.3x, less than gb64's 1.44x
    throughput, and the chainer starts on gb64 (measured in samples from one checkpoint: gb32 needs
    about as many samples as gb64 there)."""
    gb = {b: Strategy(2, 1, 1, m, b) for b, m in ((16, 8), (32, 16), (64, 32), (128, 32), (256, 32))}
    tput = {gb[16]: 1502.0, gb[32]: 2720.0, gb[64]: 3909.0, gb[128]: 4466.0, gb[256]: 4929.0}
    assert robust_choice(tput, 22.0, 44.0, 8, lr_scaling="tuned")[0] == gb[32]
    pick, worst = robust_choice(tput, 22.0, 44.0, 8)
    assert pick == gb[64] and worst == pytest.approx(1.0)
    gns = GradientNoiseScale(reference_batch=8)
    d = Chainer(list(tput), tput, gns, horizon_s=3.0).decide(None, noise_range=(22.0, 44.0))
    assert d.chosen == gb[64] and d.to_dict()["efficiency_model"] == "sqrt"
    # the late move to a bigger batch: gb128 beats gb64 by the 5% margin only at a noise scale ~285 and up
    _set_phi(gns, 400.0)
    d = Chainer(list(tput), tput, gns, horizon_s=3.0, switch_cost_s=0.015, same_layout_cost_s=0.015).decide(
        gb[64], step=1
    )
    assert d.switched and d.chosen.global_batch > 64
    _set_phi(gns, 200.0)
    assert (
        not Chainer(list(tput), tput, gns, horizon_s=3.0, switch_cost_s=0.015, same_layout_cost_s=0.015)
        .decide(gb[64], step=2)
        .switched
    )


def test_initial_choice_holds_under_every_efficiency_model():
    """The 4-rank bench's probed throughputs (samples/s of each global batch's fastest strategy) and a step-0
    range of 19..31: under the square-root model alone gb128 looks best (its 1.34x throughput over gb64 buys
    more than the 0.76x efficiency costs); under the per-step-capped (tuned) form it keeps only 0.75 of the best
    goodput, gb64 0.97 (from scratch, gb128 needed 1.4-1.6x gb64's samples). Over both models gb64 is the robust
    start, as the oracle's first phase; the running decisions keep the configured model."""
    gb = {b: Strategy(4, 1, 1, min(b // 4, 32), b) for b in (32, 64, 128, 256)}
    tput = {gb[32]: 1363.0, gb[64]: 2421.0, gb[128]: 3233.0, gb[256]: 3824.0}
    assert robust_choice(tput, 19.0, 31.0, 8)[0] == gb[128]
    pick, worst = robust_choice(tput, 19.0, 31.0, 8, lr_scaling=("sqrt", "tuned"))
    assert pick == gb[64] and 0.95 < worst < 1.0
    gns = GradientNoiseScale(reference_batch=8)
    ch = Chainer(list(tput), tput, gns, horizon_s=3.0, initial_models=("sqrt", "tuned"))
    d = ch.decide(None, noise_range=(19.0, 31.0))  # no current strategy: the initial choice
    assert d.chosen == gb[64] and "sqrt and tuned" in d.reason and d.efficiency_model == "sqrt+tuned"
    assert ch.initial((19.0, 31.0)) == d and ch.decisions[-2:] == [d, d]
    _set_phi(gns, 25.0)
    assert ch.rank()[0].strategy == gb[128]  # running rankings: the estimator's own (sqrt) model only
    assert ch.decide(gb[64], step=1).efficiency_model == "sqrt"
    assert Chainer(list(tput), tput, gns, initial_models="tuned").initial_models == ("tuned",)
    with pytest.raises(ValueError, match="initial_models must name one or more of sqrt, tuned, got sqrt,adam"):
        Chainer(list(tput), tput, gns, initial_models=("sqrt", "adam"))
    with pytest.raises(ValueError, match="lr_scaling must name one or more of sqrt, tuned, got none"):
        robust_choice(tput, 19.0, 31.0, 8, lr_scaling=())


def test_initial_choice_takes_the_larger_batch_of_two_level_within_the_margin():
    """A 2-rank table and a step-0 range of 14..29: over both models gb32 keeps 0.854 of
    the best goodput and gb64, 1.45x its samples/s, 0.853. Level within the switch margin, the larger batch is
    taken (the noise scale grows from step 0); without a tie tolerance the 0.001 decides."""
    gb = {b: Strategy(2, 1, 1, min(b // 2, 32), b) for b in (16, 32, 64, 128, 256)}
    tput = {gb[16]: 1321.0, gb[32]: 2145.0, gb[64]: 3102.0, gb[128]: 3692.0, gb[256]: 4046.0}
    models = ("sqrt", "tuned")
    pick, worst = robust_choice(tput, 14.0, 28.9, 8, lr_scaling=models)
    assert pick == gb[32] and worst == pytest.approx(0.854, abs=5e-4)
    pick, worst = robust_choice(tput, 14.0, 28.9, 8, lr_scaling=models, tie=0.01)
    assert pick == gb[64] and worst == pytest.approx(0.853, abs=5e-4)
    # a clear winner stays the winner whatever the tolerance: seed 4's range 38..55 (gb64 0.99, the next 0.86)
    assert robust_choice(tput, 37.9, 55.3, 8, lr_scaling=models, tie=0.05)[0] == gb[64]
    gns = GradientNoiseScale(reference_batch=8)
    d = Chainer(list(tput), tput, gns, margin=0.01, initial_models=models).decide(None, noise_range=(14.0, 28.9))
    assert d.chosen == gb[64] and f"level with {gb[32].name}'s 0.854 within the 0.01 margin" in d.reason
    d = Chainer(list(tput), tput, gns, margin=0.0, initial_models=models).decide(None, noise_range=(14.0, 28.9))
    assert d.chosen == gb[32] and "level with" not in d.reason
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="tie must be a fraction in"):
            robust_choice(tput, 14.0, 28.9, 8, tie=bad)


def test_chainer_switches_on_schedule_and_logs_reasons(caplog):
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    ch = Chainer([SMALL, BIG, TP], TPUT, gns, horizon_s=10.0, margin=0.05, switch_cost_s=1.0)
    chosen = []
    cur = None
    with caplog.at_level(logging.INFO, logger="cona.chain"):
        for step, phi in enumerate([1.0, 2.0, 5.0, 20.0, 100.0, 1000.0, 1000.0]):
            _set_phi(gns, phi)
            d = ch.decide(cur, step=step)
            cur = d.chosen
            chosen.append(cur)
    assert chosen[0] == SMALL  # low noise scale: the small batch is more efficient
    assert chosen[-1] == BIG  # high noise scale: the fastest hardware strategy wins
    assert sum(d.switched for d in ch.decisions[1:]) == 1
    sw = next(d for d in ch.decisions[1:] if d.switched)
    assert "switch" in sw.reason and BIG.name in sw.reason
    assert all(d.reason for d in ch.decisions)
    assert "switch:" in caplog.text and "stay:" in caplog.text
    assert ch.decisions[-1].to_dict()["ranking"][0]["strategy"] == BIG.name


def test_hysteresis_and_switch_cost_prevent_thrashing():
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    # phi where BIG is ~3% better than SMALL: inside the 5% margin -> stay
    phi = 0.0
    for p in [x / 10 for x in range(1, 2000)]:
        if goodput(200, 64, p, 8) > 1.03 * goodput(100, 8, p, 8):
            phi = p
            break
    _set_phi(gns, phi)
    ch = Chainer([SMALL, BIG], TPUT, gns, horizon_s=10.0, margin=0.05, switch_cost_s=0.0)
    assert ch.rank()[0].strategy == BIG
    assert not ch.decide(SMALL).switched
    # clearly better, but the switch costs more than the horizon gains -> stay
    _set_phi(gns, 1000.0)
    ch2 = Chainer([SMALL, BIG], TPUT, gns, horizon_s=10.0, margin=0.05, switch_cost_s=6.0, same_layout_cost_s=6.0)
    d = ch2.decide(SMALL)
    assert not d.switched and "switch 6.00s" in d.reason and "a 10.00s horizon" in d.reason
    # measured switch costs replace the prior of their kind (SMALL and BIG share the dp2 layout)
    ch2.observe_switch(0.1, same_layout=True)
    assert ch2.expected_switch_cost_s(SMALL, BIG) == pytest.approx(0.1)
    assert ch2.expected_switch_cost_s(SMALL, TP) == ch2.expected_switch_cost_s() == 6.0
    assert ch2.decide(SMALL).switched


def test_a_switch_within_one_layout_is_costed_apart_from_a_resharding():
    """SMALL -> BIG keeps the dp2 layout (no state moves, ``Executor.retarget``), SMALL -> TP reshards: with a
    6 s resharding prior over a 10 s horizon only the first pays; a measured resharding replaces only its kind."""
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    _set_phi(gns, 1000.0)
    ch = Chainer([SMALL, TP], TPUT, gns, horizon_s=10.0, margin=0.05, switch_cost_s=6.0)
    assert not ch.decide(SMALL).switched  # TP: 1.5x over the 4 s a resharding leaves of 10 s
    assert ch.expected_switch_cost_s(SMALL, BIG) == 0.0
    both = Chainer([SMALL, BIG, TP], TPUT, gns, horizon_s=10.0, margin=0.05, switch_cost_s=6.0)
    d = both.decide(SMALL)
    assert d.switched and d.chosen == BIG and d.switch_cost_s == 0.0
    both.observe_switch(0.02)
    assert both.expected_switch_cost_s(SMALL, TP) == pytest.approx(0.02)
    assert both.expected_switch_cost_s(SMALL, BIG) == 0.0
    with pytest.raises(ValueError, match="same_layout_cost_s"):
        Chainer([SMALL], TPUT, gns, same_layout_cost_s=-1.0)
    with pytest.raises(ValueError, match="seconds must be"):
        both.observe_switch(float("nan"))
    # the remaining-time rule charges each rival its own kind: TP (2x BIG's samples/s) would win at either single
    # cost, 0 for all (1.9x) or 6 s for all (BIG loses 6 s of 10 too); with each its own, BIG (+46%) beats TP (+17%)
    fast_tp = {SMALL: 100.0, BIG: 150.0, TP: 300.0}
    mixed = Chainer([SMALL, BIG, TP], fast_tp, gns, margin=0.01, switch_cost_s=6.0)
    d = mixed.decide(SMALL, step=1, noise_range=(900.0, 1100.0), remaining_s=10.0)
    assert d.switched and d.chosen == BIG and d.switch_cost_s == 0.0


def test_chainer_rejects_bad_input():
    gns = GradientNoiseScale(reference_batch=8)
    with pytest.raises(ValueError, match="candidates"):
        Chainer([], TPUT, gns)
    ch = Chainer([SMALL], TPUT, gns)
    with pytest.raises(ValueError, match="not among the candidates"):
        ch.decide(BIG)


def test_robust_initial_choice_under_an_uncertain_noise_scale():
    mid = Strategy(2, 1, 1, 8, 32)
    tput = {SMALL: 100.0, mid: 300.0, BIG: 340.0}
    # a narrow range at a low noise scale: the small batch is best there
    pick, worst = robust_choice(tput, 0.5, 1.0, 8, lr_scaling="tuned")
    assert pick == SMALL and worst == pytest.approx(1.0)
    # noise scale anywhere in [1, 1000]: the middle batch loses least wherever the truth lies
    pick, worst = robust_choice(tput, 1.0, 1000.0, 8, lr_scaling="tuned")
    assert pick == mid and 0.5 < worst < 1.0
    for phi in (1.0, 1000.0):  # while each end alone prefers another strategy
        assert max(tput, key=lambda s: goodput(tput[s], s.global_batch, phi, 8, "tuned")) != mid
    gns = GradientNoiseScale(reference_batch=8, lr_scaling="tuned")
    ch = Chainer([SMALL, mid, BIG], tput, gns, horizon_s=3.0)
    d = ch.decide(None, noise_range=(1.0, math.inf))
    assert d.switched and d.chosen in (mid, BIG) and "uncertain noise scale" in d.reason
    # no statistics yet: later decisions stay put (and say why)
    later = ch.decide(d.chosen, step=5)
    assert not later.switched and "no gradient statistics" in later.reason


# The bench's measured throughputs (2 ranks, samples/s): gb128 runs 1.14x gb64's samples per second.
GB64, GB128, GB256 = Strategy(2, 1, 1, 32, 64), Strategy(2, 1, 1, 32, 128), Strategy(2, 1, 1, 32, 256)
LATE = {GB64: 3909.0, GB128: 4466.0, GB256: 4929.0}


def _late_chainer(phi: float, margin: float = 0.05) -> Chainer:
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    _set_phi(gns, phi)
    return Chainer(list(LATE), LATE, gns, horizon_s=3.0, margin=margin, switch_cost_s=0.015, same_layout_cost_s=0.015)


def test_remaining_time_hysteresis_switches_where_a_short_horizon_stays():
    """gb128 beats gb64 by 2.5-4% everywhere in a noise-scale range of 200..300 (the late phase of the
    perplexity-5.8 run): over ~5 s left to the target a 0.015 s switch pays for itself many times, so the
    rule switches; with no time left given, a 5% margin over the 3 s horizon keeps gb64."""
    assert not _late_chainer(230.0).decide(GB64, step=1).switched  # inside the 5% margin
    ch = _late_chainer(230.0, margin=0.0)
    d = ch.decide(GB64, step=1, noise_range=(200.0, 300.0), remaining_s=5.0)
    assert d.switched and d.chosen == GB128
    assert "every noise scale in the range" in d.reason and "5.00s to target" in d.reason


def test_remaining_time_hysteresis_needs_a_win_across_the_noise_range():
    """A point estimate (400) where bigger batches win by > 5% but a range (40..400) where they lose at its
    low end: the point estimate alone switches, the range stays and says which rival came closest."""
    assert _late_chainer(400.0).decide(GB64, step=1).switched  # no range: the point estimate alone
    d = _late_chainer(400.0, margin=0.0).decide(GB64, step=1, noise_range=(40.0, 400.0), remaining_s=5.0)
    assert not d.switched and d.chosen == GB64 and "worst noise scale" in d.reason


def test_no_switch_when_the_target_is_closer_than_the_switch_cost():
    ch = _late_chainer(1000.0, margin=0.0)
    assert ch.decide(GB64, step=1, noise_range=(900.0, 1100.0), remaining_s=5.0).switched
    assert not ch.decide(GB64, step=2, noise_range=(900.0, 1100.0), remaining_s=0.01).switched
    assert switch_gain(2.0, 64, 1.0, 64, [100.0], horizon_s=0.01, switch_cost_s=0.015, reference_batch=8) == -1.0
    # the gain is the worst case over the range, net of the switch cost's share of the horizon
    g = switch_gain(200.0, 64, 100.0, 8, [0.0, 1e6], horizon_s=10.0, switch_cost_s=1.0, reference_batch=8)
    assert g == pytest.approx(2.0 * math.sqrt(8 / 64) * 0.9 - 1.0)


def test_remaining_time_from_the_loss_trend():
    target = 3 - 0.5 * math.log(8.0)
    trace = [(t / 10, 3 - 0.5 * math.log(t / 10)) for t in range(1, 41)]  # linear in log(clock)
    assert remaining_time(trace, target, 2.0, 100.0) == pytest.approx(4.0)  # reaches the target at t = 8
    assert remaining_time(trace, 0.0, 2.0, 10.0) == 10.0  # beyond the cap
    assert remaining_time(trace, 3.0, 2.0, 10.0) == 0.0  # already there
    assert remaining_time([(t / 10, 2.0 + 0.01 * t) for t in range(1, 20)], 1.0, 2.0, 7.0) == 7.0  # not falling
    assert remaining_time(trace[:2], target, 2.0, 7.0) == 7.0  # too few points


def test_a_fixed_gain_switches_with_a_long_time_left_and_stays_with_a_short_one():
    """Two layouts of the same global batch (equal efficiency at every noise scale): the rival is 3% faster,
    a switch costs 0.1 s. Over 20 s left it gains 1.03 x 19.9/20 - 1 = +2.5% (> the 1% margin): switch;
    over 2 s left it loses 1.03 x 1.9/2 - 1 = -2.2%: stay."""
    a, b = Strategy(2, 1, 1, 32, 64), Strategy(1, 2, 1, 32, 64)
    tput = {a: 100.0, b: 103.0}
    for left, gain in ((20.0, 1.03 * 19.9 / 20 - 1), (2.0, 1.03 * 1.9 / 2 - 1)):
        assert switch_gain(103.0, 64, 100.0, 64, [50.0, 200.0], left, 0.1, 8) == pytest.approx(gain)
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    _set_phi(gns, 100.0)
    ch = Chainer([a, b], tput, gns, horizon_s=3.0, margin=0.01, switch_cost_s=0.1)
    long = ch.decide(a, step=1, noise_range=(50.0, 200.0), remaining_s=20.0)
    assert long.switched and long.chosen == b
    short = ch.decide(a, step=2, noise_range=(50.0, 200.0), remaining_s=2.0)
    assert not short.switched and short.chosen == a
    # within the margin: +0.5% over 20 s left is not enough
    slim = Chainer([a, b], {a: 100.0, b: 101.0}, gns, horizon_s=3.0, margin=0.01, switch_cost_s=0.1)
    assert not slim.decide(a, step=3, noise_range=(50.0, 200.0), remaining_s=20.0).switched


def test_noise_range_quantiles_for_few_pairs_and_the_running_default():
    from cona.gns import t_quantile_975

    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    for i in range(8):
        gns.update(1.0 + 0.1 * (i % 3) + 30.0 / 4, 4, 1.0 + 0.1 * (i % 3) + 30.0 / 64, 64)
    assert t_quantile_975(7) == pytest.approx(2.365, abs=1e-3) and t_quantile_975(1000) == pytest.approx(1.96)
    lo_t, hi_t = gns.interval(z=None, window=8)
    lo_2, hi_2 = gns.interval(z=2.0, window=8)
    assert lo_t < lo_2 and hi_t > hi_2  # 7 degrees of freedom: wider than +-2 standard errors
    assert (lo_t, hi_t) == pytest.approx(gns.interval(z=t_quantile_975(7), window=8))
    from cona.config import BenchConfig

    cfg = BenchConfig()  # running decisions: half a standard error (a switch is reversible a second later)
    assert cfg.range_z == 0.5 and cfg.margin > 0
    lo_1, hi_1 = gns.interval(z=cfg.range_z, window=8)
    assert lo_t < lo_2 < lo_1 < hi_1 < hi_2 < hi_t  # narrower than +-2 standard errors (and the t range) both sides


def test_one_standard_error_switches_where_the_t_range_holds_back_and_the_way_back_reads_the_far_end():
    """gb128 at 1.2x gb64's samples/s wins under the square-root model (1% margin, 5 s left) above a noise scale of
    ~95. Pairs whose ratio of means reads ~150 bound it above that at one standard error (switch) but not at the t
    quantile (stay); back on gb128, gb64 must win at the range's far end, not at the point estimate."""
    from cona.config import BenchConfig
    from cona.space import Strategy

    a, b = Strategy(2, 1, 2, 32, 64), Strategy(4, 1, 1, 32, 128)
    tput = {a: 2500.0, b: 3000.0}
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    for i in range(8):  # (|G|^2, tr Sigma) around (1, 150), spread so that the ranges differ
        g2, tr = 1.0 + 0.4 * (-1) ** i, 150.0 + 60.0 * ((i % 4) - 1.5)
        gns.update(g2 + tr / 8, 8, g2 + tr / 64, 64)
    t_range = gns.interval(z=None, window=8)
    one_se = gns.interval(z=BenchConfig().range_z, window=8)
    assert t_range[0] < 80 and one_se[0] > 110
    ch = Chainer([a, b], tput, gns, margin=0.01, switch_cost_s=0.03)
    assert not ch.decide(a, step=1, noise_range=t_range, remaining_s=5.0).switched
    d = ch.decide(a, step=2, noise_range=one_se, remaining_s=5.0)
    assert d.switched and d.chosen == b
    # back on gb128 the guard is the range's far end: gb64 wins (1% margin, 0.03 s switch, 5 s left) only below a
    # noise scale of ~67, so a point estimate of 50 moves nothing while the range reaches 120, and moves back once
    # the whole range lies below
    low = GradientNoiseScale(reference_batch=8, decay=0.0)
    _set_phi(low, 50.0)
    back = Chainer([a, b], tput, low, margin=0.01, switch_cost_s=0.03)
    assert not back.decide(b, step=3, noise_range=(40.0, 120.0), remaining_s=5.0).switched
    d = back.decide(b, step=4, noise_range=(30.0, 60.0), remaining_s=5.0)
    assert d.switched and d.chosen == a


def test_a_noise_scale_carried_ahead_ranks_and_switches_where_the_lagging_estimate_stays():
    """The estimator reads 100 (its pairs' past), the carried range 170..210 (where the next interval lies):
    gb128 loses at the read range's low end and wins across the carried one; the point it ranks by is the one
    passed, not the estimator's."""
    ch = _late_chainer(100.0, margin=0.0)
    assert not ch.decide(GB64, step=1, noise_range=(80.0, 120.0), remaining_s=5.0).switched
    d = ch.decide(GB64, step=2, noise_range=(170.0, 210.0), remaining_s=5.0, noise_scale=190.0)
    assert d.switched and d.chosen == GB128 and d.noise_scale == 190.0
    assert ch.decide(GB64, step=3, noise_range=(170.0, 210.0), remaining_s=5.0).noise_scale == pytest.approx(100.0)


def test_a_running_decision_can_be_held_to_every_efficiency_model():
    """gb64 -> gb128 (1.32x the samples/s, this VM's 4-rank table) at a noise scale of 40-55: +3-6% under the
    square-root model, -14..-18% under the tuned one. With ``models`` naming both, the switch waits; the decision
    says under which models it was taken."""
    a, b = Strategy(2, 1, 2, 32, 64), Strategy(4, 1, 1, 32, 128)
    tput = {a: 2087.0, b: 2750.0}
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    _set_phi(gns, 50.0)
    ch = Chainer([a, b], tput, gns, margin=0.01, switch_cost_s=0.05)
    d = ch.decide(a, step=1, noise_range=(40.0, 55.0), remaining_s=8.0)
    assert d.switched and d.chosen == b and d.to_dict()["efficiency_model"] == "sqrt"
    held = ch.decide(a, step=2, noise_range=(40.0, 55.0), remaining_s=8.0, models=("sqrt", "tuned"))
    assert not held.switched and held.to_dict()["efficiency_model"] == "sqrt+tuned"
    assert "under the sqrt and tuned efficiency models" in held.reason
    # late, with the noise scale well above both batches, it pays under both
    _set_phi(gns, 600.0)
    late = ch.decide(a, step=3, noise_range=(500.0, 700.0), remaining_s=8.0, models=("sqrt", "tuned"))
    assert late.switched and late.chosen == b
    with pytest.raises(ValueError, match="models must name one or more of sqrt, tuned"):
        ch.decide(a, step=4, noise_range=(40.0, 55.0), remaining_s=8.0, models=("cubic",))
    one = ch.decide(a, step=5, noise_range=(500.0, 700.0), remaining_s=8.0, models="tuned")  # a name, not letters
    assert one.switched and one.to_dict()["efficiency_model"] == "tuned"


def test_goodput_scaling_keeps_the_data_parallel_layout_and_scales_with_hysteresis():
    """The AdaptDL/Pollux baseline: the data-parallel strategies alone, the best goodput at step 0's noise scale,
    then a bigger batch only when its goodput beats the current one's by more than 5%."""
    from cona.chain import GoodputScaler

    gb = {b: Strategy(2, 1, 1, min(b // 2, 32), b) for b in (16, 32, 64, 128)}
    pp32 = Strategy(1, 1, 2, 32, 32)  # the fastest gb32 here, but another layout: never taken
    tput = {gb[16]: 1500.0, gb[32]: 2700.0, gb[64]: 3900.0, gb[128]: 4500.0, pp32: 3500.0}
    cands = GoodputScaler.data_parallel(list(tput))
    assert cands == list(gb.values())
    gns = GradientNoiseScale(reference_batch=8)
    sc = GoodputScaler(cands, tput, gns, margin=0.05)
    assert sc.start(None).chosen == gb[16]  # unresolved at step 0: the smallest batch
    best_at_20 = max(gb.values(), key=lambda s: goodput(tput[s], s.global_batch, 20.0, 8))
    assert sc.start(20.0).chosen == best_at_20 != gb[128]
    stay = sc.decide(best_at_20, step=1)
    assert not stay.switched and "no gradient statistics yet" in stay.reason
    _set_phi(gns, 2000.0)  # the noise scale has grown: gb128 wins by far more than 5%
    d = sc.decide(best_at_20, step=2)
    assert d.switched and d.chosen == gb[128]
    # within the hysteresis: gb128 beats gb64 by under 5% at this noise scale, so gb64 stays
    phi = next(p for p in range(10, 5000) if 1.0 < goodput(4500.0, 128, p, 8) / goodput(3900.0, 64, p, 8) < 1.05)
    assert not sc.decide(gb[64], step=3, noise_scale=float(phi)).switched
