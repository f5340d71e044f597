"""Saved performance models are plain arrays and JSON: loading one unpickles and runs nothing."""

import json
import os
import pickle

import numpy as np
import pytest

from sysprdict.blockchain import PerfModel, simulate_dataset
from sysprdict.blockchain import models as models_mod
from sysprdict.blockchain.fabricsim import SimParams
from sysprdict.blockchain.models import TARGETS, TreeEnsemble
from sysprdict.blockchain.recommend import candidates


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def rows():
    return simulate_dataset(12, 1, seed=3, params=SimParams(duration_s=1.0))


WORKLOAD = {"send_rate_tps": 300.0, "read_fraction": 0.2, "block_size": 50, "batch_timeout_s": 1.0}


@pytest.mark.parametrize("kind", ["rf", "et", "et-cap", "xgb", "hgb"])
def test_a_saved_model_predicts_exactly_as_the_fitted_one(rows, kind, tmp_path, monkeypatch):
    if kind == "hgb":  # the boosting fallback when xgboost is not installed
        monkeypatch.setattr(models_mod, "boosting_backend", lambda: "sklearn-hgb")
    m = PerfModel(kind if kind in ("rf", "et", "et-cap") else "xgb", seed=1).fit(rows)
    m.residual_q = {"throughput_tps": (-0.1, 0.2)}
    again = PerfModel.load(m.save(tmp_path / "model.pkl"))
    assert (again.kind, again.seed, again.space, again.residual_q) == (m.kind, m.seed, m.space, m.residual_q)
    cands = candidates({**WORKLOAD, "endorsement": "MAJORITY"}, m.space)
    want, got = m.predict(cands), again.predict(cands)
    for t in TARGETS:
        assert np.array_equal(got[t], want[t]), t
    assert again.feature_importances() == m.feature_importances()
    lo, hi = m.interval(cands, "throughput_tps")
    lo2, hi2 = again.interval(cands, "throughput_tps")
    assert np.array_equal(lo, lo2) and np.array_equal(hi, hi2)
    if kind != "xgb":
        assert isinstance(again.models["throughput_tps"], TreeEnsemble)


def _live(path, marker):
    with open(path, "rb") as f:  # the payload is live: a plain unpickle runs it
        pickle.load(f)
    assert marker.exists()
    marker.unlink()


def test_an_old_pickled_model_is_refused_unopened(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "blockchain-rf.pkl"
    path.write_bytes(pickle.dumps({"kind": "rf", "seed": 0, "models": _Payload(marker)}))
    _live(path, marker)
    with pytest.raises(ValueError, match="pickled model from an older sysprdict.*sysprdict blockchain-demo"):
        PerfModel.load(path)
    assert not marker.exists()


def test_a_pickle_inside_the_archive_is_never_unpickled(rows, tmp_path):
    path = PerfModel("rf").fit(rows).save(tmp_path / "m.npz")
    marker = tmp_path / "pwned"
    with np.load(path) as z:
        arrays = dict(z)
    arrays["throughput_tps.value"] = np.array([_Payload(marker)], dtype=object)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match=r"m.npz is not a sysprdict model file written by PerfModel.save"):
        PerfModel.load(path)
    assert not marker.exists()
    with np.load(path, allow_pickle=True) as z:  # the payload is live
        z["throughput_tps.value"]
    assert marker.exists()


def test_damaged_model_files_are_named_and_never_loop(rows, tmp_path):
    path = PerfModel("rf").fit(rows).save(tmp_path / "m.npz")
    with np.load(path) as z:
        arrays = dict(z)
    left = arrays["throughput_tps.left"].copy()
    inner = np.flatnonzero(left >= 0)[0]
    left[inner] = inner  # a node that is its own child: a walk would never reach a leaf
    for key, value in [("throughput_tps.left", left), ("meta", np.array(json.dumps({"format": "other"})))]:
        bad = {**arrays, key: value}
        with open(tmp_path / "bad.npz", "wb") as f:
            np.savez(f, **bad)
        with pytest.raises(ValueError, match="bad.npz is not a sysprdict model file"):
            PerfModel.load(tmp_path / "bad.npz")
    (tmp_path / "text").write_text("hello")
    with pytest.raises(ValueError, match="text is not a sysprdict model file"):
        PerfModel.load(tmp_path / "text")
