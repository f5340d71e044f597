"""Gradient statistics: online unbiased |G|^2 and gradient variance, the gradient noise scale.

Two gradients of one step at batch sizes b < B give, with E|g_b|^2 = |G|^2 + tr(Sigma)/b (McCandlish et al. 2018):

    |G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b)          tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

both unbiased and smoothed by a bias-corrected EMA; the noise scale phi is their ratio. The statistical
efficiency of a global batch M relative to the reference batch M0 depends on how the learning rate follows M
(``batch_efficiency``):

- ``"tuned"`` (Pollux/AdaScale, an LR tuned per batch): ``efficiency(M) = (phi + M0) / (phi + M)``.
- ``"sqrt"`` (Adam with lr0 sqrt(M / M0), the bench's rule): Adam divides the step by sqrt(v), v ~ |G|^2 +
  tr(Sigma)/M, so progress per sample goes as 1 / sqrt(M + phi): ``efficiency(M) = sqrt((phi + M0) / (phi + M))``,
  flat while M << phi (Malladi et al. 2022) and half as steep in log as "tuned" beyond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "unbiased_estimates",
    "batch_efficiency",
    "LR_SCALINGS",
    "efficiency_models",
    "GradientNoiseScale",
    "GnsSnapshot",
    "t_quantile_975",
    "micro_batch_pairs",
]

LR_SCALINGS = ("sqrt", "tuned")


def unbiased_estimates(sq_small: float, b_small: float, sq_big: float, b_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) from squared norms of gradients averaged over b_small and b_big samples."""
    if not 0 < b_small < b_big:
        raise ValueError(f"b_big must exceed b_small > 0 for an estimate, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    s = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


def micro_batch_pairs(
    norms: Sequence[float], dots: Sequence[float], mean_sq: float, b: float
) -> list[tuple[float, float]]:
    """Jackknife pseudo-values of (|G|^2, tr(Sigma)) from K gradients g_k of b samples each at the same weights:
    ``norms`` |g_k|^2, ``dots`` g_k . S and ``mean_sq`` |S|^2, S their mean.

    The mean of g_k . g_l over k != l, (K^2 |S|^2 - sum |g_k|^2) / (K (K - 1)), is unbiased for |G|^2, and
    b (mean |g_k|^2 - |G|^2) for tr(Sigma). The pseudo-values K x - (K - 1) x_-k (micro-batch k left out) average
    to them and spread as independent repeats would, so ``fieller_interval`` over them bounds the noise scale
    from one global batch."""
    k = len(norms)
    if k < 3 or len(dots) != k:
        raise ValueError(f"need norms and dots of at least 3 micro-batches, got {len(norms)} and {len(dots)}")
    if not b > 0:
        raise ValueError(f"b (samples per micro-batch) must be positive, got {b}")

    def est(n: int, s_sq: float, total: float) -> tuple[float, float]:
        g2 = (n * n * s_sq - total) / (n * (n - 1))
        return g2, b * (total / n - g2)

    total = sum(norms)
    g2, tr = est(k, mean_sq, total)
    out = []
    for nk, dk in zip(norms, dots):
        s_sq = (k * k * mean_sq - 2 * k * dk + nk) / (k - 1) ** 2  # |mean of the others|^2
        g2k, trk = est(k - 1, s_sq, total - nk)
        out.append((k * g2 - (k - 1) * g2k, k * tr - (k - 1) * trk))
    return out


def efficiency_models(value, field: str = "lr_scaling") -> tuple[str, ...]:
    """One efficiency-model name or several, as a tuple; ValueError naming ``field`` and the valid names."""
    models = (value,) if isinstance(value, str) else tuple(value)
    if not models or any(m not in LR_SCALINGS for m in models):
        raise ValueError(
            f"{field} must name one or more of {', '.join(LR_SCALINGS)}, got {','.join(map(str, models)) or 'none'}"
        )
    return models


def batch_efficiency(batch: float, noise_scale: float, reference_batch: float, lr_scaling: str = "sqrt") -> float:
    """Per-sample progress of global batch ``batch`` relative to ``reference_batch`` at noise scale
    ``noise_scale`` when the learning rate follows ``lr_scaling`` (see the module docstring)."""
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}, got {lr_scaling!r}")
    ratio = (noise_scale + reference_batch) / (noise_scale + batch)
    return math.sqrt(ratio) if lr_scaling == "sqrt" else ratio


@dataclass(frozen=True)
class GnsSnapshot:
    """What the estimator knows at one step (plain numbers, for logs and JSON)."""

    step: int
    grad_sq: float
    variance: float
    noise_scale: float
    updates: int


# two-sided 95% (0.975) quantiles of Student's t by degrees of freedom (scipy.stats.t.ppf(0.975, df))
_T975 = tuple(
    float(x)
    for x in """12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.160 2.145 2.131
    2.120 2.110 2.101 2.093 2.086 2.080 2.074 2.069 2.064 2.060 2.056 2.052 2.048 2.045 2.042""".split()
)


