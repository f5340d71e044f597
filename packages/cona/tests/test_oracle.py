"""The oracle branches every distinct global batch from one checkpoint and keeps the right branch; cona's
decisions read only the evaluations it is charged for."""

import math

import pytest
from conftest import expected_models, state_digest

from cona.config import BenchConfig
from cona.dist import launch
from cona.harness import smoothed, time_to_target
from cona.model import tiny_llama_config
from cona.oracle import oracle_shortlist
from cona.space import ModelDims, enumerate_strategies


def _worker(rank, world):
    from cona import bench, harness, oracle

    cfg = BenchConfig(
        world=1,
        global_batches=(8, 16, 32),
        micro_batches=(8,),
        budget_s=2.6,
        oracle_phase_s=1.0,
        target_ppl=1.5,
        val_samples=16,
        probe_cache=False,
        probe_steps=1,
        seeds=1,
        corpus_bytes=200_000,
    )
    tr = bench.Trainer(cfg)
    tr.probe()
    starts, ends, reads = [], [], []
    plain = tr.variant

    def variant(run, s, state, chainer=None, gns=None, consumed=0, held_out=False):
        if run.name not in ("surrogate_static", "cona", "goodput_scaling") and not run.name.startswith("static_"):
            assert held_out  # its evaluations read the held-out windows too
            starts.append({"clock": run.clock, "strategy": s.name, "consumed": consumed, "state": state_digest(state)})
        return plain(run, s, state, chainer, gns, consumed, held_out)

    tr.variant = variant
    end_phase = oracle.Oracle._end_phase

    def end(self):
        ends.append(
            [
                {
                    "strategy": s.name,
                    "consumed": v.consumed,
                    "state": state_digest(v.ex.full_state()),
                    "trace": list(b.trace),
                    "held": list(b.held_out_trace),
                    "samples": b.samples,
                    "train_s": b.train_s,
                }
                for s, b, v, _ in self.branches
            ]
        )
        end_phase(self)

    oracle.Oracle._end_phase = end
    rt = harness.remaining_time

    def remaining(trace, *a):
        reads.append([tuple(p) for p in trace])
        return rt(trace, *a)

    harness.remaining_time = remaining
    shortlist = [s.name for s in oracle_shortlist(tr.candidates, tr.cost.throughput, cfg.oracle_branches)]
    res = bench.run_seed(tr, 0.01)
    return {
        "starts": starts,
        "ends": ends,
        "reads": reads,
        "res": res,
        "shortlist": shortlist,
        "target": cfg.target_loss,
        "window": cfg.target_window,
    }


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def out():
    return launch(_worker, 1, timeout_s=400)[0]


def test_oracle_shortlist_is_every_distinct_global_batch_at_its_fastest_strategy():
    cfg = BenchConfig()
    dims = ModelDims.from_config(tiny_llama_config(2, 32, 4, 2, 96), 32)
    cands = enumerate_strategies(dims, 2, list(cfg.global_batches), list(cfg.micro_batches))
    tput = {s: s.global_batch * (3.0 if s.dp == 2 else 1.0) + s.micro_batch for s in cands}
    short = oracle_shortlist(cands, lambda s: (tput[s], "probe"), cfg.oracle_branches)
    assert [s.global_batch for s in short] == [8, 16, 32, 64, 128, 256]  # gb128 included (4 branches left it out)
    for s in short:
        assert tput[s] == max(t for c, t in tput.items() if c.global_batch == s.global_batch)
    assert [s.global_batch for s in oracle_shortlist(cands, lambda s: (tput[s], "probe"), 4)] == [8, 32, 64, 256]


def test_held_out_split_is_text_after_the_corpus_and_leaves_train_and_validation_as_they_were():
    import torch

    from cona.bench import Trainer
    from cona.model import TextData, stdlib_tokens

    tokens = stdlib_tokens(260_000)
    plain, data = TextData(tokens[:200_000], 32, 3), TextData(tokens, 32, 3, held_out_tokens=60_000)
    assert torch.equal(plain.validation(16), data.validation(16))  # same train/val split, same windows
    assert torch.equal(plain.samples(0, 8), data.samples(0, 8))  # same sample stream
    held = data.held_out(10).numpy()
    assert held.shape == (10, 32)
    starts = [int(200_000 + k * (60_000 - 32) / 9) for k in range(10)]  # evenly spaced over the last 60 000
    assert [bytes(r.astype("uint8")) for r in held] == [tokens[a : a + 32].tobytes() for a in starts]
    with pytest.raises(ValueError, match="no held-out split"):
        plain.held_out(4)
    for bad in (64, 260_000):
        with pytest.raises(ValueError, match="held_out_tokens must be above 2 x seq_len"):
            TextData(tokens, 32, 0, held_out_tokens=bad)
    for bad in (0, 64):
        with pytest.raises(ValueError, match="held_out_bytes must be above 2 x seq_len"):
            BenchConfig(held_out_bytes=bad)
    with pytest.raises(ValueError, match="corpus_bytes \\+ held_out_bytes"):
        Trainer(BenchConfig(world=2, val_samples=16, corpus_bytes=200_000, held_out_bytes=90_000_000))


