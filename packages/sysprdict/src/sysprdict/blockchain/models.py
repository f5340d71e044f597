"""Features, regressors (random forest and xgboost), grouped cross-validation, saved models.

Features (all from the configuration columns, documented in FEATURES):
  vertical     peer_cpus, peer_mem_gb, orderer_cpus, orderer_mem_gb
  horizontal   peers, orderers, orgs
  workload     send_rate_tps, read_fraction, block_size, batch_timeout_s, endorsement (as the number
               of endorsing orgs and a policy code)
  engineered   offered load per peer CPU, write rate, endorsements per second per peer CPU,
               expected block fill time vs batch timeout, orderer load per orderer CPU, memory per CPU

Targets: throughput is learnt as the fraction of the offered load that succeeds (throughput /
send rate), so one model covers every send rate; latency in log space; success rate directly.
Cross-validation folds are grouped by `config_id`: repeated runs of one configuration never sit on
both sides of a split.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import numpy as np

from ..timepred import boosting_backend

log = logging.getLogger(__name__)

__all__ = ["FEATURES", "TARGETS", "PerfModel", "featurize", "grouped_cv", "grouped_folds", "mape", "smape"]

FEATURES = {
    "peers": "peer nodes (horizontal)",
    "orderers": "Raft orderer nodes (horizontal)",
    "orgs": "organizations (horizontal)",
    "peer_cpus": "CPU quota per peer, cores (vertical)",
    "peer_mem_gb": "memory per peer, GB (vertical)",
    "orderer_cpus": "CPU quota per orderer, cores (vertical)",
    "orderer_mem_gb": "memory per orderer, GB (vertical)",
    "send_rate_tps": "offered load (workload)",
    "read_fraction": "share of read-only queries (workload)",
    "block_size": "transactions per block (workload)",
    "batch_timeout_s": "block cut timeout (workload)",
    "endorsers": "endorsing organizations the policy requires",
    "policy_code": "OR=0, MAJORITY=1, AND=2",
    "load_per_peer_cpu": "send_rate / (peers x peer_cpus)",
    "write_rate": "send_rate x (1 - read_fraction)",
    "endorse_per_peer_cpu": "write_rate x endorsers / (peers x peer_cpus)",
    "validate_per_peer_cpu": "write_rate x endorsers / peer_cpus (every peer validates every block)",
    "block_fill_s": "block_size / write_rate (time to fill a block)",
    "fill_over_timeout": "block_fill_s / batch_timeout_s",
    "order_per_orderer_cpu": "write_rate x orderers / orderer_cpus",
    "peer_mem_per_cpu": "peer_mem_gb / peer_cpus",
}
TARGETS = ("throughput_tps", "avg_latency_s", "success_rate")
SCALING = ("peers", "orderers", "orgs", "peer_cpus", "peer_mem_gb", "orderer_cpus", "orderer_mem_gb")
_POLICY = {"OR": 0, "MAJORITY": 1, "AND": 2}


def featurize(rows: list[dict]) -> np.ndarray:
    """The feature matrix (columns in FEATURES order)."""
    out = []
    for r in rows:
        e = {"OR": 1, "MAJORITY": r["orgs"] // 2 + 1, "AND": r["orgs"]}[r["endorsement"]]
        w = r["send_rate_tps"] * (1 - r["read_fraction"])
        fill = r["block_size"] / max(w, 1e-6)
        f = {
            **{k: float(r[k]) for k in list(FEATURES)[:11]},
            "endorsers": float(e),
            "policy_code": float(_POLICY[r["endorsement"]]),
            "load_per_peer_cpu": r["send_rate_tps"] / (r["peers"] * r["peer_cpus"]),
            "write_rate": w,
            "endorse_per_peer_cpu": w * e / (r["peers"] * r["peer_cpus"]),
            "validate_per_peer_cpu": w * e / r["peer_cpus"],
            "block_fill_s": fill,
            "fill_over_timeout": fill / r["batch_timeout_s"],
            "order_per_orderer_cpu": w * r["orderers"] / r["orderer_cpus"],
            "peer_mem_per_cpu": r["peer_mem_gb"] / r["peer_cpus"],
        }
        out.append([f[k] for k in FEATURES])
    return np.asarray(out, float)


def _encode(target: str, rows: list[dict]) -> np.ndarray:
    y = np.array([r[target] for r in rows], float)
    if target == "throughput_tps":
        return y / np.array([r["send_rate_tps"] for r in rows])
    if target == "avg_latency_s":
        return np.log(np.maximum(y, 1e-4))
    return y


def _decode(target: str, rows: list[dict], z: np.ndarray) -> np.ndarray:
    if target == "throughput_tps":
        return np.clip(z, 0, None) * np.array([r["send_rate_tps"] for r in rows])
    if target == "avg_latency_s":
        return np.exp(z)
    return np.clip(z, 0.0, 1.0)


def smape(pred, true) -> float:
    p, t = np.asarray(pred, float), np.asarray(true, float)
    den = np.abs(p) + np.abs(t)
    return float(np.mean(np.where(den > 0, 2 * np.abs(p - t) / np.where(den > 0, den, 1), 0.0)))


def mape(pred, true) -> float:
    p, t = np.asarray(pred, float), np.asarray(true, float)
    m = np.abs(t) > 1e-9
    return float(np.mean(np.abs(p[m] - t[m]) / np.abs(t[m]))) if m.any() else float("nan")


def _regressor(kind: str, seed: int):
    if kind == "rf":
        from sklearn.ensemble import RandomForestRegressor

        return RandomForestRegressor(n_estimators=200, min_samples_leaf=1, n_jobs=1, random_state=seed)
    if kind == "xgb":
        if boosting_backend() == "xgboost":
            import xgboost as xgb

            return xgb.XGBRegressor(
                n_estimators=400, max_depth=4, learning_rate=0.05, subsample=0.9, n_jobs=1, random_state=seed
            )
        from sklearn.ensemble import HistGradientBoostingRegressor

        return HistGradientBoostingRegressor(max_depth=4, learning_rate=0.05, max_iter=400, random_state=seed)
    raise ValueError(f"model: {kind!r} is not known; use 'rf' or 'xgb'")


class PerfModel:
    """One regressor per target (throughput, latency, success rate) of one kind ('rf' or 'xgb')."""

    def __init__(self, kind: str = "rf", seed: int = 0):
        self.kind, self.seed = kind, seed
        self.models: dict = {}
        self.residual_q: dict[str, tuple[float, float]] = {}
        self.space: dict[str, list] = {}

    def fit(self, rows: list[dict]) -> PerfModel:
        # the scaling values seen in training: the recommender searches only inside them
        self.space = {c: sorted({r[c] for r in rows}) for c in SCALING}
        x = featurize(rows)
        for t in TARGETS:
            self.models[t] = _regressor(self.kind, self.seed).fit(x, _encode(t, rows))
        return self

    def predict(self, rows: list[dict]) -> dict[str, np.ndarray]:
        x = featurize(rows)
        return {t: _decode(t, rows, m.predict(x)) for t, m in self.models.items()}

    def interval(self, rows: list[dict], target: str, q: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """A central `q` prediction interval: the spread of the forest's trees (rf) widened by the
        cross-validated residual quantiles when known (set by `grouped_cv`)."""
        x = featurize(rows)
        m = self.models[target]
        point = _decode(target, rows, m.predict(x))
        lo_r, hi_r = self.residual_q.get(target, (0.0, 0.0))
        if self.kind == "rf":
            per_tree = np.stack([_decode(target, rows, est.predict(x)) for est in m.estimators_])
            lo = np.quantile(per_tree, (1 - q) / 2, axis=0)
            hi = np.quantile(per_tree, 1 - (1 - q) / 2, axis=0)
        else:
            lo, hi = point.copy(), point.copy()
        lo = np.minimum(lo, point * (1 + lo_r))
        hi = np.maximum(hi, point * (1 + hi_r))
        if target == "success_rate":
            lo, hi = np.clip(lo, 0, 1), np.clip(hi, 0, 1)
        return lo, hi

    def feature_importances(self) -> dict[str, dict[str, float]]:
        out = {}
        for t, m in self.models.items():
            imp = getattr(m, "feature_importances_", None)
            if imp is not None:
                out[t] = {k: float(v) for k, v in sorted(zip(FEATURES, imp), key=lambda kv: -kv[1])}
        return out

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            state = {"kind": self.kind, "seed": self.seed, "models": self.models, "residual_q": self.residual_q}
            pickle.dump({**state, "space": self.space}, f)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PerfModel:
        with open(path, "rb") as f:
            d = pickle.load(f)  # noqa: S301 - our own saved models
        m = cls(d["kind"], d["seed"])
        m.models, m.residual_q, m.space = d["models"], d["residual_q"], d.get("space", {})
        return m


def grouped_folds(rows: list[dict], k: int = 5, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index arrays; every config_id's rows fall in exactly one test fold."""
    groups = sorted({r["config_id"] for r in rows})
    if len(groups) < k:
        raise ValueError(f"rows: {len(groups)} configurations are too few for {k}-fold grouped cross-validation")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(groups))
    fold_of = {groups[g]: i % k for i, g in enumerate(order)}
    f = np.array([fold_of[r["config_id"]] for r in rows])
    return [(np.where(f != i)[0], np.where(f == i)[0]) for i in range(k)]


def grouped_cv(rows: list[dict], kind: str = "rf", k: int = 5, seed: int = 0) -> dict:
    """Out-of-fold predictions and SMAPE/MAPE per target under grouped k-fold cross-validation."""
    pred = {t: np.zeros(len(rows)) for t in TARGETS}
    for tr, te in grouped_folds(rows, k, seed):
        m = PerfModel(kind, seed).fit([rows[i] for i in tr])
        p = m.predict([rows[i] for i in te])
        for t in TARGETS:
            pred[t][te] = p[t]
    out: dict = {"model": kind, "folds": k, "n_rows": len(rows), "n_configs": len({r["config_id"] for r in rows})}
    for t in TARGETS:
        true = np.array([r[t] for r in rows])
        out[t] = {"smape": smape(pred[t], true), "mape": mape(pred[t], true)}
        rel = (pred[t] - true) / np.maximum(np.abs(pred[t]), 1e-9)
        out[t]["residual_q05_q95"] = (float(np.quantile(-rel, 0.05)), float(np.quantile(-rel, 0.95)))
    out["oof"] = {t: pred[t].tolist() for t in TARGETS}
    return out
