import math

import numpy as np
import pytest

from cona.gns import GradientNoiseScale, batch_efficiency, fieller_interval, unbiased_estimates


def _trials(n_trials, b, B, d=50, seed=0):
    rng = np.random.default_rng(seed)
    G = rng.normal(size=d) * 0.3
    sd = rng.uniform(0.5, 2.0, size=d)  # per-sample gradient noise, tr(Sigma) = sum(sd^2)
    g2s, ss, naive = [], [], []
    for _ in range(n_trials):
        samples = G + rng.normal(size=(B, d)) * sd
        g_small = samples[:b].mean(0)  # a micro-batch inside the global batch
        g_big = samples.mean(0)
        g2, s = unbiased_estimates(g_small @ g_small, b, g_big @ g_big, B)
        g2s.append(g2)
        ss.append(s)
        naive.append(g_big @ g_big)
    return float(G @ G), float((sd**2).sum()), np.array(g2s), np.array(ss), np.array(naive)


def test_estimates_are_unbiased_on_known_variance():
    true_g2, true_s, g2s, ss, naive = _trials(4000, 4, 32)
    se_g2 = g2s.std() / np.sqrt(len(g2s))
    se_s = ss.std() / np.sqrt(len(ss))
    assert abs(g2s.mean() - true_g2) < 4 * se_g2
    assert abs(ss.mean() - true_s) < 4 * se_s
    # the naive |g_B|^2 is biased upward by tr(Sigma)/B: the test can tell them apart
    assert naive.mean() - true_g2 > 10 * se_g2


def test_ema_tracks_noise_scale_and_efficiency():
    true_g2, true_s, g2s, ss, _ = _trials(1, 4, 32)
    gns = GradientNoiseScale(reference_batch=8, decay=0.95)
    rng = np.random.default_rng(1)
    d = 50
    G = rng.normal(size=d) * 0.3
    sd = rng.uniform(0.5, 2.0, size=d)
    for step in range(1500):
        samples = G + rng.normal(size=(32, d)) * sd
        a, b = samples[:4].mean(0), samples.mean(0)
        assert gns.update(a @ a, 4, b @ b, 32, step)
    phi = (sd**2).sum() / (G @ G)
    assert gns.noise_scale == pytest.approx(phi, rel=0.25)
    assert gns.efficiency(8) == pytest.approx(1.0)
    # default efficiency model: Adam under the square-root LR rule (the bench's), sqrt of Pollux's ratio
    assert gns.lr_scaling == "sqrt"
    assert gns.efficiency(64) == pytest.approx(math.sqrt((gns.noise_scale + 8) / (gns.noise_scale + 64)))
    assert gns.gain(64) == pytest.approx(8 * gns.efficiency(64))
    assert 1.0 < gns.gain(64) < 8.0
    tuned = GradientNoiseScale(reference_batch=8, lr_scaling="tuned")
    assert tuned.efficiency(64, gns.noise_scale) == pytest.approx((gns.noise_scale + 8) / (gns.noise_scale + 64))


def test_degenerate_pairs_are_skipped_and_bad_input_named():
    gns = GradientNoiseScale(reference_batch=8)
    assert not gns.update(1.0, 8, 1.0, 8)
    assert not gns.ready
    with pytest.raises(ValueError, match="b_big must exceed b_small"):
        unbiased_estimates(1.0, 8, 1.0, 4)
    with pytest.raises(ValueError, match="reference_batch"):
        GradientNoiseScale(reference_batch=0)


def test_noise_scale_keeps_last_value_when_g2_estimate_goes_negative():
    gns = GradientNoiseScale(reference_batch=8, decay=0.0)
    gns.update(1.0 + 4.0 / 4, 4, 1.0 + 4.0 / 64, 64)  # |G|^2 = 1, tr(Sigma) = 4
    assert gns.noise_scale == pytest.approx(4.0)
    gns.update(20.0, 4, 1.0, 64)  # an unlucky pair: |G|^2 estimate < 0
    assert gns.grad_sq < 0
    assert gns.noise_scale == pytest.approx(4.0)


def test_interval_covers_the_truth_and_widens_with_noise():
    true_g2, true_s, g2s, ss, _ = _trials(400, 4, 32, seed=1)
    gns = GradientNoiseScale(reference_batch=4)
    for g2, s in zip(g2s, ss):
        gns.raw.append((float(g2), float(s)))
    lo, hi = gns.interval()
    assert lo < true_s / true_g2 < hi
    few = GradientNoiseScale(reference_batch=4)
    few.raw.extend((float(g), float(s)) for g, s in zip(g2s[:3], ss[:3]))
    lo3, hi3 = few.interval()
    assert hi3 - lo3 > hi - lo  # three pairs bound the noise scale far less tightly
    assert GradientNoiseScale(reference_batch=4).interval() == (0.0, float("inf"))