def test_pick_held_out_compares_at_the_first_hit_on_the_measuring_windows():
    from cona.oracle import pick_held_out

    target = 2.0
    # measuring windows: b reaches the target first (at 2.0) by a lucky dip; c never does in the phase
    a = [(1.0, 2.3), (2.0, 2.1), (3.0, 1.99)]
    b = [(1.0, 2.3), (2.0, 1.98), (3.0, 2.05)]
    c = [(1.0, 2.3), (2.0, 2.2), (3.0, 2.1)]
    # held-out windows (lower level): at clock 2.0 a is furthest along, b behind; later evaluations do not count
    ha = [(1.0, 2.2), (2.0, 1.90), (3.0, 1.5)]
    hb = [(1.0, 2.2), (2.0, 1.95), (3.0, 1.4)]
    hc = [(1.0, 2.2), (2.0, 1.93), (3.0, 1.3)]
    assert pick_held_out([a, b, c], [ha, hb, hc], target) == (0, 2.0)
    # with a window of 2 no measuring mean reaches the target (b's dip is averaged away): compared at the end
    assert pick_held_out([a, b, c], [ha, hb, hc], target, window=2) == (2, math.inf)  # 1.7, 1.675, 1.615
    # no hit in the phase: compared at the last evaluation, the lowest held-out mean wins
    assert pick_held_out([c, c, c], [ha, hb, hc], target) == (2, math.inf)
    assert pick_held_out([c, c], [ha, ha], target) == (0, math.inf)  # ties: the earlier branch
    # the shared context (the kept traces' last evaluations, at or before the phase start 1.0) never counts: a
    # branch that has not evaluated yet when the first hits is compared at its own first evaluation
    ctx = [(0.5, 1.9), (1.0, 1.9)]
    first = ctx + [(1.1, 1.98)]  # hits the target at 1.1 and stops
    late = ctx + [(1.15, 2.1), (1.25, 2.05)]
    h_first, h_late = ctx + [(1.1, 1.85)], ctx + [(1.15, 1.80), (1.25, 1.7)]
    assert pick_held_out([first, late], [h_first, h_late], target, window=2, after=1.0) == (1, 1.15)


def test_time_to_target_reads_the_mean_of_the_last_evaluations():
    trace = [(0.1, 2.2), (0.2, 1.9), (0.3, 2.1), (0.4, 1.95), (0.5, 1.9), (0.6, 1.8)]
    assert time_to_target(trace, 2.0) == 0.2  # one evaluation's dip
    assert [t for t, _ in smoothed(trace, 2)] == [0.2, 0.3, 0.4, 0.5, 0.6]
    assert [v for _, v in smoothed(trace, 2)] == pytest.approx([2.05, 2.0, 2.025, 1.925, 1.85])
    assert time_to_target(trace, 2.01, window=2) == 0.3
    assert time_to_target(trace, 2.0, window=3) == 0.4  # (1.9 + 2.1 + 1.95) / 3 = 1.983
    assert time_to_target(trace, 1.9, window=3) == 0.6  # (1.95 + 1.9 + 1.8) / 3 = 1.883
    assert time_to_target(trace, 2.01, window=2, after=0.3) == 0.5
    assert time_to_target(trace, 1.0, window=3) is None
    with pytest.raises(ValueError, match="window must be >= 1"):
        smoothed(trace, 0)
    with pytest.raises(ValueError, match="target_window must be >= 1"):
        BenchConfig(target_window=0)


def test_time_to_target_does_not_count_the_context_a_phase_starts_with():
    """Every branch's trace starts with the kept trace's last evaluations (the window's context); a context
    already at the target (its mean 1.925) must not count as a hit of the new phase: only ``after`` excludes it."""
    target = 2.0
    context = [(0.5, 1.9), (1.0, 1.95)]
    no_hit, hit = context + [(2.0, 2.1), (3.0, 1.99)], context + [(2.0, 1.98), (3.0, 2.2)]
    assert time_to_target(no_hit, target, 2) == 1.0 and time_to_target(no_hit, target, 2, after=1.0) is None
    assert time_to_target(hit, target, 2, after=1.0) == 2.0  # (1.95 + 1.98) / 2


