"""The bench: cona and the baselines a user would run, trained side by side to a target loss in ``launch``ed ranks.

Throughput is probed once (or read from a fresh cached table); then, per seed, every variant starts from the same
initial weights and sample stream: ``static_gb<N>`` (the fastest strategy of every global batch, held: every other
strategy of that batch trains the same samples at the same learning rate, only slower by the probes), whose best in
hindsight is the static choice to beat; ``surrogate_static`` (the gradient-noise model's choice at step 0, held);
``goodput_scaling`` (AdaptDL/Pollux: the data-parallel global batch of best goodput, re-chosen with 5% hysteresis,
no strategy switching); ``cona`` (re-ranks every ``decide_every_s`` and switches, charged its own evaluations and
decisions) and the quick ``oracle``. All advance in turns of ``slice_s`` of training clock, so their step times see
the same load; a static run past the clock another static reached the target at is stopped (it cannot be best).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .chain import Chainer, GoodputScaler
from .config import BenchConfig
from .executor import Executor, FullState, initial_state
from .gns import GradientNoiseScale, fieller_interval, micro_batch_pairs
from .harness import Run, Variant, summary, time_to_target
from .model import TextData, stdlib_tokens, tiny_llama_config
from .oracle import Oracle, oracle_shortlist
from .probe import CostModel, Prober, fastest_first, fastest_per_batch, rank0, rank0_all
from .space import ModelDims, Strategy, enumerate_strategies, rank_memory_budget

__all__ = ["Trainer", "Step0", "bench_worker", "run_seed", "step0_range"]

progress = logging.getLogger("cona.progress")  # the bench's progress lines (rank 0 only)


@dataclass
class Step0:
    """Step 0 at the initial weights on ``strategy``: the jackknife pairs, its ``seconds`` (``warm_s`` of them the
    first warm batch's), and that batch's gradient ``warm`` on executor ``ex`` while it can still train."""

    pairs: list[tuple[float, float]]
    seconds: float
    strategy: Strategy
    warm_s: float = 0.0
    ex: Executor | None = None
    warm: list[torch.Tensor] | None = None


def step0_range(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The noise scales the step-0 pairs support: Fieller's set at the 95% Student-t quantile, not ``range_z``
    (the initial choice is robust over its range and both efficiency models by design)."""
    return fieller_interval(pairs, None)


class Trainer:
    """State shared by the variants of one seed: config, data, candidates, throughput table."""

    def __init__(self, cfg: BenchConfig, seed: int | None = None, cost: CostModel | None = None) -> None:
        self.cfg = cfg
        self.seed = cfg.seed if seed is None else seed
        self.model_cfg = tiny_llama_config(cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.intermediate)
        self.dims = ModelDims.from_config(self.model_cfg, cfg.seq_len)
        want = cfg.corpus_bytes + cfg.held_out_bytes
        tokens = stdlib_tokens(want)
        if len(tokens) < want:
            raise ValueError(
                f"corpus_bytes + held_out_bytes ({want}) exceed the {len(tokens)} bytes of standard library sources "
                f"found: lower corpus_bytes or held_out_bytes"
            )
        self.data = TextData(tokens, cfg.seq_len, self.seed, held_out_tokens=cfg.held_out_bytes)
        self.val = self.data.validation(cfg.val_samples)  # the windows time to target is measured on
        self.held_out = None  # the oracle's, as many as split over every dp degree
        if cfg.oracle:
            held = self.data.held_out(cfg.held_out_samples or min(cfg.val_samples, 128))
            self.held_out = held[: len(held) // cfg.world * cfg.world]
        # cona's own evaluations: evenly spaced measuring windows (its time-left trend compares them with the target)
        self.decision_val = self.val[torch.linspace(0, cfg.val_samples - 1, cfg.decision_val_samples).round().long()]
        self.state0 = initial_state(self.model_cfg, self.seed)
        budget = rank_memory_budget(None, cfg.world)
        gbs, mbs = list(cfg.global_batches), list(cfg.micro_batches)
        self.candidates = enumerate_strategies(self.dims, cfg.world, gbs, mbs, memory_budget_bytes=budget)
        self.cost = cost if cost is not None else CostModel()
        self.prober: Prober | None = None

    def executor(self, s: Strategy, state: FullState) -> Executor:
        c = self.cfg
        return Executor(
            s,
            self.model_cfg,
            state,
            lr=c.lr_for(s.global_batch),
            clip_norm=c.clip_norm,
            betas=c.adam_betas,
            precondition=c.gns_precondition,
        )

    def probe(self) -> dict:
        """Measure the throughput table into ``cost`` (``probe.Prober``); its report."""
        self.prober = Prober(self)
        return self.prober.run()

    def variant(
        self,
        run: Run,
        s: Strategy,
        state: FullState,
        chainer: Chainer | None = None,
        gns: GradientNoiseScale | None = None,
        consumed: int = 0,
        held_out: bool = False,
    ) -> Variant:
        return Variant(self, run, s, state, chainer, gns, consumed, held_out)

    def reshard_seconds(self) -> float:
        """One real in-memory resharding between the two fastest layouts (the chainer's switch-cost prior)."""
        ranked = fastest_first(self.candidates, self.cost.throughput)
        by_layout: dict[tuple[int, int, int], Strategy] = {}
        for c in ranked:
            by_layout.setdefault((c.dp, c.tp, c.pp), c)
        pair = list(by_layout.values())[:2]
        if len(pair) < 2:
            pair = ranked[:2]
        if len(pair) < 2:
            return 0.0
        ex = self.executor(pair[0], self.state0)
        ex.train_step(self.data.samples(0, pair[0].global_batch), gns=False)  # Adam moments exist, as mid-run
        t0 = time.perf_counter()
        self.executor(pair[1], ex.full_state())
        return rank0(time.perf_counter() - t0)

    def gns_at_step0(self) -> Step0:
        """Gradient statistics at the initial weights: preconditioned by the squared gradients of
        ``step0_warm_batches`` batches (Adam's v to be), every micro-batch gradient of ``step0_batches`` batches (at
        least 3 micro-batches) of the strategy with the most micro-batches per global batch up to 8 x the reference
        batch. Keeps the first warm batch's gradient, which ``first_step`` can still train with."""
        cfg = self.cfg
        t0 = time.perf_counter()
        informative = [c for c in self.candidates if c.dp * c.accum > 1] or self.candidates
        capped = [c for c in informative if c.global_batch <= 8 * cfg.reference_batch] or informative
        s = min(capped, key=lambda c: (-c.dp * c.accum, c.global_batch, c.tp, c.pp, -self.cost.throughput(c)[0]))
        ex = self.executor(s, self.state0)
        k, warm, warm_s = 0, None, 0.0
        for _ in range(cfg.step0_warm_batches if cfg.gns_precondition else 0):
            tw = time.perf_counter()
            ex.compute_grads(self.data.samples(k * s.global_batch, s.global_batch), gns=False)
            if k == 0:
                warm, warm_s = ex.grads(), time.perf_counter() - tw
            ex.fold_second_moment()
            k += 1
        count = max(cfg.step0_batches, math.ceil(3 / (s.dp * s.accum)))  # the jackknife needs 3 micro-batches
        batches = [self.data.samples((k + i) * s.global_batch, s.global_batch) for i in range(count)]
        b, norms, dots, mean_sq = ex.micro_batch_stats(batches)
        pairs = micro_batch_pairs(norms, dots, mean_sq, b)
        secs, warm_s = rank0_all(time.perf_counter() - t0, warm_s)
        return Step0(pairs, secs, s, warm_s, ex if warm is not None else None, warm)

    def first_step(self, step0: Step0) -> tuple[FullState, float]:
        """The first training step (up to floating-point order) from step 0's warm gradient, and the seconds the
        step and the hand-over of the state took."""
        if step0.ex is None or step0.warm is None:
            raise ValueError("step 0 kept no gradient to step with (no warm batch, or already spent)")
        t0 = time.perf_counter()
        step0.ex.step_with(step0.warm, lr=self.cfg.lr_for(step0.strategy.global_batch))
        state = step0.ex.full_state()
        step0.ex, step0.warm = None, None
        return state, rank0(time.perf_counter() - t0)


def _pairs(pairs: Sequence[tuple[float, float]]) -> list[list[float]]:
    return [[float(f"{g:.8g}"), float(f"{t:.8g}")] for g, t in pairs]


def _start(tr: Trainer, statics: list[Strategy], reshard_s: float) -> tuple[dict, Chainer, dict]:
    """Step 0 of a seed: the statistics, cona's initial choice and, on step 0's global batch, the warm gradient as
    its first step. Returns what step 0 reports, the chainer, and where cona and surrogate_static start."""
    cfg = tr.cfg
    st0 = tr.gns_at_step0()
    pairs0, gns0_s = st0.pairs, st0.seconds
    lo, hi = step0_range(pairs0)
    g2, tr0 = (sum(x) / len(pairs0) for x in zip(*pairs0))
    # cona's running statistics start fresh: the step-0 pairs (a stand-in preconditioner, the initial weights)
    # only bound the noise scale; from the first optimizer step Adam's own v preconditions them
    gns_run = cfg.noise_scale_estimator()
    chainer = Chainer(
        tr.candidates,
        tr.cost.throughput,
        gns_run,
        margin=cfg.margin,
        switch_cost_s=reshard_s,
        initial_models=cfg.initial_models,
    )
    t_decide = time.perf_counter()
    first = chainer.initial((lo, hi), 0, gns0_s)
    decision0_s = rank0(time.perf_counter() - t_decide)  # charged to both runs that start on its choice
    choice = first.chosen
    # on step 0's global batch its warm gradient is the first step: training time, not statistics
    start = {"first": first, "state": tr.state0, "consumed": 0, "gns_s": gns0_s, "clock": gns0_s, "first_s": None}
    if st0.warm is not None and choice.global_batch == st0.strategy.global_batch:
        state, first_s = tr.first_step(st0)
        start |= {"state": state, "consumed": choice.global_batch, "first_s": first_s}
        start |= {"gns_s": gns0_s - st0.warm_s, "clock": gns0_s + first_s}
    st0.ex = st0.warm = None
    shown_hi = f"{hi:.0f}" if math.isfinite(hi) else "inf"
    msg = "seed %d: step 0 chose %s (noise scale in [%.0f, %s]); training %d variants to perplexity %g"
    progress.info(msg, tr.seed, choice.name, lo, shown_hi, len(statics) + 3 + cfg.oracle, cfg.target_ppl)
    step0 = {
        "noise_scale": min(max(tr0, 0.0) / g2, 1e9) if g2 > 0 else None,  # None: |G|^2 not resolved above zero
        "noise_range": [lo, hi if math.isfinite(hi) else None],
        "gns_s": gns0_s,  # all that step 0 took, its warm batch included
        "pairs": _pairs(pairs0),
        "statics": [s.name for s in statics],
        "surrogate_choice": choice.name,
        "reason": first.reason,
        "switch_cost_prior_s": reshard_s,
        "initial_models": list(cfg.initial_models),
        "step0_strategy": st0.strategy.name,
        "first_step_from_step0": start["first_s"] is not None,
        "warm_s": st0.warm_s,
        "first_step_s": start["first_s"],
        "charged_as_statistics_s": start["gns_s"],  # less the warm batch when it trained as the first step
        "decision_s": decision0_s,
    }
    return step0, chainer, start


def _stop_behind(statics: list[Variant], target_loss: float, window: int) -> None:
    """Stop every static run past the clock another static reached the target at: it cannot be the best static."""
    hits = [(t, v.run.name) for v in statics if (t := time_to_target(v.run.trace, target_loss, window)) is not None]
    if not hits:
        return
    best_t, best = min(hits)
    for v in statics:
        if not v.done and v.run.clock > best_t:
            v.done, v.run.stopped_behind = True, best


def _interleave(tr: Trainer, variants: list[Variant | Oracle], statics: list[Variant]) -> None:
    """Advance every variant in turns of ``slice_s`` of training clock until all are done, rotating who goes
    first, stopping the statics that can no longer be best, and report progress."""
    cfg = tr.cfg
    t, rnd, w0 = cfg.slice_s, 0, time.perf_counter()
    finished: set[str] = set()
    while not all(v.done for v in variants):
        k = rnd % len(variants)
        for v in variants[k:] + variants[:k]:
            v.advance(t)
        _stop_behind(statics, cfg.target_loss, cfg.target_window)
        t += cfg.slice_s
        rnd += 1
        for v in variants:
            if v.done and v.run.name not in finished:
                finished.add(v.run.name)
                ttt = time_to_target(v.run.trace, cfg.target_loss, cfg.target_window)
                how = f"stopped at the {cfg.budget_s:g} s budget above the target"
                if ttt is not None:
                    how = f"reached the target at {ttt:.1f} s of clock"
                elif v.run.stopped_behind:
                    how = f"stopped at {v.run.clock:.1f} s of clock, behind {v.run.stopped_behind}"
                wall = time.perf_counter() - w0
                progress.info("seed %d: %s %s (%.0f s wall so far)", tr.seed, v.run.name, how, wall)
        if rnd % max(round(5 / cfg.slice_s), 1) == 0:  # every 5 s of training clock
            msg = "seed %d: %.1f s of training clock, %d of %d variants done"
            progress.info(msg, tr.seed, t, len(finished), len(variants))


def _goodput_scaling(tr: Trainer, step0: dict, start: dict, reshard_s: float) -> tuple[Run, Variant]:
    """AdaptDL/Pollux-style batch scaling from step 0's point estimate, charged step 0 and its choice; it starts
    from cona's first step when it chose that global batch, else from the initial weights."""
    cfg = tr.cfg
    gns = cfg.noise_scale_estimator()
    cands = GoodputScaler.data_parallel(tr.candidates)
    scaler = GoodputScaler(cands, tr.cost.throughput, gns, margin=cfg.scaler_hysteresis, switch_cost_s=reshard_s)
    t0 = time.perf_counter()
    (phi,) = rank0_all(-1.0 if step0["noise_scale"] is None else step0["noise_scale"])
    first = scaler.start(None if phi < 0 else phi)
    dec_s = rank0(time.perf_counter() - t0)
    state, consumed, clock, gns_s = tr.state0, 0, step0["gns_s"], step0["gns_s"]
    if start["consumed"] and first.chosen.global_batch == start["first"].chosen.global_batch:
        state, consumed, clock, gns_s = start["state"], start["consumed"], start["clock"], start["gns_s"]
    run = Run("goodput_scaling", clock=clock + dec_s, start_s=clock, decision_s=dec_s, gns_s=gns_s)
    run.steps, run.samples = (1, consumed) if consumed else (0, 0)
    run.decisions.append(first.to_dict())
    v = tr.variant(run, first.chosen, state, chainer=scaler, gns=gns, consumed=consumed)
    run.chain[0]["why"] = first.reason
    return run, v


def run_seed(tr: Trainer, reshard_s: float) -> dict:
    """Every variant of one seed, from that seed's initial weights and sample stream."""
    cfg = tr.cfg
    statics = fastest_per_batch(tr.candidates, tr.cost.throughput)
    step0, chainer, start = _start(tr, statics, reshard_s)
    first = start["first"]
    steps = 1 if start["consumed"] else 0

    def started(name: str) -> Run:
        d_s, c = step0["decision_s"], start["clock"]
        return Run(name, clock=c + d_s, start_s=c, decision_s=d_s, gns_s=start["gns_s"], steps=steps, samples=consumed)

    choice, state, consumed = first.chosen, start["state"], start["consumed"]
    runs = {f"static_gb{s.global_batch}": Run(f"static_gb{s.global_batch}") for s in statics}
    static_vs = [tr.variant(runs[f"static_gb{s.global_batch}"], s, tr.state0) for s in statics]
    runs |= {"surrogate_static": started("surrogate_static"), "cona": started("cona")}
    runs["cona"].decisions.append(first.to_dict())
    variants: list[Variant | Oracle] = [
        *static_vs,
        tr.variant(runs["surrogate_static"], choice, state, consumed=consumed),
        tr.variant(runs["cona"], choice, state, chainer=chainer, gns=chainer.gns, consumed=consumed),
    ]
    runs["cona"].chain[0]["why"] = first.reason
    runs["goodput_scaling"], scaling = _goodput_scaling(tr, step0, start, reshard_s)
    variants.append(scaling)
    shortlist = oracle_shortlist(tr.candidates, tr.cost.throughput, cfg.oracle_branches) if cfg.oracle else []
    step0["oracle_branches"] = [s.name for s in shortlist]
    with tempfile.TemporaryDirectory(prefix="cona-oracle-") as d:
        dirs = [d]
        dist.broadcast_object_list(dirs, 0)
        if cfg.oracle:
            oracle = Oracle(tr, shortlist, dirs[0])
            runs["oracle"] = oracle.run
            variants.append(oracle)
        _interleave(tr, variants, static_vs)
    return {"step0": step0, "runs": {k: summary(v, cfg.target_loss, cfg.target_window) for k, v in runs.items()}}


def _progress_to_stderr() -> None:
    if not progress.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("cona: %(message)s"))
        progress.addHandler(h)
        progress.setLevel(logging.INFO)
        progress.propagate = False


def bench_worker(rank: int, world: int, cfg_dict: dict, show_progress: bool = False) -> dict | None:
    """All variants of every seed in one process group, on one throughput table; rank 0 returns the results."""
    torch.manual_seed(0)
    progress.disabled = not (show_progress and rank == 0)
    if not progress.disabled:
        _progress_to_stderr()
    cfg = BenchConfig(**cfg_dict)
    base = Trainer(cfg)
    out: dict = {"candidates": [s.name for s in base.candidates], "probe": base.probe()}
    measured = dict(base.cost.measured)
    table = {s.name: dict(zip(("samples_per_s", "source"), base.cost.throughput(s))) for s in base.candidates}
    out["throughput"] = table
    reshard_s = base.reshard_seconds()
    out["probe"]["reshard_s"] = reshard_s
    out["seeds"] = {}
    for seed in cfg.seed_list:
        tr = base if seed == base.seed else Trainer(cfg, seed)
        tr.cost = CostModel(dict(measured))  # the probed table, the same for every seed
        out["seeds"][seed] = run_seed(tr, reshard_s)
    out["config"] = asdict(cfg)
    return out if rank == 0 else None
