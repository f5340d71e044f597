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
    rbmod.all_reduce = lambda v, g=None: v.copy_(torch.tensor(pred, dtype=torch.float64) * torch.tensor([1.0, 3.0]))
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