@pytest.mark.slow
def test_oracle_branches_every_global_batch_from_one_checkpoint_and_keeps_the_best(out):
    assert sorted(out["shortlist"]) == sorted(out["res"]["step0"]["oracle_branches"])
    assert len({n.rsplit("gb", 1)[1] for n in out["shortlist"]}) == len(out["shortlist"]) == 3
    phases: dict[float, list[dict]] = {}
    for s in out["starts"]:
        phases.setdefault(s["clock"], []).append(s)
    assert len(phases) == len(out["ends"]) >= 2
    chain = out["res"]["runs"]["oracle"]["chain"]
    trace = [tuple(p) for p in out["res"]["runs"]["oracle"]["trace"]]
    held = [tuple(p) for p in out["res"]["runs"]["oracle"]["held_out_trace"]]
    assert [t for t, _ in held] == [t for t, _ in trace] and held != trace  # other windows, the same clocks
    assert all(a[0] < b[0] for a, b in zip(trace, trace[1:]))  # nothing appended twice
    w, kept_new = out["window"], []
    prev = None
    for (clock, branches), ended, link in zip(sorted(phases.items()), out["ends"], chain):
        assert sorted(b["strategy"] for b in branches) == sorted(out["shortlist"])  # every candidate batch
        assert len({b["state"] for b in branches}) == 1 and len({b["consumed"] for b in branches}) == 1
        if prev is not None:  # the phase starts from the kept branch's state and sample position
            assert branches[0]["state"] == pytest.approx(prev["state"], rel=0, abs=0)
            assert branches[0]["consumed"] == prev["consumed"]
        # each branch starts with the kept traces' last w evaluations at the phase start, then only later ones.
        # The result's clocks are rounded to 4 decimals, the phase start is raw: an evaluation at the phase start
        # itself could round above it, so compare at the result's precision (the next evaluation is >= a step later)
        at = round(clock, 4)
        context = [p for p in trace if p[0] <= at][-w:]
        held_context = [p for p in held if p[0] <= at][-w:]
        for b in ended:
            assert [(round(t, 4), round(v, 5)) for t, v in b["trace"][: len(context)]] == context
            assert [(round(t, 4), round(v, 5)) for t, v in b["held"][: len(held_context)]] == held_context
            assert all(t > clock for t, _ in b["trace"][len(context) :])
            assert [t for t, _ in b["held"]] == [t for t, _ in b["trace"]]  # both read at every evaluation
        # the target (perplexity 1.5) is out of reach: compared at the phase end, the kept branch has the lowest
        # mean of its last losses on the held-out windows
        assert link["compared_at"] is None
        # (only the phase's own evaluations: a branch with fewer than w of them is not compared on the context)
        lowest = min(ended, key=lambda b: _mean([v for t, v in b["held"] if t > clock][-w:]))
        kept_new += [(round(t, 4), round(v, 5)) for t, v in lowest["trace"][len(context) :]]
        assert link["strategy"] == lowest["strategy"] and link["clock"] == clock
        assert link["samples"] == branches[0]["consumed"]  # where a replay switches (the samples before the phase)
        assert [o["strategy"] for o in link["branches"]] == [b["strategy"] for b in ended]
        # each branch's phase: the samples it trained (from the phase's sample position) and its training time
        assert [(o["samples"], o["train_s"]) for o in link["branches"]] == [(b["samples"], b["train_s"]) for b in ended]
        assert all(b["samples"] == b["consumed"] - branches[0]["consumed"] > 0 and b["train_s"] > 0 for b in ended)
        assert all(o["time_to_target_s"] is None for o in link["branches"])
        prev = lowest
    assert trace[1:] == kept_new  # the oracle's trace: its first evaluation, then each kept branch's new ones
    assert out["res"]["runs"]["oracle"]["eval_s_excluded"] > 0


