"""Step 0's warm gradient becomes the run's first step: the state it hands over is the one a training step on the
same batch takes, on every layout of that global batch."""

import pytest
import torch
from conftest import state_digest

from cona.config import BenchConfig
from cona.dist import launch
from cona.probe import CostModel

# the small bench both workers run: no oracle, no probe cache, a short corpus
SMALL = dict(micro_batches=(8, 32), val_samples=16, oracle=False, probe_cache=False, seeds=1, corpus_bytes=200_000)


def _trainer(cfg: BenchConfig):
    """A Trainer whose cost model is a table, so nothing is probed."""
    from cona import bench

    tr = bench.Trainer(cfg)
    tr.cost = CostModel({c: 0.001 * c.global_batch for c in tr.candidates})
    return tr


def _worker(rank, world):
    from cona import bench

    cfg = BenchConfig(world=world, global_batches=(32, 64), **SMALL)
    tr = _trainer(cfg)
    st0 = tr.gns_at_step0()
    out = {"strategy": st0.strategy.name, "warm_s": st0.warm_s, "seconds": st0.seconds, "pairs": len(st0.pairs)}
    try:
        st0.ex.step_with(st0.warm[:-1])
    except ValueError as e:
        out["bad_grads"] = str(e)
    state, out["first_s"] = tr.first_step(st0)
    out["state_step"] = state.step
    try:
        tr.first_step(st0)  # its gradient is spent
    except ValueError as e:
        out["spent"] = str(e)
    # clipping is active on that first step (global norm 1.0), so the comparison below covers it
    out["clip_coef"] = tr.executor(st0.strategy, tr.state0).compute_grads(tr.data.samples(0, 64), gns=False).clip_coef
    out["diff"] = {}
    for s in tr.candidates:
        if s.global_batch != st0.strategy.global_batch:
            continue
        ex = tr.executor(s, tr.state0)
        ex.train_step(tr.data.samples(0, s.global_batch), lr=cfg.lr_for(s.global_batch), gns=False)
        ref = ex.full_state()
        out["diff"][s.name] = {
            kind: max(float((state.tensors[kind][n] - ref.tensors[kind][n]).abs().max()) for n in ref.tensors[kind])
            for kind in ref.tensors
        }
        out["scale"] = {kind: max(float(t.abs().max()) for t in ref.tensors[kind].values()) for kind in ref.tensors}
    # and without a warm batch: no gradient is kept
    off = bench.Trainer(BenchConfig(**{**cfg.__dict__, "step0_warm_batches": 0}))
    off.cost = tr.cost
    st_off = off.gns_at_step0()
    out["off"] = (st_off.warm is None, st_off.ex is None, len(st_off.pairs) == len(st0.pairs))
    return out if rank == 0 else None


def _seed_worker(rank, world, trains):
    """One short seed of the bench (no oracle) on global batch 64 alone: where each variant starts."""
    from cona import bench

    cfg = BenchConfig(
        world=world,
        global_batches=(64,),
        budget_s=0.4,
        target_ppl=1.5,
        step0_warm_batches=1 if trains else 0,
        **SMALL,
    )
    tr = _trainer(cfg)
    starts, handed = {}, []
    plain, first = tr.variant, tr.first_step

    def variant(run, s, state, chainer=None, gns=None, consumed=0, held_out=False):
        starts[run.name] = {
            "consumed": consumed,
            "state": state_digest(state),
            "clock": run.clock,
            "gns_s": run.gns_s,
            "steps": run.steps,
            "samples": run.samples,
        }
        return plain(run, s, state, chainer, gns, consumed, held_out)

    def first_step(step0):
        state, secs = first(step0)
        handed.append(state_digest(state))
        return state, secs

    tr.variant, tr.first_step = variant, first_step
    res = bench.run_seed(tr, 0.01)
    return {"starts": starts, "step0": res["step0"], "handed": handed, "state0": state_digest(tr.state0)}


@pytest.fixture(scope="module")
def out():
    torch.manual_seed(0)
    return launch(_worker, 2)[0]


@pytest.mark.parametrize("trains", [True, False])
def test_cona_and_surrogate_static_start_from_the_first_step_only_when_it_trained(trains):
    o = launch(_seed_worker, 2, trains)[0]
    st, starts = o["step0"], o["starts"]
    assert st["first_step_from_step0"] is trains and st["surrogate_choice"].endswith("gb64")
    statics = [k for k in starts if k.startswith("static_")]
    assert statics and all(starts[k] == starts[statics[0]] for k in statics)
    assert starts[statics[0]] == {
        "consumed": 0,
        "state": o["state0"],
        "clock": 0.0,
        "gns_s": 0.0,
        "steps": 0,
        "samples": 0,
    }
    for name in ("cona", "surrogate_static"):
        v = starts[name]
        if trains:  # one step on the first 64 samples taken: they read on from sample 64, its time is training's
            assert o["handed"] == [v["state"]] and v["state"] != o["state0"]
            assert (v["consumed"], v["samples"], v["steps"]) == (64, 64, 1)
            assert v["clock"] == pytest.approx(st["gns_s"] + st["first_step_s"] + st["decision_s"])
            assert v["gns_s"] == pytest.approx(st["gns_s"] - st["warm_s"]) and st["warm_s"] > 0
            assert st["charged_as_statistics_s"] == pytest.approx(v["gns_s"])
        else:  # step 0 all statistics, training from the initial state and the first sample
            assert o["handed"] == [] and v["state"] == o["state0"]
            assert (v["consumed"], v["samples"], v["steps"]) == (0, 0, 0)
            assert v["gns_s"] == pytest.approx(st["gns_s"]) and st["decision_s"] > 0
            assert v["clock"] == pytest.approx(st["gns_s"] + st["decision_s"])  # and the choice's own computation
            assert st["charged_as_statistics_s"] == pytest.approx(st["gns_s"])


def test_step0_gradient_trains_as_the_first_step_on_every_layout_of_its_global_batch(out):
    assert out["strategy"].endswith("gb64") and out["pairs"] == 8  # dp2, 4 micro-batches of 8 per replica
    assert len(out["diff"]) >= 2  # several layouts of gb64 on 2 ranks, each against its own training step
    for name, diff in out["diff"].items():
        for kind, d in diff.items():
            # parameters and Adam's moments after one step agree up to floating-point order (6e-6 at most here: Adam's
            # first step divides g by |g| + eps, so coordinates with g near eps amplify it); an LR 1% off moves the
            # parameters by 6e-5, a wrong batch by ~lr = 0.006; clipping (active, checked) scales the moments only
            assert d <= 2e-5 * max(out["scale"][kind], 1e-3), (name, kind, d)
    assert out["state_step"] == 1 and out["clip_coef"] < 1.0
    assert 0 < out["warm_s"] < out["seconds"] and out["first_s"] > 0


def test_step0_gradient_is_checked_spent_once_and_kept_only_with_a_warm_batch(out):
    assert "one per parameter shard" in out["bad_grads"]
    assert "kept no gradient" in out["spent"]
    assert out["off"] == (True, True, True)  # no warm batch: nothing kept, as many statistics pairs
