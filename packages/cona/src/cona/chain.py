"""Surrogate and chaining, the paper's core: rank strategies by expected loss decrease per second.

The surrogate of a strategy is its goodput: measured (or cost-model) throughput in samples/s times the
statistical efficiency of its global batch under the current gradient noise scale and the learning-rate rule
training uses (``gns.batch_efficiency``: square-root scaling for Adam by default, Pollux's "tuned" model on
request), i.e. the reference-batch-equivalent samples it processes per second; the expected validation-loss
decrease per second is proportional to it.

The initial choice (``Chainer.initial``) takes, for a noise scale known only to lie in a range, the strategy whose
goodput stays closest to the best anywhere in the range and under every efficiency model named
(``robust_choice``): before any step nothing shows which learning-rate regime training is in. A running decision
(``Chainer.decide``) switches only to a rival that wins over the time left to the target ``T`` (estimated from the
loss trend, ``remaining_time``), its switch cost ``c`` paid, wherever in the noise-scale range the truth lies:

    switch  iff  min over phi in range of  goodput_new(phi) (T - c) / (goodput_cur(phi) T)  > 1 + margin

(``switch_gain``): the predicted rate gain times the time left exceeds the measured switch cost, with an
allowance for the ranking's uncertainty. The statistics behind the range describe where training was when their
pairs were taken, while the noise scale keeps growing; the bench carries the range to the middle of the coming
decision interval along its fitted growth (``GradientNoiseScale.ahead``) before deciding.

Every decision (switch or stay) is logged with the ranking and the reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .gns import GradientNoiseScale, batch_efficiency, efficiency_models
from .space import Strategy

__all__ = ["Estimate", "Decision", "Chainer", "goodput", "robust_choice", "switch_gain", "noise_grid", "remaining_time"]

log = logging.getLogger(__name__)


def goodput(
    throughput_samples_per_s: float, batch: int, noise_scale: float, reference_batch: int, lr_scaling: str = "sqrt"
) -> float:
    """Reference-batch-equivalent samples per second (Pollux goodput) under the learning-rate rule
    ``lr_scaling`` ("sqrt": Adam at lr0 sqrt(M/M0); "tuned": Pollux's per-batch tuned LR)."""
    return throughput_samples_per_s * batch_efficiency(batch, noise_scale, reference_batch, lr_scaling)


@dataclass(frozen=True)
class Estimate:
    strategy: Strategy
    throughput: float  # samples/s
    efficiency: float
    goodput: float
    source: str  # "probe" or "model"

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy.name,
            "throughput": self.throughput,
            "efficiency": self.efficiency,
            "goodput": self.goodput,
            "source": self.source,
        }


@dataclass(frozen=True)
class Decision:
    step: int
    elapsed_s: float
    current: Strategy | None
    chosen: Strategy
    switched: bool
    reason: str
    noise_scale: float
    switch_cost_s: float
    ranking: tuple[Estimate, ...]
    efficiency_model: str = "sqrt"  # the learning-rate rule(s) the choice assumes ("sqrt+tuned": robust over both)

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "elapsed_s": self.elapsed_s,
            "current": self.current.name if self.current else None,
            "chosen": self.chosen.name,
            "switched": self.switched,
            "reason": self.reason,
            "noise_scale": self.noise_scale,
            "switch_cost_s": self.switch_cost_s,
            "efficiency_model": self.efficiency_model,
            "ranking": [e.to_dict() for e in self.ranking[:5]],
        }


ThroughputFn = Callable[[Strategy], tuple[float, str]]


def _layout(s: Strategy) -> tuple[int, int, int]:
    return s.dp, s.tp, s.pp


def noise_grid(lo: float, hi: float, points: int = 25) -> list[float]:
    """Noise scales spread geometrically over [lo, hi] (0 included when lo is 0; inf capped at 1e9)."""
    lo = max(lo, 0.0)
    top = hi if math.isfinite(hi) else 1e9
    bottom = max(lo, 1e-3)
    grid = [bottom] if top <= bottom else [bottom * (top / bottom) ** (i / (points - 1)) for i in range(points)]
    return [0.0, *grid] if lo == 0.0 else grid


def switch_gain(
    new_tput: float,
    new_batch: int,
    cur_tput: float,
    cur_batch: int,
    noise_scales: Sequence[float],
    horizon_s: float,
    switch_cost_s: float,
    reference_batch: int,
    lr_scaling: str = "sqrt",
) -> float:
    """Worst case over ``noise_scales`` of the progress a switch makes over ``horizon_s`` (paying
    ``switch_cost_s`` first) relative to staying, minus 1: > 0 means switching wins wherever the noise scale
    lies in the range; -1 when the switch cost eats the whole horizon."""
    keep = horizon_s - switch_cost_s
    if keep <= 0:  # the switch would not finish paying for itself before the target
        return -1.0
    worst = math.inf
    for phi in noise_scales:
        new = new_tput * batch_efficiency(new_batch, phi, reference_batch, lr_scaling) * keep
        cur = cur_tput * batch_efficiency(cur_batch, phi, reference_batch, lr_scaling) * horizon_s
        worst = min(worst, new / cur if cur > 0 else math.inf)
    return worst - 1.0