@pytest.mark.slow
def test_cona_decisions_read_only_charged_evaluations_spaced_apart(out):
    cona, every = out["res"]["runs"]["cona"], BenchConfig().decision_eval_every_s
    charged = [tuple(p) for p in cona["decision_trace"]]
    assert out["reads"], "cona made no remaining-time decision"
    for read in out["reads"]:
        assert all(b[0] - a[0] >= every for a, b in zip(read, read[1:]))
        assert [(round(t, 4), round(v, 5)) for t, v in read] == charged[: len(read)]
        assert {round(t, 4) for t, _ in read} <= {t for t, _ in cona["trace"]}  # read when the harness evaluated
    # the harness's 0.1 s evaluations are not read: at most one charged per interval of clock, fewer than evaluated
    assert 1 <= len(charged) <= math.floor(cona["clock_s"] / every) + 1 and len(charged) < len(cona["trace"])
    assert cona["decision_eval_s"] > 0 and cona["decision_eval_frac"] == pytest.approx(
        cona["decision_eval_s"] / cona["clock_s"]
    )
    # the decisions' own computation is charged too: cona's every decision, surrogate_static's step-0 choice (its only
    # one, cona's first), nothing to the others (every running decision took some time)
    runs, step0 = out["res"]["runs"], out["res"]["step0"]
    assert runs["surrogate_static"]["decision_s"] == step0["decision_s"] > 0
    assert cona["decision_s"] > step0["decision_s"] and runs["oracle"]["decision_s"] == 0
    assert all(r["decision_s"] == 0 for name, r in runs.items() if name.startswith("static_"))
    assert runs["goodput_scaling"]["decision_s"] > 0 and runs["goodput_scaling"]["decision_eval_s"] == 0
    # and each run's clock is exactly what it charged: step 0, steps, cona's evaluations and decisions, switches
    for name, r in runs.items():
        parts = (r["start_s"], r["train_s"], r["decision_eval_s"], r["decision_s"], r["switch_s"])
        assert r["clock_s"] == pytest.approx(sum(parts), rel=1e-9), name
        stepped_from_step0 = name in ("cona", "surrogate_static", "goodput_scaling")  # charged step 0
        assert r["train_s"] > 0 and (r["start_s"] > 0) == stepped_from_step0, name
    for d in cona["decisions"][1:]:
        assert "remaining_s" in d and math.isfinite(d["remaining_s"])


def test_cona_reads_its_own_quarter_of_the_validation_windows():
    import torch

    from cona.bench import Trainer

    assert BenchConfig().decision_val_samples == 32 and BenchConfig(world=4, val_samples=20).decision_val_samples == 4
    assert BenchConfig(val_samples=128).decision_val_samples == 32  # a quarter, at most 32: more measuring windows
    assert BenchConfig(val_samples=2048).decision_val_samples == 32  # do not raise what cona pays for its own
    for bad in (0, 600, 3):
        with pytest.raises(ValueError, match="decision_val_samples must be in 1..val_samples"):
            BenchConfig(world=2, decision_val_samples=bad)
    with pytest.raises(ValueError, match="held_out_samples must be >= 2 x world"):
        BenchConfig(world=4, held_out_samples=6)
    with pytest.raises(ValueError, match="val_samples must be >= 2 x world"):
        BenchConfig(world=4, val_samples=4, decision_val_samples=4)
    tr = Trainer(BenchConfig(world=2, val_samples=16, corpus_bytes=200_000))
    val, held, sub = tr.val, tr.held_out, tr.decision_val
    assert torch.equal(held, tr.data.held_out(16))  # the oracle's: 16 windows of the text after the corpus
    assert not any(bool((val[i] == r).all()) for r in held for i in range(len(val)))  # not a measuring window
    assert sub.shape == (4, val.shape[1])
    rows = [next(i for i in range(len(val)) if bool((val[i] == r).all())) for r in sub]
    assert rows == [0, 5, 10, 15]  # evenly spaced over the measuring windows, first and last included
    big = Trainer(BenchConfig(world=2, val_samples=64, held_out_samples=8, corpus_bytes=200_000))
    assert big.val.shape[0] == 64 and torch.equal(big.held_out, big.data.held_out(8))  # the oracle's count is its own
    assert Trainer(BenchConfig(world=2, val_samples=256, corpus_bytes=200_000)).held_out.shape[0] == 128
    few = Trainer(BenchConfig(world=4, val_samples=16, held_out_samples=10, corpus_bytes=200_000))
    assert torch.equal(few.held_out, few.data.held_out(10)[:8])  # cut to a multiple of world


