"""Step 0's warm gradient becomes the run's first step: the state it hands over is the one a training step on the
same batch takes, on every layout of that global batch."""

import pytest
import torch

from cona.dist import launch
from cona.probe import CostModel
from cona.train import BenchConfig


def _worker(rank, world):
    import cona.train as T

    cfg = BenchConfig(world=world, global_batches=(32, 64), micro_batches=(8, 32), val_samples=16, oracle=False,
                      probe_cache=False, seeds=1, corpus_bytes=200_000)  # fmt: skip
    tr = T._Trainer(cfg)
    tr.cost = CostModel({c: 0.001 * c.global_batch for c in tr.candidates})  # a table, no probing
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
    # and without it: no gradient is kept
    off = T._Trainer(BenchConfig(**{**cfg.__dict__, "step0_trains": False}))
    off.cost = tr.cost
    st_off = off.gns_at_step0()
    out["off"] = (st_off.warm is None, st_off.ex is None, st_off.pairs == st0.pairs)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def out():
    torch.manual_seed(0)
    return launch(_worker, 2)[0]


def test_step0_gradient_trains_as_the_first_step_on_every_layout_of_its_global_batch(out):
    assert out["strategy"].endswith("gb64") and out["pairs"] == 8  # dp2, 4 micro-batches of 8 per replica
    assert len(out["diff"]) >= 2  # several layouts of gb64 on 2 ranks, each against its own training step
    for name, diff in out["diff"].items():
        for kind, d in diff.items():
            # parameters and Adam's moments after one step agree up to floating-point order (6e-6 at most here: Adam's
            # first step divides g by |g| + eps, so coordinates with g near eps amplify it); an LR 1% off moves the
            # parameters by 6e-5, a wrong batch or clipping by ~lr = 0.006, the moments by their whole size
            assert d <= 2e-5 * max(out["scale"][kind], 1e-3), (name, kind, d)
    assert out["state_step"] == 1
    assert 0 < out["warm_s"] < out["seconds"] and out["first_s"] > 0


def test_step0_gradient_is_checked_spent_once_and_kept_only_when_asked(out):
    assert "one per parameter shard" in out["bad_grads"]
    assert "kept no gradient" in out["spent"]
    assert out["off"] == (True, True, True)  # off: nothing kept, the same statistics
