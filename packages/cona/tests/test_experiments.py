"""The experiments' helpers: pool_gaps' pooling and refusals, batch_efficiency's sample counts."""

import importlib.util
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[1] / "experiments"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pool_gaps = _load("pool_gaps")
batch_efficiency = _load("batch_efficiency")


def _gaps(values, **config):
    return {
        "config": {"world": 4, "seeds": len(values), "wall_s": 1.0} | config,
        "headline_spread": {"gap_to_oracle": {"per_seed": values}},
    }


def test_pool_gaps_pools_seeds_of_runs_of_one_configuration():
    a, b = _gaps([0.0, 0.02, 0.04, None]), _gaps([0.06, 0.08, 0.10], wall_s=9.0)  # wall time is run-local
    out = pool_gaps.pool({"a": a, "b": b}, draws=500)
    assert out["runs"] == {"a": {"seeds": 3, "median": 0.02}, "b": {"seeds": 3, "median": 0.08}}
    assert out["pooled"]["seeds"] == 6 and out["pooled"]["median"] == pytest.approx(0.05)
    assert out["pooled"]["at_or_under_target"] == 3  # 0.05 exactly is not in the data; 0.0, 0.02, 0.04 are
    lo, hi = out["pooled"]["median_interval_90"]
    assert 0.0 <= lo <= 0.05 <= hi <= 0.10
    assert 0.0 < out["p_run_median_above_target"]["3"] < 1.0
    low = pool_gaps.pool({"a": _gaps([-0.1, -0.05, 0.0])}, draws=500)
    assert low["p_run_median_above_target"] == {"3": 0.0}


def test_pool_gaps_refuses_runs_of_other_configurations_and_unknown_keys():
    with pytest.raises(ValueError, match="config field 'world' differs between a and b"):
        pool_gaps.pool({"a": _gaps([0.01]), "b": _gaps([0.02], world=2)}, draws=500)
    with pytest.raises(ValueError, match="key 'gap' is not in the run's headline_spread"):
        pool_gaps.pool({"a": _gaps([0.01])}, key="gap", draws=500)
    with pytest.raises(ValueError, match="run a has no per-seed value"):
        pool_gaps.pool({"a": _gaps([None])}, draws=500)


def test_samples_to_a_level_interpolates_between_evaluations():
    curve = [(0, 3.0), (100, 2.5), (200, 2.0), (300, 1.8)]
    assert batch_efficiency.samples_to(curve, 2.5) == 100
    assert batch_efficiency.samples_to(curve, 2.25) == pytest.approx(150.0)
    assert batch_efficiency.samples_to(curve, 1.9) == pytest.approx(250.0)
    assert batch_efficiency.samples_to(curve, 1.0) is None
