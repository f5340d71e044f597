import warnings

import numpy as np
import pytest

from sysprdict.fit import OutOfMemoryPredicted, check_fits, largest_batch
from sysprdict.layers import decompose
from sysprdict.memory import TrainSetup, predict_memory
from sysprdict.timepred import AnalyticalFlops, TimePredictor, allreduce_time_s, evaluate_holdout_families
from sysprdict.zoo import Shape, build


def test_allreduce_model():
    assert allreduce_time_s(1e6, 1, 1e9) == 0
    assert allreduce_time_s(1e6, 2, 1e9) == pytest.approx(1e-3)
    assert allreduce_time_s(1e6, 4, 1e9, 1e-4) == pytest.approx(1.5e-3 + 6e-4)


def _synthetic_rows():
    # a known ground truth: time = flops / rate x a precision factor; the predictor must find it
    rows = []
    for fam in ("llama", "vit", "qwen2"):
        for size in ("xs", "s"):
            for prec, slow in (("fp32", 1.0), ("bf16", 1.3), ("fp16", 6.0)):
                for b in (1, 2):
                    name = f"{fam}-{size}"
                    d = decompose(build(name), Shape(b, 16, 32), prec)
                    t = (d.fwd_flops + d.bwd_flops) / 2e9 * slow + 1e-3
                    rows.append(
                        {
                            "model": name,
                            "family": fam,
                            "batch": b,
                            "seq_len": 16,
                            "image_size": 32,
                            "precision": prec,
                            "world_size": 1,
                            "step_cpu_s": t,
                            "optimizer": "adamw",
                        }
                    )
    return rows


@pytest.fixture(scope="module")
def synthetic_rows():
    return _synthetic_rows()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["opmix", "additive", "loglinear"])
def test_precision_aware_beats_blind_on_held_out_families(synthetic_rows, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = evaluate_holdout_families(synthetic_rows, flops_per_s=2e9, kind=kind)
    assert ev["aware"]["mape"] < 0.5 * ev["blind"]["mape"]
    assert set(ev["aware"]["per_family"]) == {"llama", "vit", "qwen2"}
    with pytest.raises(ValueError, match="kind"):
        TimePredictor(kind="oracle")


def test_predictor_warns_outside_training_range():
    ds = [decompose(build("llama-xs"), Shape(b, 16), "fp32") for b in (1, 2, 3)]
    tp = TimePredictor().fit(ds, [0.01, 0.02, 0.03])
    big = decompose(build("llama-l"), Shape(8, 64), "fp32")
    with pytest.warns(UserWarning, match="outside the training range"):
        tp.predict([big])
    t1 = tp.predict_step(ds[0])
    t2 = tp.predict_step(ds[0], world_size=2, bandwidth_bytes_per_s=1e8)
    assert t2 > t1
    assert AnalyticalFlops(1e9).predict(ds)[0] == pytest.approx((ds[0].fwd_flops + ds[0].bwd_flops) / 1e9)


def test_largest_batch_is_maximal_and_guard_raises():
    limit = 6 * 2**20
    res = largest_batch("vit-s", limit, seq_len=16, margin=0.1)
    assert res.fits and res.batch >= 1
    budget = limit / 1.1
    peak = lambda b: predict_memory(decompose(build("vit-s"), Shape(b, 16, 32), "fp32"), TrainSetup()).peak_bytes  # noqa: E731
    assert peak(res.batch) <= budget < peak(res.batch + 1)
    with pytest.raises(OutOfMemoryPredicted, match="exceeds"):
        check_fits("vit-s", limit, res.batch + 1, seq_len=16, margin=0.1)
    check_fits("vit-s", limit, res.batch, seq_len=16, margin=0.1)
    tiny = largest_batch("llama-s", "100KiB", seq_len=16)
    assert not tiny.fits and "nothing fits" in tiny.describe()
    with pytest.raises(ValueError, match="memory"):
        largest_batch("llama-s", "lots")
    assert np.isfinite(res.margin_fraction)


def test_calibrate_experts_measures_every_dtype():
    from sysprdict import timepred

    saved = dict(timepred.EXPERTS_MATMUL_COST)
    try:
        cost = timepred.calibrate_experts(repeats=2)
        assert set(cost) == {"float32", "bfloat16", "float16"} and all(v > 0 for v in cost.values())
        assert timepred.EXPERTS_MATMUL_COST == cost
    finally:
        timepred.EXPERTS_MATMUL_COST.clear()
        timepred.EXPERTS_MATMUL_COST.update(saved)


def test_opmix_predictions_keep_the_expert_cost_of_their_fit(monkeypatch):
    """A fitted predictor prices grouped expert matmuls at the cost it was fitted with, even when
    the process's calibration changes afterwards."""
    from sysprdict import timepred

    monkeypatch.setattr(timepred, "EXPERTS_MATMUL_COST", {"float32": 2.0, "bfloat16": 2.0, "float16": 2.0})
    ds = [decompose(build(m), Shape(b, 16), "fp32") for m in ("llama-xs", "qwen2-moe-xs") for b in (1, 2, 3)]
    tp = TimePredictor(kind="opmix").fit(ds, [0.01, 0.02, 0.03, 0.015, 0.03, 0.045])
    before = tp.predict(ds)
    timepred.EXPERTS_MATMUL_COST["float32"] = 50.0  # a later recalibration in the same process
    np.testing.assert_allclose(tp.predict(ds), before)
    assert tp._experts_cost["float32"] == 2.0