def fieller_interval(pairs: Sequence[tuple[float, float]], z: float | None = None) -> tuple[float, float]:
    """Fieller's confidence set for mean(s) / mean(g) over (g, s) pairs, within [0, inf): the ratios R with
    (s_bar - R g_bar)^2 <= z^2 Var(s_bar - R g_bar) (``z`` None: the 95% Student-t quantile for the pairs).
    Bounded when g_bar is resolved above zero; otherwise [lower, inf)."""
    n = len(pairs)
    if n < 2:
        return 0.0, math.inf
    if z is None:
        z = t_quantile_975(n - 1)
    g, s, vgg, vss, vsg = _means_and_covariance(pairs)
    q = z * z
    a = g * g - q * vgg  # (s - R g)^2 - q (vss - 2 R vsg + R^2 vgg) <= 0, i.e. a R^2 + b R + c <= 0
    b = -2.0 * (s * g - q * vsg)
    c = s * s - q * vss
    disc = b * b - 4.0 * a * c  # < 0 with a > 0 only by rounding, where the pairs do not vary
    r = math.sqrt(max(disc, 0.0))
    r1, r2 = sorted(((-b - r) / (2 * a), (-b + r) / (2 * a))) if a else (0.0, 0.0)
    if a > 0 and g > 0 and disc >= 0:
        return max(r1, 0.0), max(r2, 0.0)
    if a < 0 and disc > 0 and r1 < 0.0 < r2:  # unbounded: R outside the roots, of which the part >= 0
        return r2, math.inf
    return 0.0, math.inf