def remaining_time(trace: Sequence[tuple[float, float]], target_loss: float, window_s: float, cap_s: float) -> float:
    """Training time left until the loss reaches ``target_loss``, from the ``(clock, loss)`` points of the last
    ``window_s``: the loss is taken to fall linearly in log(clock) (a decelerating trend) at the slope fitted over
    the window, from its current level (mean of the last 3 points). 0 when the level is at the target, ``cap_s``
    when the loss does not fall or there are fewer than 3 points. A trend fit, not a forecast: it under-estimates
    the time left early in training and over-estimates it late."""
    if not trace:
        return cap_s
    t_last = trace[-1][0]
    pts = [(math.log(t), v) for t, v in trace if t >= t_last - window_s and t > 0 and math.isfinite(v)]
    if len(pts) < 3:
        return cap_s
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(v for _, v in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var <= 0:
        return cap_s
    slope = sum((x - mx) * (v - my) for x, v in pts) / var  # loss per unit of log(clock)
    now = sum(v for _, v in pts[-3:]) / 3
    if now <= target_loss:
        return 0.0
    if slope >= 0:
        return cap_s
    ln_target = sum(x for x, _ in pts[-3:]) / 3 + (target_loss - now) / slope  # log of the clock at the target
    if ln_target > math.log(t_last + cap_s):
        return cap_s
    return max(math.exp(ln_target) - t_last, 0.0)


def robust_choice(
    tputs: Mapping[Strategy, float],
    lo: float,
    hi: float,
    reference_batch: int,
    points: int = 25,
    lr_scaling: str | Sequence[str] = "sqrt",
    tie: float = 0.0,
) -> tuple[Strategy, float]:
    """The strategy whose goodput stays closest to the best one over every noise scale in [lo, hi] and every
    efficiency model in ``lr_scaling`` (one name or several), and that worst ratio (max over strategies of the
    min over the range and the models of goodput / best goodput).

    A point estimate from a near-zero |G|^2 can be off by orders of magnitude either way, while the worst-case
    ratio tells how much progress a choice can lose wherever in the range the truth lies. ``tie``: strategies
    whose worst ratio is within this fraction of the best one's are level (the throughput table is no more exact
    than that); of those the largest global batch is taken, then the fastest: the noise scale grows from the
    initial weights on, so over the time the choice holds a larger batch only gains on one it tied with."""
    if not (isinstance(tie, (int, float)) and 0.0 <= tie < 1.0):
        raise ValueError(f"tie must be a fraction in [0, 1), got {tie}")
    worst = worst_ratios(tputs, lo, hi, reference_batch, points, lr_scaling)
    pick = take_level(worst, tputs, tie)
    return pick, worst[pick]


def worst_ratios(
    tputs: Mapping[Strategy, float],
    lo: float,
    hi: float,
    reference_batch: int,
    points: int = 25,
    lr_scaling: str | Sequence[str] = "sqrt",
) -> dict[Strategy, float]:
    """Each strategy's lowest goodput / best goodput over the noise scales in [lo, hi] and the models named."""
    models = efficiency_models(lr_scaling)
    grid = noise_grid(lo, hi, points)
    table = {
        (m, phi): {s: goodput(t, s.global_batch, phi, reference_batch, m) for s, t in tputs.items()}
        for m in models
        for phi in grid
    }
    peak = {k: max(row.values()) for k, row in table.items()}
    return {s: min(table[k][s] / peak[k] for k in table) for s in tputs}


def take_level(worst: Mapping[Strategy, float], tputs: Mapping[Strategy, float], tie: float) -> Strategy:
    """Of the strategies whose worst ratio is within ``tie`` of the best one's, the largest global batch, then
    the fastest (``robust_choice``)."""
    top = max(worst.values())
    level = [s for s in worst if worst[s] >= top * (1.0 - tie)]
    return max(level, key=lambda s: (s.global_batch, tputs[s], worst[s], s.name))


@dataclass
class Chainer:
    """Online strategy chaining over a fixed candidate set.

    ``throughput(strategy) -> (samples/s, source)`` comes from probes or a fitted cost model.
    ``switch_cost_s`` is the prior for a switch that reshards (another dp x tp x pp layout) and
    ``same_layout_cost_s`` for one that keeps the layout (only micro-batch and global batch change: no state
    moves, ``Executor.retarget``); measured ones are fed back via ``observe_switch`` and replace the prior of
    their kind (``expected_switch_cost_s``). ``horizon_s`` is the time a switch must pay off over when no
    estimate of the time left is given; ``margin`` is the hysteresis (0.05: the newcomer must be 5% better), and
    for the initial choice the tolerance within which two strategies are level. ``initial_models``: the
    efficiency models the initial choice under a noise-scale range must hold under (None: only the estimator's
    ``lr_scaling``). Running decisions use the estimator's model unless ``decide(models=...)`` names others.
    """

    candidates: Sequence[Strategy]
    throughput: ThroughputFn | Mapping[Strategy, float]
    gns: GradientNoiseScale
    horizon_s: float = 10.0
    margin: float = 0.05
    switch_cost_s: float = 0.5
    same_layout_cost_s: float = 0.0
    initial_models: tuple[str, ...] | None = None
    decisions: list[Decision] = field(default_factory=list)
    _switch_costs: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})  # by same layout

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("candidates must list at least one strategy")
        if self.horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {self.horizon_s}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        for name in ("switch_cost_s", "same_layout_cost_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {getattr(self, name)}")
        if self.initial_models is not None:
            self.initial_models = efficiency_models(self.initial_models, "initial_models")

    def _table(self, s: Strategy) -> tuple[float, str]:
        if isinstance(self.throughput, Mapping):
            return float(self.throughput[s]), "probe"
        return self.throughput(s)

    def expected_switch_cost_s(self, current: Strategy | None = None, new: Strategy | None = None) -> float:
        """Expected seconds of a switch from ``current`` to ``new``: the mean of the measured switches of its kind
        (same dp x tp x pp layout or not) so far, else that kind's prior. Without both strategies: a resharding."""
        same = current is not None and new is not None and _layout(current) == _layout(new)
        seen = self._switch_costs[same]
        return sum(seen) / len(seen) if seen else (self.same_layout_cost_s if same else self.switch_cost_s)

    def observe_switch(self, seconds: float, same_layout: bool = False) -> None:
        """A measured switch: ``same_layout`` when it kept the dp x tp x pp layout (no state moved)."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a measured switch time >= 0, got {seconds!r}")
        self._switch_costs[bool(same_layout)].append(float(seconds))

    def rank(self, noise_scale: float | None = None) -> list[Estimate]:
        """Candidates by goodput, best first (ties: higher throughput, then name)."""
        phi = self.gns.noise_scale if noise_scale is None else noise_scale
        out = []
        for s in self.candidates:
            tput, src = self._table(s)
            eff = self.gns.efficiency(s.global_batch, phi)
            out.append(Estimate(s, tput, eff, tput * eff, src))
        return sorted(out, key=lambda e: (-e.goodput, -e.throughput, e.strategy.name))

    def initial(
        self, noise_range: tuple[float, float] | None = None, step: int = 0, elapsed_s: float = 0.0
    ) -> Decision:
        """The strategy to start with. With ``noise_range`` (the noise scale only known to lie in it, as after step
        0): the one whose goodput stays closest to the best anywhere in the range under every one of
        ``initial_models`` (``robust_choice``; level within ``margin``, the larger batch). Without: the best
        goodput at the estimator's noise scale."""
        phi = self.gns.noise_scale
        ranking = tuple(self.rank(phi))
        if noise_range is None:
            best = ranking[0]
            reason = (
                f"initial choice: best goodput {best.goodput:.1f} (throughput {best.throughput:.1f}/s x "
                f"efficiency {best.efficiency:.3f}, noise scale {phi:.1f})"
            )
            return self._record(
                Decision(step, elapsed_s, None, best.strategy, True, reason, phi, 0.0, ranking, self.gns.lr_scaling)
            )
        lo, hi = noise_range
        tputs = {e.strategy: e.throughput for e in ranking}
        models = self.initial_models or (self.gns.lr_scaling,)
        ratios = worst_ratios(tputs, lo, hi, self.gns.reference_batch, lr_scaling=models)  # once, read twice
        pick, alone = take_level(ratios, tputs, self.margin), take_level(ratios, tputs, 0.0)
        under = f" under the {' and '.join(models)} efficiency models" if len(models) > 1 else ""
        level = (
            f" (level with {alone.name}'s {ratios[alone]:.3f} within the {self.margin:g} margin: the larger "
            f"global batch, as the noise scale grows from here)"
            if alone != pick
            else ""
        )
        reason = (
            f"initial choice under an uncertain noise scale in [{lo:.1f}, {hi:.1f}]: {pick.name} keeps "
            f">= {ratios[pick]:.3f} of the best goodput anywhere in that range{under}{level}"
        )
        return self._record(Decision(step, elapsed_s, None, pick, True, reason, phi, 0.0, ranking, "+".join(models)))

    def decide(
        self,
        current: Strategy | None,
        step: int = 0,
        elapsed_s: float = 0.0,
        noise_range: tuple[float, float] | None = None,
        remaining_s: float | None = None,
        noise_scale: float | None = None,
        models: Sequence[str] | str | None = None,
    ) -> Decision:
        """The running decision: switch from ``current`` only to a strategy whose progress over ``remaining_s``
        (the estimated training time left; ``horizon_s`` when not given), its switch cost paid, beats staying by
        more than ``margin`` at every noise scale in ``noise_range`` (the point estimate alone when not given) and
        under every efficiency model in ``models`` (the estimator's own when None): ``switch_gain``.
        ``noise_scale``: the point estimate to rank by, in place of the estimator's (e.g. carried to where the
        decision applies, ``GradientNoiseScale.ahead``). ``current`` None: the initial choice (``initial``)."""
        if current is None:
            return self.initial(noise_range, step, elapsed_s)
        models = (self.gns.lr_scaling,) if models is None else efficiency_models(models, "models")
        phi = self.gns.noise_scale if noise_scale is None else noise_scale
        ranking = tuple(self.rank(phi))
        cur = next((e for e in ranking if e.strategy == current), None)
        if cur is None:
            raise ValueError(f"current strategy {current.name} is not among the candidates")
        if self.gns.ready:
            d = self._running(cur, ranking, step, elapsed_s, phi, remaining_s, noise_range, models)
        else:
            cost = self.expected_switch_cost_s(current, ranking[0].strategy)
            reason = f"stay: no gradient statistics yet for {current.name}"
            d = Decision(step, elapsed_s, current, current, False, reason, phi, cost, ranking)
        return self._record(replace(d, efficiency_model="+".join(models)))

    def _record(self, d: Decision) -> Decision:
        self.decisions.append(d)
        log.info("step %d: %s", d.step, d.reason)
        return d

    def _running(
        self,
        cur: Estimate,
        ranking: tuple[Estimate, ...],
        step: int,
        elapsed_s: float,
        phi: float,
        remaining_s: float | None,
        noise_range: tuple[float, float] | None,
        models: tuple[str, ...],
    ) -> Decision:
        """``decide`` once the estimator has statistics: each rival's worst-case gain over the noise-scale range
        and the models (``switch_gain``, at its own kind of switch cost), the most robust one against ``margin``."""
        current = cur.strategy
        lo, hi = noise_range if noise_range is not None else (phi, phi)
        grid = noise_grid(min(lo, phi), max(hi, phi), points=9)
        h = self.horizon_s if remaining_s is None else max(remaining_s, 0.0)

        def gain(e: Estimate) -> float:
            cost = self.expected_switch_cost_s(current, e.strategy)
            return min(
                switch_gain(
                    e.throughput,
                    e.strategy.global_batch,
                    cur.throughput,
                    current.global_batch,
                    grid,
                    h,
                    cost,
                    self.gns.reference_batch,
                    m,
                )
                for m in models
            )

        gains = sorted(
            ((gain(e), e) for e in ranking if e.strategy != current),
            key=lambda ge: (-ge[0], -ge[1].goodput, ge[1].strategy.name),
        )
        # the cost logged is that of a switch to the most robust rival (same layout: no state moves)
        cost = self.expected_switch_cost_s(current, gains[0][1].strategy) if gains else 0.0
        left = f"{h:.2f}s to target estimated" if remaining_s is not None else f"a {h:.2f}s horizon"
        where = f"noise scale {phi:.1f} in [{min(lo, phi):.1f}, {max(hi, phi):.1f}], {left}, switch {cost:.2f}s"
        if models != (self.gns.lr_scaling,):
            where += f", under the {' and '.join(models)} efficiency models"
        if gains and gains[0][0] > self.margin:
            g, e = gains[0]
            reason = (
                f"switch: {e.strategy.name} (goodput {e.goodput:.1f} vs {cur.goodput:.1f}) gains >= {g:+.4f} "
                f"of {current.name}'s progress over the remaining time at every noise scale in the range "
                f"(margin {self.margin:g}; {where})"
            )
            return Decision(step, elapsed_s, current, e.strategy, True, reason, phi, cost, ranking)
        best = ranking[0]
        if best.strategy == current:
            reason = f"stay: {current.name} is still best (goodput {cur.goodput:.1f}; {where})"
        else:
            g, e = gains[0]
            reason = (
                f"stay: best {best.strategy.name} goodput {best.goodput:.1f} vs {current.name} {cur.goodput:.1f}, "
                f"but the most robust rival {e.strategy.name} gains only {g:+.4f} of the remaining progress "
                f"at the worst noise scale in the range (margin {self.margin:g}; {where})"
            )
        return Decision(step, elapsed_s, current, current, False, reason, phi, cost, ranking)