def test_sqrt_lr_efficiency_model():
    """Under square-root LR scaling Adam's per-sample progress is batch-independent far below the noise
    scale and falls as 1/sqrt(M) far above it; Pollux's tuned-LR model (per-sample progress ~ 1/M above
    the noise scale) over-rates small batches by the square of that. With the measured preconditioned
    noise scale ~200 at a late checkpoint, gb256 needs 1.31x gb64's samples (measured 1.15-1.2x; the
    tuned model says 1.72x)."""
    assert batch_efficiency(256, 1e6, 8) == pytest.approx(1.0, abs=1e-3)
    assert batch_efficiency(256, 1e6, 8, "tuned") == pytest.approx(1.0, abs=1e-3)
    for m in (64, 256):  # far above the noise scale: 1/sqrt(M) per sample vs 1/M
        assert batch_efficiency(m, 0.0, 8) == pytest.approx(math.sqrt(8 / m))
        assert batch_efficiency(m, 0.0, 8, "tuned") == pytest.approx(8 / m)
    sqrt_ratio = batch_efficiency(64, 200, 8) / batch_efficiency(256, 200, 8)
    tuned_ratio = batch_efficiency(64, 200, 8, "tuned") / batch_efficiency(256, 200, 8, "tuned")
    assert sqrt_ratio == pytest.approx(math.sqrt(tuned_ratio))
    assert 1.25 < sqrt_ratio < 1.35 and tuned_ratio > 1.7
    with pytest.raises(ValueError, match="lr_scaling must be one of sqrt, tuned"):
        batch_efficiency(64, 10, 8, "linear")
    with pytest.raises(ValueError, match="lr_scaling"):
        GradientNoiseScale(reference_batch=8, lr_scaling="adam")


def test_interval_over_a_window_follows_the_recent_noise_scale():
    gns = GradientNoiseScale(reference_batch=8, decay=0.5)
    for phi in [10.0] * 20 + [200.0] * 8:  # exact pairs: |G|^2 = 1, tr(Sigma) = phi
        gns.update(1.0 + phi / 4, 4, 1.0 + phi / 64, 64)
    assert gns.interval(window=8) == pytest.approx((200.0, 200.0))
    lo, hi = gns.interval()  # |G|^2 exact, tr(Sigma) spread: the range is the mean of tr(Sigma) +- z se
    ss = [10.0] * 20 + [200.0] * 8
    mean = sum(ss) / 28
    se = (sum((x - mean) ** 2 for x in ss) / 27 / 28) ** 0.5
    assert (lo, hi) == pytest.approx((mean - 2 * se, mean + 2 * se))


def test_interval_counts_the_error_of_both_estimates():
    """Early on, with (32, 64) pairs (dp2 x 32 on 4 ranks) and a noise scale ~27, a range that takes only
    |G|^2 as uncertain put its lower end above the truth in 15-21% of windows of 4-8 pairs (nominal 2.5%): the
    spurious early switches. Fieller's set, over tr(Sigma), |G|^2 and their covariance, covers ~95%."""
    from cona.gns import fieller_interval

    rng = np.random.default_rng(0)
    d = 50
    G = rng.normal(size=d) * 0.3
    sd = rng.uniform(0.5, 2.0, size=d)
    phi = (sd**2).sum() / (G @ G)
    pairs = []
    for _ in range(2000):
        x = G + rng.normal(size=(64, d)) * sd
        a, b = x[:32].mean(0), x.mean(0)
        pairs.append(unbiased_estimates(a @ a, 32, b @ b, 64))
    windows = [pairs[i : i + 8] for i in range(0, 2000, 8)]
    covered = above = above_old = 0
    for w in windows:
        lo, hi = fieller_interval(w, 2.365)  # Student-t, 7 degrees of freedom
        covered += lo <= phi <= hi
        above += lo > phi
        g = sum(p[0] for p in w) / 8
        s = sum(p[1] for p in w) / 8
        se = (sum((p[0] - g) ** 2 for p in w) / 7 / 8) ** 0.5
        above_old += s / (g + 2.365 * se) > phi  # the |G|^2-only range: only |G|^2 uncertain
    assert covered / len(windows) > 0.9 and above / len(windows) < 0.05
    assert above_old / len(windows) > 0.1
    assert fieller_interval(pairs[:1]) == (0.0, math.inf)  # one pair bounds nothing
    # |G|^2 not resolved above zero: the set is unbounded above
    assert fieller_interval([(1.0, 50.0), (-1.0, 60.0), (0.5, 40.0)])[1] == math.inf


