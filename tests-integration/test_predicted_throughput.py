"""Predicted throughput: cona chains strategies with sysprdict's time predictor filling in unprobed ones.

cona probes only the strategies of its probe plan (real training steps through its executor);
sysprdict's precision-aware time predictor, trained on sysprdict's own profile of zoo models (never
on cona's model), predicts the step time of every other candidate from the layer decomposition of
cona's model at that micro-batch, scaled by the median probe/prediction ratio of the probed ones.
The chain's choice is then checked against real probes of every candidate that the decision never saw.
Times are process CPU seconds of one thread (stable on a shared machine, unlike wall time).
"""

import statistics
import time
import warnings

import pytest

import cona
import sysprdict
from cona.dist import launch
from cona.executor import Executor, initial_state
from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config
from cona.probe import probe_plan
from sysprdict.profile import GridPoint, run_point
from sysprdict.timepred import decomposition_for

SEQ = 32
CONFIG = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)


def candidates(config) -> list:
    dims = cona.ModelDims.from_config(config, SEQ)
    return cona.enumerate_strategies(dims, 1, [4, 8, 16], [1, 2, 4, 8], memory_budget_bytes=1 << 30)


def cpu_time_steps(step_fn, steps: int = 9, warmup: int = 2) -> float:
    """Median CPU seconds of ``steps`` calls after ``warmup``: fewer (3 after 1) let one slow call on a
    loaded machine move a strategy's goodput by a quarter."""
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        c0 = time.process_time()
        step_fn()
        times.append(time.process_time() - c0)
    return statistics.median(times)


def probe_all(rank: int, world: int) -> dict:
    """Real probes of every candidate (the decision sees only the probe plan's) and GNS statistics."""
    config = tiny_llama_config(**CONFIG)
    data = TextData(stdlib_tokens(300_000), SEQ)
    state = initial_state(config, 0)
    probes = {}
    for s in candidates(config):
        ex = Executor(s, config, state)
        batch = data.samples(0, s.global_batch)
        probes[s.name] = cpu_time_steps(lambda ex=ex, batch=batch: ex.train_step(batch, gns=False))
    gns_pairs = []
    s = cona.Strategy(1, 1, 1, 2, 16)  # 8 micro-batches: small- and big-batch gradient norms
    ex = Executor(s, config, state)
    for k in range(4):
        r = ex.compute_grads(data.samples(k * 16, 16))
        gns_pairs.append((r.sq_small, r.b_small, r.sq_big, r.b_big))
    return {"probes": probes, "gns": gns_pairs}


def fit_sysprdict_time_predictor() -> sysprdict.TimePredictor:
    rows = [run_point(GridPoint(m, b, seq_len=SEQ), steps=2) for m in ("llama-xs", "llama-s", "qwen2-xs", "gpt2-xs")
            for b in (1, 2, 4, 8)]  # fmt: skip
    ds = [decomposition_for(r) for r in rows]
    return sysprdict.TimePredictor().fit(ds, [r["step_cpu_s"] for r in rows], [r["optimizer"] for r in rows])


def test_cona_chains_with_sysprdict_time_predictions():
    (measured,) = launch(probe_all, 1, timeout_s=300)
    config = tiny_llama_config(**CONFIG)
    cands = candidates(config)
    probed = {s: measured["probes"][s.name] for s in probe_plan(cands)}
    assert 0 < len(probed) < len(cands)

    predictor = fit_sysprdict_time_predictor()
    model = sysprdict.ZooModel("cona-llama", "llama", "s", "text", build_model(config), 0)
    micro = {}
    for mb in sorted({s.micro_batch for s in cands}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cona's model may sit just outside sysprdict's training range
            micro[mb] = float(predictor.predict([sysprdict.decompose(model, sysprdict.Shape(mb, SEQ))])[0])

    def predicted_step_s(s) -> float:
        return s.accum * micro[s.micro_batch]

    scale = statistics.median(t / predicted_step_s(s) for s, t in probed.items())

    def throughput(s):
        if s in probed:
            return s.global_batch / probed[s], "probe"
        return s.global_batch / (scale * predicted_step_s(s)), "model"

    gns = cona.GradientNoiseScale(reference_batch=4)
    for pair in measured["gns"]:
        gns.update(*pair)
    chainer = cona.Chainer(cands, throughput, gns)
    decision = chainer.decide(None)
    sources = {e.source for e in decision.ranking}
    assert sources == {"probe", "model"}

    # check against real probes of every candidate, under the same noise scale
    phi = decision.noise_scale
    real = {
        s: cona.goodput(s.global_batch / measured["probes"][s.name], s.global_batch, phi, gns.reference_batch)
        for s in cands
    }
    best = max(real, key=real.get)
    errors = [abs(scale * predicted_step_s(s) / measured["probes"][s.name] - 1) for s in cands if s not in probed]
    print(
        f"chosen {decision.chosen.name} (real goodput {real[decision.chosen]:.1f}), best by real probes {best.name} "
        f"({real[best]:.1f}); sysprdict median error on unprobed strategies {statistics.median(errors):.2f}"
    )
    # the composition itself (holds whatever the measured times): the chainer ranked every candidate by its probe
    # where probed and by sysprdict's prediction on the probes' scale elsewhere, and took that table's best goodput
    assert {e.strategy for e in decision.ranking} == set(cands)
    for e in decision.ranking:
        step_s = probed[e.strategy] if e.strategy in probed else scale * predicted_step_s(e.strategy)
        assert e.throughput == pytest.approx(e.strategy.global_batch / step_s), e.strategy.name
        assert e.source == ("probe" if e.strategy in probed else "model")
    assert decision.chosen == max(decision.ranking, key=lambda e: e.goodput).strategy
    # quality, from measured times (so with room for the machine's noise): sysprdict's predictions of the
    # unprobed strategies are within 50% of their real probes on the median, and the choice they lead to keeps
    # at least half of the best real goodput (a sound prediction keeps about 0.75-0.9; a broken scale or an
    # inverted ranking lands far below). The tight comparison is a measurement, printed above, not a pass/fail bound.
    assert statistics.median(errors) < 0.5
    assert real[decision.chosen] >= 0.5 * real[best], decision.reason
