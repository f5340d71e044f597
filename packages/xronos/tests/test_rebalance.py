import pytest
import torch
from dist_helpers import small_cfg

from xronos.partition import costs_from_speeds, even_partition
from xronos.rebalance import Rebalancer
from xronos.train import TPTrainer


@pytest.mark.slow
def test_reshard_mid_training_is_exact(train_runs):
    runs = [r["reshard"] for r in train_runs]
    for lora in (0, 4):
        cfg = small_cfg(lora_r=lora)
        ref = TPTrainer(cfg, None if not lora else even_partition(cfg.shape(), 1))
        losses = [ref.step()["loss"] for _ in range(4)]
        from xronos.shard import gather_state_dict

        ref_state = gather_state_dict(ref.model)
        assert runs[0][lora]["heads"] == (2, 32) and runs[1][lora]["heads"] == (6, 96)
        for r in runs:
            assert r[lora]["losses"] == pytest.approx(losses, rel=1e-5)
            for k, v in ref_state.items():
                torch.testing.assert_close(r[lora]["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_rebalancer_moves_work_away_from_a_slowed_rank():
    cfg = small_cfg()
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    rb = Rebalancer(shape, costs, every=2, threshold=0.05)

    class Fake:  # a 2-rank trainer seen from rank 0: rank 1 measured 3x slower than modelled
        part = even_partition(shape, 2)
        step_idx = 2

    pred = [
        shape.num_layers * (c.attn_time(a) + c.mlp_time(m))
        for c, a, m in zip(costs, Fake.part.attn_units, Fake.part.mlp_units)
    ]
    import xronos.rebalance as rbmod

    calls = []
    orig_all_reduce, orig_repart = rbmod.all_reduce, rbmod.repartition
    # whole-step compute (no per-segment records): both segments of rank 1 are rescaled by 3
    measured = [pred[0], 0.0, 3.0 * pred[1], 0.0]
    rbmod.all_reduce = lambda v, g=None, **kw: v.copy_(torch.tensor(measured, dtype=torch.float64))
    rbmod.repartition = lambda trainer, p: calls.append(p)
    try:
        rb.observe({"step_s": 1.0, "comm_s": 0.0})
        assert rb.maybe_repartition(Fake) is None  # not enough steps yet
        rb.observe({"step_s": 1.0, "comm_s": 0.0})
        new = rb.maybe_repartition(Fake)
    finally:
        rbmod.all_reduce, rbmod.repartition = orig_all_reduce, orig_repart
    assert new is not None and calls == [new]
    assert new.mlp_units[0] > new.mlp_units[1] and rb.history[-1]["factors"][1] == pytest.approx(3.0)


def _seg_record(attn_s, mlp_s, layers):
    """A fake TP step record whose all-reduces close attention/MLP segments of the given lengths."""
    t, syncs = 0.0, []
    order = ["attn", "mlp"] * layers + ["mlp", "attn"] * layers + ["clip"]
    for tag in order:
        t += attn_s / (2 * layers) if tag == "attn" else mlp_s / (2 * layers) if tag == "mlp" else 0.001
        syncs.append(("ar", -1, t, t + 0.0005, tag))
        t += 0.0005
    return {"t0": 0.0, "t1": t + 0.002, "step_s": t + 0.002, "comm_s": 0.0005 * len(order), "syncs": syncs}


def test_rebalancer_corrects_each_segment_on_its_own():
    cfg = small_cfg()
    shape = cfg.shape()
    costs = costs_from_speeds([1.0, 1.0], shape, unit_s=1e-3)
    rb = Rebalancer(shape, costs, every=1, threshold=0.01)
    part = even_partition(shape, 2)
    L = shape.num_layers
    pred = [(L * c.attn_time(a), L * c.mlp_time(m)) for c, a, m in zip(costs, part.attn_units, part.mlp_units)]
    # rank 1's MLP runs 2x slower than modelled, its attention as modelled: only the MLP split moves
    rb.observe(_seg_record(pred[0][0], pred[0][1], L))
    measured = [pred[0][0], pred[0][1], pred[1][0], 2.0 * pred[1][1]]

    class Fake:
        step_idx = 1

    Fake.part = part
    import xronos.rebalance as rbmod

    calls = []
    orig_all_reduce, orig_repart = rbmod.all_reduce, rbmod.repartition
    rbmod.all_reduce = lambda v, g=None, **kw: v.copy_(torch.tensor(measured, dtype=torch.float64))
    rbmod.repartition = lambda trainer, p: calls.append(p)
    try:
        new = rb.maybe_repartition(Fake)
    finally:
        rbmod.all_reduce, rbmod.repartition = orig_all_reduce, orig_repart
    ev = rb.history[-1]
    assert ev["by_segment"] and ev["factors"][1][0] == pytest.approx(1.0) and ev["factors"][1][1] == pytest.approx(2.0)
    assert new is not None and new.attn_units == part.attn_units and new.mlp_units[0] > new.mlp_units[1]
