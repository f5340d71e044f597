"""The quick oracle sequence the bench measures cona against, and the rule that picks its branches.

Every phase, the fastest strategy of every global batch is branched from one checkpoint and trained
``oracle_phase_s`` of clock; the branch lowest on held-out text (never trained or measured on) when the first
branch reaches the target, else at the phase end, is kept. Picking on the measuring windows would select the
branch whose measurement happened to be lucky and report that luck as the oracle's time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch.distributed as dist

from .executor import load_state, save_state
from .harness import Run, Variant, smoothed, time_to_target
from .probe import fastest_per_batch, rank0
from .space import Strategy

__all__ = ["Oracle", "oracle_shortlist", "pick_held_out", "branch_outcome"]

Trace = list[tuple[float, float]]


def oracle_shortlist(
    candidates: list[Strategy], throughput: Callable[[Strategy], tuple[float, str]], branches: int | None = None
) -> list[Strategy]:
    """The fastest strategy of every global batch, or of ``branches`` global batches spread evenly over them."""
    fastest = fastest_per_batch(candidates, throughput)
    if branches is None or branches >= len(fastest):
        return fastest
    picks = sorted({round(i * (len(fastest) - 1) / max(branches - 1, 1)) for i in range(branches)})
    return [fastest[i] for i in picks]


def _mean_at(trace: Trace, at: float, window: int, after: float = -math.inf) -> float | None:
    """Mean of the last ``window`` losses of ``trace`` in (``after``, ``at``] (None without any)."""
    seen = [p for p in trace if after < p[0] <= at]
    return smoothed(seen, min(window, len(seen)))[-1][1] if seen else None


def branch_outcome(
    trace: Trace, target_loss: float, window: int = 1, after: float = -math.inf
) -> tuple[float | None, float]:
    """(time to target, mean of the last ``window`` losses) of one branch's trace."""
    last = _mean_at(trace, math.inf, window)
    return time_to_target(trace, target_loss, window, after), math.inf if last is None else last


def pick_held_out(
    traces: list[Trace], held: list[Trace], target_loss: float, window: int = 1, after: float = -math.inf
) -> tuple[int, float]:
    """(index of the branch to keep, the clock compared at): the lowest mean of the last ``window`` held-out
    losses after ``after`` (the phase start) at the clock the first branch reached the target on the measuring
    windows (``traces``), or later where a branch has no held-out evaluation of its own yet; at the last
    evaluation when none reached it (ties: the earlier branch). The measuring windows say when, never which."""
    hits = [branch_outcome(t, target_loss, window, after)[0] for t in traces]
    at = min((h for h in hits if h is not None), default=math.inf)
    if math.isfinite(at):
        firsts = [next((p[0] for p in h if p[0] > after), None) for h in held]
        at = max([at] + [f for f in firsts if f is not None])

    def key(i: int) -> tuple[float, int]:
        m = _mean_at(held[i], at, window, after)
        return (m if m is not None else math.inf, i)

    return min(range(len(held)), key=key), at


class Oracle:
    """The quick oracle sequence as a sliced variant: ``advance`` moves every branch of the phase to the same
    clock. Each branch's traces start with the kept ones' last ``target_window`` evaluations as context."""

    def __init__(self, tr, shortlist: list[Strategy], ckpt_dir: str) -> None:
        self.tr, self.shortlist = tr, shortlist
        self.run = Run("oracle")
        self.state, self.consumed = tr.state0, 0
        self.prev: Strategy | None = None  # the strategy the last phase kept
        ex = tr.executor(shortlist[0], self.state)
        self.run.trace.append((0.0, ex.evaluate(tr.val)))
        self.run.held_out_trace.append((0.0, ex.evaluate(tr.held_out)))
        self.path = os.path.join(ckpt_dir, "phase.safetensors")
        self.branches: list[tuple[Strategy, Run, Variant, float]] = []
        self.phase_start = self.phase_end = 0.0
        self.ctx = 0  # evaluations of the kept trace each branch's trace starts with
        self.done = False

    def advance(self, until_s: float) -> None:
        """Train the phase's branches to ``until_s`` (phases end and start on the way)."""
        while not self.done:
            if not self.branches:
                self._start_phase()
            for _, _, v, _ in self.branches:
                v.advance(min(until_s, self.phase_end))
            if all(v.done or v.run.clock >= self.phase_end for _, _, v, _ in self.branches):
                self._end_phase()
            else:
                return

    def _start_phase(self) -> None:
        tr, run = self.tr, self.run
        if dist.get_rank() == 0:
            save_state(self.path, self.state)
        dist.barrier()
        self.phase_start, self.phase_end = run.clock, run.clock + tr.cfg.oracle_phase_s
        self.ctx = len(run.trace[-tr.cfg.target_window :])
        self.branches = []
        for s in self.shortlist:
            ctx, held_ctx = run.trace[-self.ctx :], run.held_out_trace[-self.ctx :]
            branch = Run(s.name, clock=run.clock, trace=ctx, held_out_trace=held_ctx)
            t0 = time.perf_counter()  # a branch that changes strategy pays the checkpoint read and the executor
            v = tr.variant(branch, s, load_state(self.path), consumed=self.consumed, held_out=True)
            build_s = rank0(time.perf_counter() - t0) if self.prev is not None and s != self.prev else 0.0
            branch.clock += build_s
            v.next_eval += build_s
            self.branches.append((s, branch, v, build_s))

    def _end_phase(self) -> None:
        cfg, run = self.tr.cfg, self.run
        start, ctx, w = self.phase_start, self.ctx, cfg.target_window
        traces = [b.trace for _, b, _, _ in self.branches]
        held = [b.held_out_trace for _, b, _, _ in self.branches]
        i, compared_at = pick_held_out(traces, held, cfg.target_loss, w, after=start)
        s, branch, v, build_s = self.branches[i]
        run.eval_s += sum(b.eval_s for _, b, _, _ in self.branches)  # every branch's evaluations, all excluded
        self.state, self.consumed = v.ex.full_state(), v.consumed
        run.trace += branch.trace[ctx:]
        run.held_out_trace += branch.held_out_trace[ctx:]
        run.clock = branch.clock
        run.train_s += branch.train_s
        run.steps += branch.steps
        start_samples = run.samples
        run.samples += branch.samples
        run.switch_s += build_s
        outcomes = []
        for (_, b, _, _), t, h in zip(self.branches, traces, held):
            hit, last = branch_outcome(t, cfg.target_loss, w, start)
            held_mean = _mean_at(h, compared_at, w, start)
            outcome = {"strategy": b.name, "time_to_target_s": hit, "last_mean_val_loss": last}
            outcomes.append(
                outcome | {"held_out_mean_at_compare": held_mean, "samples": b.samples, "train_s": b.train_s}
            )
        why = (
            f"lowest held-out validation loss (mean of the last {w} evaluations) when the first branch reached the "
            f"target, else at the phase end, of {len(self.shortlist)} branches"
        )
        at = compared_at if math.isfinite(compared_at) else None
        link = {"clock": start, "samples": start_samples, "strategy": s.name, "branches": outcomes}
        run.chain.append(link | {"compared_at": at, "why": why})
        self.prev = s
        self.branches = []
        if outcomes[i]["time_to_target_s"] is not None or run.clock >= cfg.budget_s:
            self.done = True
