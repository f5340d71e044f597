"""One training run of the bench, advanced in slices of training clock and timed to a target loss.

A ``Variant`` trains one strategy (cona's switches it) into its ``Run``. The clock counts training steps, gradient
statistics, resharding and cona's own evaluations and decisions (timed on rank 0 and broadcast, so every rank takes
the same decisions), never the validation trace's evaluations. Time to target: the first evaluation at which the
mean of the last ``target_window`` is at or below the target loss.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from .chain import Chainer, GoodputScaler, remaining_time
from .executor import FullState
from .gns import GradientNoiseScale
from .probe import every_rank, rank0, rank0_all
from .space import Strategy

__all__ = ["Run", "Variant", "StepLimitError", "step_limit_s", "check_step", "smoothed", "time_to_target", "summary"]


class StepLimitError(RuntimeError):
    """A training step ran past its limit (``step_limit_s``); the message names the run, strategy and rank."""


def step_limit_s(probed_step_s: float, factor: float, floor_s: float) -> float:
    """A step's time limit: ``factor`` x its probed (or modelled) step time, never under ``floor_s``."""
    return max(floor_s, factor * probed_step_s)


def check_step(run: str, s: Strategy, step: int, per_rank_s: list[float], probed_s: float, cfg) -> None:
    """Raise ``StepLimitError`` on every rank alike (``per_rank_s`` is gathered) when the slowest rank's step
    ran past ``step_limit_s`` of the probed step time under ``cfg.step_limit_factor`` / ``step_limit_floor_s``."""
    limit = step_limit_s(probed_s, cfg.step_limit_factor, cfg.step_limit_floor_s)
    slow = max(range(len(per_rank_s)), key=per_rank_s.__getitem__)
    if per_rank_s[slow] > limit:
        times = ", ".join(f"rank {r}: {t:.2f} s" for r, t in enumerate(per_rank_s))
        raise StepLimitError(
            f"{run}: step {step} of {s.name} took {per_rank_s[slow]:.2f} s on rank {slow} (slowest; {times}), over "
            f"its limit of {limit:.2f} s (max of {cfg.step_limit_floor_s:g} s and {cfg.step_limit_factor:g} x the "
            f"probed step time {probed_s:.4f} s): the machine is far slower than when it was probed, or a rank is "
            f"stuck; raise --set step_limit_factor=... to allow it"
        )


def smoothed(trace: list[tuple[float, float]], window: int = 1) -> list[tuple[float, float]]:
    """``(clock, mean of the last window losses)`` at every evaluation from the ``window``-th on."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    vals = [v for _, v in trace]
    return [(trace[i][0], sum(vals[i + 1 - window : i + 1]) / window) for i in range(window - 1, len(trace))]


def time_to_target(
    trace: list[tuple[float, float]], target_loss: float, window: int = 1, after: float = -math.inf
) -> float | None:
    """Clock of the first evaluation after ``after`` where the mean of the last ``window`` is at or below the
    target (None if never)."""
    return next((t for t, v in smoothed(trace, window) if v <= target_loss and t > after), None)


@dataclass
class Run:
    """What one variant measured; ``clock = start_s + train_s + decision_eval_s + decision_s + switch_s``."""

    name: str
    trace: list[tuple[float, float]] = field(default_factory=list)
    chain: list[dict] = field(default_factory=list)
    steps: int = 0
    samples: int = 0
    clock: float = 0.0
    start_s: float = 0.0  # step 0's charge (statistics, a first step taken from them), before the first decision
    train_s: float = 0.0  # the training steps' (statistics steps' included)
    switch_s: float = 0.0
    gns_s: float = 0.0
    eval_s: float = 0.0  # evaluations excluded from the clock
    decision_eval_s: float = 0.0  # evaluations cona's decisions read, charged to its clock
    decision_s: float = 0.0  # cona's decisions' own computation, charged too
    decision_trace: list[tuple[float, float]] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    held_out_trace: list[tuple[float, float]] = field(default_factory=list)  # the oracle's picks read these
    stopped_behind: str | None = None  # a static run stopped once past the clock another static reached the target at


def _rounded(trace: list[tuple[float, float]]) -> list[list[float]]:
    return [[round(t, 4), round(v, 5)] for t, v in trace]


def summary(run: Run, target_loss: float, window: int) -> dict:
    """A run's result as the bench reports it."""
    return {
        "time_to_target_s": time_to_target(run.trace, target_loss, window),
        "first_eval_at_target_s": time_to_target(run.trace, target_loss),
        "final_val_loss": run.trace[-1][1],
        "final_val_ppl": math.exp(run.trace[-1][1]),
        "clock_s": run.clock,
        "start_s": run.start_s,
        "train_s": run.train_s,
        "steps": run.steps,
        "samples": run.samples,
        "switch_s": run.switch_s,
        "gns_s": run.gns_s,
        "eval_s_excluded": run.eval_s,
        "decision_eval_s": run.decision_eval_s,
        "decision_eval_frac": run.decision_eval_s / run.clock if run.clock else 0.0,
        "decision_s": run.decision_s,
        "decision_trace": _rounded(run.decision_trace),
        "chain": run.chain,
        "trace": _rounded(run.trace),
        "held_out_trace": _rounded(run.held_out_trace),
        "decisions": run.decisions,
        "stopped_behind": run.stopped_behind,
    }