def _means_and_covariance(pairs: Sequence[tuple[float, float]]) -> tuple[float, float, float, float, float]:
    """Means of the (|G|^2, tr Sigma) pairs and the variances and covariance of those means (>= 2 pairs)."""
    n = len(pairs)
    g = sum(p[0] for p in pairs) / n
    s = sum(p[1] for p in pairs) / n
    vgg = sum((p[0] - g) ** 2 for p in pairs) / (n - 1) / n
    vss = sum((p[1] - s) ** 2 for p in pairs) / (n - 1) / n
    vsg = sum((p[0] - g) * (p[1] - s) for p in pairs) / (n - 1) / n
    return g, s, vgg, vss, vsg


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (1.96 beyond 30; 12.706 below 1)."""
    return _T975[max(df, 1) - 1] if df <= len(_T975) else 1.96


@dataclass
class GradientNoiseScale:
    """Online estimator of |G|^2, tr(Sigma) and the noise scale phi = tr(Sigma)/|G|^2 of one training run (it
    survives strategy switches). ``decay``: the EMA factor per update; ``reference_batch``: M0, the batch the LR
    was tuned at; ``lr_scaling``: how the LR follows the batch from there (the efficiency model)."""

    reference_batch: int
    decay: float = 0.9
    lr_scaling: str = "sqrt"
    _g2: float = 0.0
    _s: float = 0.0
    _w: float = 0.0  # EMA bias-correction weight
    updates: int = 0
    _last_phi: float = 0.0
    history: list[GnsSnapshot] = field(default_factory=list)
    raw: list[tuple[float, float]] = field(default_factory=list)  # unsmoothed (|G|^2, tr Sigma) per update
    at: list[float | None] = field(default_factory=list)  # where each raw pair was taken (samples trained so far)
    _at: float = 0.0  # EMA of the positions (the position the smoothed estimate describes); None-free runs only
    _at_known: bool = True

    def __post_init__(self) -> None:
        if self.reference_batch <= 0:
            raise ValueError(f"reference_batch must be a positive batch size, got {self.reference_batch}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")

    def update(
        self, sq_small: float, b_small: float, sq_big: float, b_big: float, step: int = -1, at: float | None = None
    ) -> bool:
        """Fold in one pair of squared gradient norms; False (nothing changed) when b_big <= b_small. ``at``: the
        samples trained before the weights the gradients were taken at (``growth`` and ``ahead`` read it)."""
        if b_big <= b_small or not (math.isfinite(sq_small) and math.isfinite(sq_big)):
            return False
        if at is not None and not (math.isfinite(at) and at >= 0):
            raise ValueError(f"at must be a number of samples trained >= 0, got {at}")
        g2, s = unbiased_estimates(sq_small, b_small, sq_big, b_big)
        self.raw.append((g2, s))
        self.at.append(at)
        del self.raw[:-256], self.at[:-256]
        d = self.decay
        self._at_known = self._at_known and at is not None
        self._at = d * self._at + (1 - d) * (at or 0.0)
        self._g2 = d * self._g2 + (1 - d) * g2
        self._s = d * self._s + (1 - d) * s
        self._w = d * self._w + (1 - d)
        self.updates += 1
        self.history.append(GnsSnapshot(step, self.grad_sq, self.variance, self.noise_scale, self.updates))
        return True

    @property
    def ready(self) -> bool:
        return self.updates > 0

    @property
    def grad_sq(self) -> float:
        """Smoothed |G|^2 (bias corrected); 0 before the first update."""
        return self._g2 / self._w if self._w > 0 else 0.0

    @property
    def variance(self) -> float:
        """Smoothed tr(Sigma), the per-sample gradient variance."""
        return self._s / self._w if self._w > 0 else 0.0

    @property
    def noise_scale(self) -> float:
        """phi = tr(Sigma)/|G|^2 in samples; the last well-defined value (0 before one) while |G|^2 <= 0."""
        g2, s = self.grad_sq, max(self.variance, 0.0)
        if g2 <= 0:
            return self._last_phi
        self._last_phi = min(s / g2, 1e9)
        return self._last_phi

    def interval(self, z: float | None = 2.0, window: int | None = None) -> tuple[float, float]:
        """The noise scales the unsmoothed pairs (the last ``window`` of them) support: Fieller's set at ``z``
        standard errors (``fieller_interval``), which counts the error of both estimates and their covariance."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 pair (or None for all), got {window}")
        pairs = self.raw if window is None else self.raw[-window:]
        return fieller_interval(pairs, z)

    def growth(self, pairs: int = 24, groups: int = 3) -> tuple[float, float] | None:
        """The slope of log phi against log samples trained, and its standard error: weighted least squares over
        the pooled noise scale of ``groups`` consecutive groups of the last ``pairs`` pairs, each weighted by the
        inverse variance of its log (delta method). None without 3 pairs per group, positions, two groups that
        resolve both means above zero, or distinct positions."""
        if pairs < 1 or groups < 2:
            raise ValueError(f"growth needs pairs >= 1 and groups >= 2, got pairs={pairs}, groups={groups}")
        raw, last = self.raw[-pairs:], self.at[-pairs:]
        at = [a for a in last if a is not None]
        if len(raw) < 3 * groups or len(at) < len(last):
            return None
        pts = []  # (log position, log phi, weight)
        for i in range(groups):
            lo, hi = i * len(raw) // groups, (i + 1) * len(raw) // groups
            g, s, vgg, vss, vsg = _means_and_covariance(raw[lo:hi])
            if g > 0 and s > 0 and sum(at[lo:hi]) > 0:  # a group at the initial weights alone has no log position
                var = max(vss / (s * s) + vgg / (g * g) - 2 * vsg / (s * g), 1e-6)
                pts.append((math.log(sum(at[lo:hi]) / (hi - lo)), math.log(s / g), 1.0 / var))
        if len(pts) < 2:
            return None
        w = sum(p[2] for p in pts)
        mx, my = sum(x * wi for x, _, wi in pts) / w, sum(y * wi for _, y, wi in pts) / w
        sxx = sum(wi * (x - mx) ** 2 for x, _, wi in pts)
        if sxx < 1e-6 * w:
            return None
        return sum(wi * (x - mx) * (y - my) for x, y, wi in pts) / sxx, 1.0 / math.sqrt(sxx)

    def position(self, window: int | None = None) -> float | None:
        """The samples trained that the EMA (``window`` None) or the last ``window`` pairs describe; None if unknown."""
        if window is None:
            return self._at / self._w if self._w > 0 and self._at_known else None
        if window < 1:
            raise ValueError(f"window must be >= 1 pair (or None for the smoothed estimate), got {window}")
        at = self.at[-window:]
        known = [a for a in at if a is not None]
        return sum(known) / len(known) if known and len(known) == len(at) else None

    def ahead(
        self,
        to: float,
        window: int | None = None,
        pairs: int = 24,
        groups: int = 3,
        z: float = 1.0,
        limit: float = 1.0,
        fit: tuple[float, float] | None = None,
    ) -> tuple[float, float, float, tuple[float, float] | None]:
        """Factors (low, point, high) that carry a noise scale read from the EMA (or the last ``window`` pairs) from
        the position it describes to ``to`` samples trained along the fitted growth (``fit``, else ``growth``) at
        minus, zero and plus ``z`` standard errors, exponents clipped to +-``limit``; and that fit. Factors 1
        where the growth or the position is unknown. The statistics lag where the noise scale grows fast."""
        if not (z >= 0 and limit >= 0):
            raise ValueError(f"z and limit must be >= 0, got z={z}, limit={limit}")
        if fit is None:
            fit = self.growth(pairs, groups)
        since = self.position(window)
        if fit is None or not since or not to > 0:  # unknown, or only the initial weights (no log position)
            return 1.0, 1.0, 1.0, fit
        beta, se = fit
        r = math.log(to / since)
        low, point, high = (math.exp(r * min(max(b, -limit), limit)) for b in (beta - z * se, beta, beta + z * se))
        if r < 0:
            low, high = high, low
        return low, point, high, fit

    def efficiency(self, batch: float, noise_scale: float | None = None) -> float:
        """Per-sample efficiency of a global batch relative to the reference batch under ``lr_scaling``."""
        phi = self.noise_scale if noise_scale is None else noise_scale
        return batch_efficiency(batch, phi, self.reference_batch, self.lr_scaling)

    def gain(self, batch: float, noise_scale: float | None = None) -> float:
        """Progress of one step at ``batch`` in reference-batch steps (AdaScale's gain under "tuned")."""
        return batch / self.reference_batch * self.efficiency(batch, noise_scale)

    def snapshot(self, step: int = -1) -> GnsSnapshot:
        return GnsSnapshot(step, self.grad_sq, self.variance, self.noise_scale, self.updates)