def test_step0_range_uses_the_student_t_quantile_for_its_pairs():
    """The step-0 range comes from few pairs (8 micro-batches): the bench uses the Student-t quantile for them
    (2.36), whatever its running decisions use."""
    import random

    from cona.bench import step0_range
    from cona.config import BenchConfig
    from cona.gns import t_quantile_975

    rng = random.Random(3)
    pairs = [(1.0 + rng.gauss(0, 0.2), 40 + rng.gauss(0, 8)) for _ in range(8)]
    assert BenchConfig().range_z == 0.5  # the running decisions' quantile is not the step-0 one
    lo, hi = step0_range(pairs)
    assert (lo, hi) == pytest.approx(fieller_interval(pairs, t_quantile_975(7)))
    assert t_quantile_975(7) == 2.365
    lo2, hi2 = fieller_interval(pairs, 2.0)
    assert lo < lo2 < hi2 < hi  # wider than two standard errors on both sides


def _micro_batches(rng, k, b, g, sigma):
    """k micro-batch gradients of b samples each: the true gradient g plus per-sample noise of sd sigma per
    coordinate, averaged."""
    return [[gi + sum(rng.gauss(0, sigma) for _ in range(b)) / b for gi in g] for _ in range(k)]


def test_micro_batch_jackknife_is_unbiased_and_its_range_covers_the_noise_scale():
    """Micro-batch gradients with a known |G|^2 and tr(Sigma): the pseudo-pairs' means are unbiased for both, and
    Fieller's set over one batch's 8 pseudo-pairs covers the true noise scale about 95% of the time."""
    import random

    from cona.gns import micro_batch_pairs, t_quantile_975

    rng = random.Random(5)
    dim, k, b, sigma = 40, 8, 8, 1.0
    g = [0.25] * dim  # |G|^2 = 2.5, tr(Sigma) = 40 (per sample): noise scale 16
    g2_true, tr_true = sum(x * x for x in g), dim * sigma**2
    phi = tr_true / g2_true
    sums, covered, n = [0.0, 0.0], 0, 400
    for _ in range(n):
        mbs = _micro_batches(rng, k, b, g, sigma)
        mean = [sum(c) / k for c in zip(*mbs)]
        norms = [sum(x * x for x in m) for m in mbs]
        dots = [sum(x * y for x, y in zip(m, mean)) for m in mbs]
        pairs = micro_batch_pairs(norms, dots, sum(x * x for x in mean), b)
        assert len(pairs) == k
        u, t = (sum(x) / k for x in zip(*pairs))
        sums[0] += u
        sums[1] += t
        lo, hi = fieller_interval(pairs, t_quantile_975(k - 1))
        covered += lo <= phi <= hi
    assert sums[0] / n == pytest.approx(g2_true, rel=0.05)
    assert sums[1] / n == pytest.approx(tr_true, rel=0.05)
    assert 0.88 <= covered / n <= 0.99
    # each pseudo-value against the estimates recomputed from the vectors without micro-batch k
    mbs = _micro_batches(rng, 5, b, g, sigma)

    def estimates(vs):
        n, mean = len(vs), [sum(c) / len(vs) for c in zip(*vs)]
        g2 = sum(sum(x * y for x, y in zip(vs[i], vs[j])) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
        return g2, b * (sum(sum(x * x for x in v) for v in vs) / n - g2), mean

    g2, tr, mean = estimates(mbs)
    pairs = micro_batch_pairs(
        [sum(x * x for x in m) for m in mbs],
        [sum(x * y for x, y in zip(m, mean)) for m in mbs],
        sum(x * x for x in mean),
        b,
    )
    for k, (pu, pt) in enumerate(pairs):
        g2k, trk, _ = estimates(mbs[:k] + mbs[k + 1 :])
        assert (pu, pt) == pytest.approx((5 * g2 - 4 * g2k, 5 * tr - 4 * trk), rel=1e-9, abs=1e-9)
    with pytest.raises(ValueError, match="at least 3 micro-batches"):
        micro_batch_pairs([1.0, 2.0], [1.0, 1.0], 1.0, 8)
    with pytest.raises(ValueError, match="at least 3 micro-batches"):
        micro_batch_pairs([1.0, 2.0, 3.0], [1.0, 1.0], 1.0, 8)
    with pytest.raises(ValueError, match="b \\(samples per micro-batch\\)"):
        micro_batch_pairs([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], 1.0, 0)


def test_growth_fits_the_noise_scale_trend_and_ahead_carries_the_estimates_along_it():
    gns = GradientNoiseScale(reference_batch=8, decay=0.64)
    rng = np.random.default_rng(0)
    at = [512.0 * (i + 1) for i in range(40)]
    for n in at:  # pairs whose noise scale grows as 0.05 n^0.7 with samples trained, tr(Sigma) read with 10% noise
        phi = 0.05 * n**0.7 * (1 + 0.1 * rng.standard_normal())
        gns.update(1.0 + phi / 4, 4, 1.0 + phi / 64, 64, at=n)
    beta, se = gns.growth()
    assert 0 < se < 0.3 and abs(beta - 0.7) < 3 * se
    since = gns.position(window=8)
    assert since == pytest.approx(sum(at[-8:]) / 8)
    lo, hi = gns.interval(window=8)
    to = at[-1] + 1000.0
    f_lo, f_mid, f_hi, fit = gns.ahead(to, window=8)
    assert fit == (beta, se) and f_mid == pytest.approx((to / since) ** beta)
    assert f_lo == pytest.approx((to / since) ** (beta - se)) and f_hi == pytest.approx((to / since) ** (beta + se))
    assert 1.0 < f_lo < f_mid < f_hi
    truth = 0.05 * to**0.7  # the window's range, carried, brackets the noise scale where the decision applies
    assert lo * f_lo < truth < hi * f_hi
    assert (lo + hi) / 2 < 0.95 * truth  # uncarried, it lags below it
    _, f_ema, _, _ = gns.ahead(to)  # the EMA describes a later position than the window's mean: a smaller carry
    assert 1.0 < f_ema < f_mid
    assert gns.noise_scale * f_ema == pytest.approx(truth, rel=0.1)
    _, f_cap, _, _ = gns.ahead(to * 100, window=8, limit=0.5)  # exponents are clipped to +-limit
    assert f_cap == pytest.approx((to * 100 / since) ** 0.5)


def test_growth_is_unknown_without_positions_or_pairs_and_bad_positions_are_named():
    gns = GradientNoiseScale(reference_batch=8)
    for _ in range(30):
        gns.update(2.0, 4, 1.1, 64)  # no positions
    assert gns.growth() is None and gns.position() is None and gns.ahead(1e5) == (1.0, 1.0, 1.0, None)
    fresh = GradientNoiseScale(reference_batch=8)
    for n in range(1, 9):  # fewer than 3 pairs in each of 3 groups
        fresh.update(2.0 + 0.01 * (n % 2), 4, 1.1, 64, at=100.0 * n)
    assert fresh.growth() is None
    fresh.update(2.0, 4, 1.1, 64, at=900.0)
    beta, se = fresh.growth()
    assert abs(beta) < 3 * se  # a flat noise scale: no growth to speak of
    with pytest.raises(ValueError, match="at must be a number of samples trained >= 0"):
        fresh.update(2.0, 4, 1.1, 64, at=-1.0)
    start = GradientNoiseScale(reference_batch=8)  # pairs taken at the initial weights sit at position 0: a group of
    for n in (0, 0, 0, 1, 2, 3, 4, 5, 6):  # them has no log position and is left out of the fit, not an error
        start.update(2.0 + 0.5 * n, 4, 1.1, 64, at=100.0 * n)
    beta, _ = start.growth()
    mid = GradientNoiseScale(reference_batch=8)
    for n in (1, 2, 3, 4, 5, 6):
        mid.update(2.0 + 0.5 * n, 4, 1.1, 64, at=100.0 * n)
    assert beta == pytest.approx(mid.growth(groups=2)[0])  # the two positive groups alone
    only0 = GradientNoiseScale(reference_batch=8)
    only0.update(2.0, 4, 1.1, 64, at=0.0)
    assert only0.position() == 0.0 and only0.ahead(1e4, fit=(0.5, 0.1))[:3] == (1.0, 1.0, 1.0)


def test_carry_inputs_are_checked():
    from cona.config import BenchConfig

    gns = GradientNoiseScale(reference_batch=8)
    for n in range(1, 13):
        gns.update(2.0, 4, 1.1, 64, at=100.0 * n)
    for call, needle in (
        (lambda: gns.position(window=0), "window must be >= 1"),
        (lambda: gns.interval(window=0), "window must be >= 1"),
        (lambda: gns.growth(groups=1), "groups >= 2"),
        (lambda: gns.ahead(1e4, limit=-1.0), "z and limit must be >= 0"),
    ):
        with pytest.raises(ValueError, match=needle):
            call()
    for kw, needle in (
        ({"growth_pairs": 24.5}, "growth_pairs must be a whole number"),
        ({"range_window": 0}, "range_window must be a whole number"),
        ({"adam_betas": 0.9}, "adam_betas must be two numbers"),
    ):
        with pytest.raises(ValueError, match=needle):
            BenchConfig(**kw)