class Variant:
    """One training run advanced in slices, so variants interleave under the same load; with a ``chainer`` and
    its ``gns`` estimator it is cona, deciding every ``decide_every_s``; ``held_out``: an oracle branch, whose
    evaluations also read the held-out windows."""

    def __init__(
        self,
        tr,
        run: Run,
        s: Strategy,
        state: FullState,
        chainer: Chainer | None,
        gns: GradientNoiseScale | None,
        consumed: int,
        held_out: bool = False,
    ) -> None:
        if chainer is not None and gns is None:
            raise ValueError("gns: a variant with a chainer (cona) needs its noise-scale estimator, got None")
        self.tr, self.run, self.s, self.chainer, self.gns, self.consumed = tr, run, s, chainer, gns, consumed
        self.held_out, cfg = held_out, tr.cfg
        self.ex = tr.executor(s, state)
        run.chain.append({"clock": run.clock, "samples": run.samples, "strategy": s.name, "why": "start"})
        self.next_decide = run.clock + cfg.decide_every_s
        # the untrained model's loss is a transient, not a point of the trend ``remaining_time`` fits: not read
        self.next_charged = run.clock + cfg.decision_eval_every_s
        if not run.trace:
            self._evaluate(readable=False)
        self.next_eval = run.clock + cfg.eval_every_s
        self.plain_times: list[float] = []  # recent step times of s without gradient statistics
        self.k = 0  # steps since this strategy started
        self.grown = False  # the noise scale's growth has been fitted at a decision
        self.done = False

    def advance(self, until_s: float, stop_at_target: bool = True) -> None:
        """Train until the clock reaches ``until_s`` or (``stop_at_target``) the target (``time_to_target``)."""
        run, cfg = self.run, self.tr.cfg
        until_s = min(until_s, cfg.budget_s)
        while not self.done and run.clock < until_s:
            self._step()
            if run.clock >= self.next_eval:
                self._evaluate()
                self.next_eval = run.clock + cfg.eval_every_s
                w = cfg.target_window
                if stop_at_target and time_to_target(run.trace[-w:], cfg.target_loss, w) is not None:
                    self.done = True
            if self.chainer is not None and run.clock >= self.next_decide and not self.done:
                self._decide()
        if run.clock >= cfg.budget_s:
            self.done = True

    def _step(self) -> None:
        """One step on the next batch of the stream; every ``gns_every``-th (4x as many when it must split its only
        micro-batch) also yields a gradient-statistics pair, taken at the weights before the step."""
        tr, run, cfg, s, gns = self.tr, self.run, self.tr.cfg, self.s, self.gns
        batch = tr.data.samples(self.consumed, s.global_batch)
        self.consumed += s.global_batch
        split = s.dp * s.accum == 1
        self.k += 1
        want_gns = gns is not None and self.k % (cfg.gns_every * (4 if split else 1)) == 0
        t0 = time.perf_counter()
        r = self.ex.train_step(batch, lr=cfg.lr_for(s.global_batch), gns=want_gns)
        per_rank = every_rank(time.perf_counter() - t0, r.gns_s)
        dt, gns_dt = per_rank[0]  # rank 0's times drive every rank's clock and decisions alike
        check_step(run.name, s, run.steps + 1, [p[0] for p in per_rank], tr.cost.step_time(s)[0], cfg)
        if want_gns and split and self.plain_times:
            gns_dt += dt - statistics.median(self.plain_times)  # the split's extra time (unbiased, may be < 0)
        elif not (want_gns and split):
            self.plain_times.append(dt - gns_dt)
            del self.plain_times[:-15]
        run.clock += dt
        run.train_s += dt
        run.gns_s += gns_dt
        run.steps += 1
        run.samples += s.global_batch
        if want_gns:
            assert gns is not None  # want_gns only with an estimator
            gns.update(r.sq_small, r.b_small, r.sq_big, r.b_big, step=run.steps, at=run.samples - s.global_batch)

    def _evaluate(self, readable: bool = True) -> float:
        """One validation evaluation, excluded from the clock; every ``decision_eval_every_s`` cona also evaluates
        its own ``decision_val_samples`` windows, which its decisions read, charged to its clock."""
        run = self.run
        t, te = run.clock, time.perf_counter()
        v = self.ex.evaluate(self.tr.val)
        run.trace.append((t, v))
        if self.held_out:
            run.held_out_trace.append((t, self.ex.evaluate(self.tr.held_out)))
        run.eval_s += time.perf_counter() - te
        reads = self.chainer is not None and not isinstance(self.chainer, GoodputScaler)  # cona's trend
        if reads and readable and t >= self.next_charged:
            te = time.perf_counter()
            dv = self.ex.evaluate(self.tr.decision_val)
            dt = rank0(time.perf_counter() - te)
            run.clock += dt
            run.decision_eval_s += dt
            run.decision_trace.append((t, dv))
            self.next_charged = t + self.tr.cfg.decision_eval_every_s
        return v

    def _running_models(self, fit: tuple[float, float] | None) -> tuple[str, ...] | None:
        """Until the noise scale's growth is first fitted (a latch), a switch must pay under every initial model as
        well as the estimator's own, as step 0's choice does; then the estimator's alone (None)."""
        self.grown = self.grown or fit is not None
        if not self.grown:
            assert self.gns is not None  # only cona decides, and it has an estimator (__init__)
            return tuple(dict.fromkeys((self.gns.lr_scaling, *self.tr.cfg.initial_models)))
        return None

    def _decision_inputs(self, online: float | None) -> tuple[float, float, float, float, dict]:
        """(time left, noise range low and high, point noise scale, what was read) for a running decision, rank 0's:
        the range of the last ``range_window`` pairs and the point estimate, carried along the fitted growth to the
        middle of the next decision interval; the time left from cona's charged evaluations."""
        run, s, cfg, gns = self.run, self.s, self.tr.cfg, self.gns
        assert gns is not None  # only cona decides, and it has an estimator (__init__)
        left = max(cfg.budget_s - run.clock, 0.0)
        rem = remaining_time(run.decision_trace, cfg.target_loss, cfg.trend_window_s, left)
        lo, hi = gns.interval(z=cfg.range_z, window=cfg.range_window)
        phi = gns.noise_scale
        fit = gns.growth(cfg.growth_pairs)
        rate = online if online is not None else self.tr.cost.throughput(s)[0]
        to = run.samples + rate * cfg.decide_every_s / 2
        f_lo, _, f_hi, _ = gns.ahead(to, window=cfg.range_window, pairs=cfg.growth_pairs, z=cfg.range_z, fit=fit)
        _, f_point, _, _ = gns.ahead(to, pairs=cfg.growth_pairs, fit=fit)  # the same fit, the EMA's position
        rem, lo, hi, f_lo, f_hi, f_point = rank0_all(rem, lo, hi if math.isfinite(hi) else 1e9, f_lo, f_hi, f_point)
        read = {
            "noise_range_read": [lo, hi],
            "noise_scale_read": phi,
            "noise_growth": fit and list(fit),
            "carried_to_samples": to,
            "carry": [f_lo, f_point, f_hi],
            "fit": fit,
        }
        return rem, lo * f_lo, min(hi * f_hi, 1e9), min(phi * f_point, 1e9), read

    def _decide(self) -> None:
        run, s, cfg, chainer, gns = self.run, self.s, self.tr.cfg, self.chainer, self.gns
        assert chainer is not None and gns is not None  # advance decides only with a chainer, which has gns
        t_decide = time.perf_counter()
        self.next_decide = run.clock + cfg.decide_every_s
        online = s.global_batch / statistics.median(self.plain_times) if self.plain_times else None
        extra: dict = {}
        if isinstance(chainer, GoodputScaler):  # its own point estimate, rank 0's, nothing else read
            (phi,) = rank0_all(min(gns.noise_scale, 1e9) if gns.ready else 0.0)
            d = chainer.decide(s, run.steps, run.clock, noise_scale=phi)
        else:
            rem, lo, hi, phi, extra = self._decision_inputs(online)
            models = self._running_models(extra.pop("fit"))
            d = chainer.decide(
                s, run.steps, run.clock, noise_range=(lo, hi), remaining_s=rem, noise_scale=phi, models=models
            )
            pairs = [[float(f"{g:.8g}"), float(f"{t:.8g}")] for g, t in gns.raw[-cfg.range_window :]]
            extra |= {"remaining_s": rem, "noise_range": [lo, hi], "pairs": pairs}  # the pairs it read, for replays
        run.decisions.append(d.to_dict() | {"online_samples_per_s": online} | extra)
        dt = rank0(time.perf_counter() - t_decide)
        run.clock += dt
        run.decision_s += dt
        if d.switched:
            self._switch(d.chosen, d.reason)

    def _switch(self, new: Strategy, why: str) -> None:
        """Move to ``new``: in place when it keeps the dp x tp x pp layout (no state moves), else by resharding."""
        tr, run = self.tr, self.run
        t0 = time.perf_counter()
        same = self.ex.same_layout(new)
        self.ex = self.ex.retarget(new) if same else tr.executor(new, self.ex.full_state())
        sw = rank0(time.perf_counter() - t0)
        assert self.chainer is not None  # only cona's decisions switch
        self.chainer.observe_switch(sw, same_layout=same)
        self.s, self.plain_times, self.k = new, [], 0
        run.clock += sw
        run.switch_s += sw
        link = {"clock": run.clock, "samples": run.samples, "strategy": new.name, "why": why}
        run.chain.append(link | {"switch": "same layout" if same else "resharded", "switch_s": sw})
