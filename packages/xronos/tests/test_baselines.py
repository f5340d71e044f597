"""The libraries' baselines train the same model as the single-process reference."""

import pytest

from xronos.bench import _expand_pipelines, headline
from xronos.launch import spawn
from xronos.train import TPTrainer, TrainConfig

CFG = TrainConfig(
    hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, seq_len=32, batch=4, micro_batches=2, steps=3
)


def test_dtensor_tp_and_pipelining_schedules_match_the_reference():
    from dist_helpers import library_baselines

    res = spawn(library_baselines, 2, (CFG.to_dict(),), timeout_s=200)
    ref = TPTrainer(CFG, None)
    expected = [ref.step()["loss"] for _ in range(CFG.steps)] + [ref.evaluate()]
    for name in ("dtensor", "gpipe", "1f1b"):
        assert res[0][name] == res[1][name], name  # every rank reports the same losses
        assert res[0][name] == pytest.approx(expected, rel=1e-5), name


def test_pipeline_baselines_sweep_micro_batches_and_schedules():
    cfg = TrainConfig(batch=8, micro_batches=4)
    names = _expand_pipelines(cfg, 2, ["xronos", "pp", "pipelining"])
    assert names[0] == "xronos"
    assert {"pp-m4", "pp-m8"} <= set(names)
    assert {f"ppl-{s}-m{m}" for s in ("gpipe", "1f1b") for m in (2, 4, 8)} <= set(names)
    summary = {
        "xronos": {"step_time_s": 0.6, "idle_ratio": 0.0},
        "tp": {"step_time_s": 1.0, "idle_ratio": 0.3, "total_time_s": 20.0},
        "dtensor": {"step_time_s": 1.25},
        "pp-m4": {"step_time_s": 0.9},
        "ppl-1f1b-m2": {"step_time_s": 0.8},
    }
    summary["xronos"]["total_time_s"] = 12.0
    h = headline(summary)
    assert h["pp_baseline"] == "ppl-1f1b-m2" and h["step_time_ratio_vs_pp"] == pytest.approx(0.75)
    assert h["tp_step_ratio_vs_dtensor"] == pytest.approx(0.8)


def test_free_communication_bound_splits_repeated_from_sharded_work():
    from xronos.bench import free_comm_bound

    # rank 0 repeats 0.04 s of attention, 0.06 s of MLP and 0.02 s of other work whatever its share,
    # and shards 0.2 s, 0.3 s and 0.05 s (LM head, optimizer: with the MLP share): 0.67 s alone
    def seg(h, m):
        return {"attn": 0.04 + 0.2 * h, "mlp": 0.06 + 0.3 * m, "other": 0.02 + 0.05 * m}

    summary = {
        "reference": {"step_time_s": 0.67},
        "tp": {"segment_compute_s_per_rank": [seg(0.5, 0.5)]},
        "xronos": {
            "segment_compute_s_per_rank": [seg(0.75, 0.6875)],
            "partition": {"q_heads": [12, 4], "mlp_columns": [704, 320]},
        },
    }
    b = free_comm_bound(summary, [1.0, 0.5])
    assert b["replicated_s"] == pytest.approx(0.12) and b["sharded_s"] == pytest.approx(0.55)
    assert b["step_time_s"] == pytest.approx((0.55 + 2 * 0.12) / 1.5)
    assert b["ratio_vs_fast_alone"] == pytest.approx(b["step_time_s"] / 0.67)
    assert free_comm_bound(summary, [0.5, 1.0]) is None  # the reference did not run on the fastest rank
    summary["xronos"]["segment_compute_s_per_rank"][0]["other"] = 0.04  # noise: less at a larger share
    tilted = free_comm_bound(summary, [1.0, 0.5])
    assert tilted["sharded_s"] == pytest.approx(0.5) and tilted["replicated_s"] == pytest.approx(0.1 + 0.045)
    summary["xronos"]["partition"] = {"q_heads": [8, 8], "mlp_columns": [512, 512]}
    assert free_comm_bound(summary, [1.0, 0.5]) is None  # one share measured: no line to fit