@pytest.mark.slow
def test_cona_decides_on_the_noise_scale_carried_to_the_next_interval(out):
    """Every running decision logs what the statistics read, the growth fitted and the factors it carried the
    range and the point estimate by; the range and the point it decided on are the read ones times those."""
    decisions = out["res"]["runs"]["cona"]["decisions"][1:]
    assert decisions and all("carry" in d for d in decisions)
    for d, models in zip(decisions, expected_models(decisions), strict=True):
        f_lo, f_point, f_hi = d["carry"]
        (lo, hi), (lo_read, hi_read) = d["noise_range"], d["noise_range_read"]
        assert lo == pytest.approx(lo_read * f_lo) and hi == pytest.approx(min(hi_read * f_hi, 1e9))
        assert d["noise_scale"] == pytest.approx(d["noise_scale_read"] * f_point)
        if d["noise_growth"] is None:  # no growth fitted here: carried by nothing; held to both models until the
            assert f_lo == f_point == f_hi == 1.0  # first fit, to sqrt after it (a later fit may fail on noise)
            assert d["efficiency_model"] == models
        else:
            beta, se = d["noise_growth"]
            assert se > 0 and f_lo <= f_hi and (f_point > 1) == (beta > 0)
            assert d["efficiency_model"] == models == "sqrt"
        assert d["carried_to_samples"] > 0
    # on one rank even the first decision may have a growth fit, so which branches run is the run's;
    # test_chain holds decide(models=...) to both models deterministically


def _stamp_worker(rank, world):
    """A cona-like run on a stand-in executor (no model): which samples each statistics pair was stamped with."""
    import time
    from types import SimpleNamespace

    import torch

    from cona import harness
    from cona.executor import StepResult
    from cona.gns import GradientNoiseScale
    from cona.probe import CostModel
    from cona.space import Strategy

    starts = []  # the first sample of every batch a statistics step trained on

    class Ex:
        def train_step(self, batch, lr, gns):
            time.sleep(0.002)
            if gns:
                starts.append(int(batch[0, 0]))
            return StepResult(loss=3.0, sq_small=2.0, b_small=8, sq_big=1.1, b_big=32, compute_s=0.0, gns_s=0.0)

        def evaluate(self, windows):
            return 3.0

    cfg = BenchConfig(world=1, gns_every=2, eval_every_s=1.0, budget_s=5.0)
    data = SimpleNamespace(samples=lambda start, count: torch.full((count, 1), start))
    s = Strategy(1, 1, 1, 8, 32)
    cost = CostModel({s: 0.002})  # the probed step time each step's limit follows
    tr = SimpleNamespace(cfg=cfg, data=data, val=None, executor=lambda s, state: Ex(), cost=cost)
    run, gns = harness.Run("cona"), GradientNoiseScale(reference_batch=8)
    v = harness.Variant(tr, run, s, None, None, gns, consumed=96)
    run.samples = 96  # the samples step 0 trained on
    v.advance(0.08)
    return {"at": list(gns.at), "starts": starts}


def test_statistics_pairs_are_stamped_with_the_samples_trained_before_their_step():
    """A pair's gradients are taken at the weights before its step: its position (``at``, what the growth fit and the
    carry read) is the samples trained before that step, not after it."""
    r = launch(_stamp_worker, 1, timeout_s=120)[0]
    assert len(r["starts"]) >= 3 and r["at"] == r["starts"]
    assert r["starts"][0] == 96 + 32  # every 2nd step: the second batch after step 0's 96 samples


def test_early_models_latch_at_the_first_growth_fit():
    """Running decisions hold under every initial model until the growth has first been fitted, then under the
    estimator's own model, and a later failed fit does not reopen it."""
    from types import SimpleNamespace

    from cona.gns import GradientNoiseScale
    from cona.harness import Variant

    v = SimpleNamespace(grown=False, tr=SimpleNamespace(cfg=BenchConfig()), gns=GradientNoiseScale(reference_batch=8))
    seq = [Variant._running_models(v, fit) for fit in (None, None, (0.6, 0.1), None, (0.5, 0.2))]
    assert seq == [("sqrt", "tuned"), ("sqrt", "tuned"), None, None, None]


def test_a_static_run_past_the_best_static_time_to_target_is_stopped():
    """Statics are interleaved: once one reaches the target at clock T, a static past T that has not cannot be the
    best static in hindsight, and stops; one still before T goes on."""
    from types import SimpleNamespace

    from cona.bench import _stop_behind
    from cona.harness import Run

    def static(name, trace, clock, done=False):
        return SimpleNamespace(run=Run(name, trace=trace, clock=clock), done=done)

    fast = static("static_gb64", [(0.0, 5.0), (4.0, 1.9)], 4.0, done=True)
    behind = static("static_gb16", [(0.0, 5.0), (4.5, 2.5)], 4.5)
    before = static("static_gb256", [(0.0, 5.0), (3.5, 3.0)], 3.5)
    _stop_behind([behind, before], 2.0, 1)  # nobody at the target yet: nothing stops
    assert not behind.done and not before.done
    _stop_behind([fast, behind, before], 2.0, 1)
    assert behind.done and behind.run.stopped_behind == "static_gb64"
    assert not before.done and before.run.stopped_behind is None
