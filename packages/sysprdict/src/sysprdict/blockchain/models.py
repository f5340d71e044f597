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

Saved models are an ``.npz`` of plain arrays read with ``allow_pickle=False`` plus JSON metadata: the
forests' and boosted trees' nodes (:class:`TreeEnsemble`, which predicts exactly as the fitted
scikit-learn regressor did) or xgboost's own JSON model. Loading one runs no code from the file, so a
model file may come from anywhere; a pickle could run anything when unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np

import hwtopo

from ..timepred import boosting_backend

log = logging.getLogger(__name__)

__all__ = [
    "CAPACITY",
    "FEATURES",
    "TARGETS",
    "PerfModel",
    "TreeEnsemble",
    "featurize",
    "grouped_cv",
    "grouped_folds",
    "level_holdout",
    "mape",
    "smape",
]

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
KINDS = ("rf", "et", "et-cap", "xgb", "constant", "linear")
"""Random forest, extremely randomized trees (random split thresholds: smoother across the levels
of a factor), extremely randomized trees with a capacity cap on throughput (`CAPACITY`; chosen for
the held-out-level headline by its error on development seeds of the simulator, never the reported
one), boosted trees, and two baselines: the training mean (of throughput / offered load, latency,
success rate) and a linear regression on the same features."""
CAPACITY = "throughput_per_peer_cpu"
"""The second throughput model of kind "et-cap": successful transactions per second per peer core
(peers x peer_cpus).  Throughput is the smaller of the offered load times the predicted success
share and the peer cores times the predicted throughput per core.  A saturated network's throughput
per core stays flat as the load grows, so trees, which predict flat outside their training range,
extrapolate it correctly to a level with fewer cores or more load than any training level, where
the share of the offered load that succeeds keeps falling and trees cannot follow it."""
HOLDOUT_FACTORS = ("peer_cpus", "send_rate_tps", "block_size")
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


def _peer_cores(rows: list[dict]) -> np.ndarray:
    return np.array([r["peers"] * r["peer_cpus"] for r in rows], float)


def _encode(target: str, rows: list[dict]) -> np.ndarray:
    if target == CAPACITY:
        return np.array([r["throughput_tps"] for r in rows], float) / _peer_cores(rows)
    y = np.array([r[target] for r in rows], float)
    if target == "throughput_tps":
        return y / np.array([r["send_rate_tps"] for r in rows])
    if target == "avg_latency_s":
        return np.log(np.maximum(y, 1e-4))
    return y


def _decode(target: str, rows: list[dict], z: np.ndarray) -> np.ndarray:
    if target == CAPACITY:
        return np.clip(z, 0, None) * _peer_cores(rows)
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
    if kind in ("et", "et-cap"):
        from sklearn.ensemble import ExtraTreesRegressor

        return ExtraTreesRegressor(n_estimators=200, min_samples_leaf=1, n_jobs=1, random_state=seed)
    if kind == "xgb":
        if boosting_backend() == "xgboost":
            import xgboost as xgb

            return xgb.XGBRegressor(
                n_estimators=400, max_depth=4, learning_rate=0.05, subsample=0.9, n_jobs=1, random_state=seed
            )
        from sklearn.ensemble import HistGradientBoostingRegressor

        return HistGradientBoostingRegressor(max_depth=4, learning_rate=0.05, max_iter=400, random_state=seed)
    if kind == "constant":  # the simple baselines a skeptic compares with
        from sklearn.dummy import DummyRegressor

        return DummyRegressor(strategy="mean")
    if kind == "linear":
        from sklearn.linear_model import LinearRegression

        return LinearRegression()
    raise ValueError(f"model: {kind!r} is not known; use one of {list(KINDS)}")


class PerfModel:
    """One regressor per target (throughput, latency, success rate) of one kind ('rf', 'et', 'et-cap'
    or 'xgb'); kind 'et-cap' adds the `CAPACITY` model that caps throughput."""

    def __init__(self, kind: str = "rf", seed: int = 0):
        self.kind, self.seed = kind, seed
        self.models: dict = {}
        self.residual_q: dict[str, tuple[float, float]] = {}
        self.space: dict[str, list] = {}

    def fit(self, rows: list[dict]) -> PerfModel:
        # the scaling values seen in training: the recommender searches only inside them
        self.space = {c: sorted({r[c] for r in rows}) for c in SCALING}
        x = featurize(rows)
        for t in (*TARGETS, CAPACITY) if self.kind == "et-cap" else TARGETS:
            self.models[t] = _regressor(self.kind, self.seed).fit(x, _encode(t, rows))
        return self

    def predict(self, rows: list[dict]) -> dict[str, np.ndarray]:
        x = featurize(rows)
        out = {t: _decode(t, rows, m.predict(x)) for t, m in self.models.items()}
        if CAPACITY in out:
            out["throughput_tps"] = np.minimum(out["throughput_tps"], out.pop(CAPACITY))
        return out

    def interval(self, rows: list[dict], target: str, q: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """A central `q` prediction interval: the spread of the forest's trees (rf) widened by the
        cross-validated residual quantiles when known (set by `grouped_cv`)."""
        x = featurize(rows)
        m = self.models[target]
        point = self.predict(rows)[target]
        lo_r, hi_r = self.residual_q.get(target, (0.0, 0.0))
        if self.kind in ("rf", "et", "et-cap"):
            per_tree = np.stack([_decode(target, rows, z) for z in _tree_predictions(m, x)])
            if target == "throughput_tps" and CAPACITY in self.models:
                caps = np.stack([_decode(CAPACITY, rows, z) for z in _tree_predictions(self.models[CAPACITY], x)])
                per_tree = np.minimum(per_tree, caps)
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
        """Write the model atomically as an ``.npz`` of plain arrays (see the module doc), whatever the
        path's suffix."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {}
        meta = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "kind": self.kind,
            "seed": self.seed,
            "residual_q": {t: list(q) for t, q in self.residual_q.items()},
            "space": self.space,
            "models": {t: _export(m, t, arrays) for t, m in self.models.items()},
        }
        arrays["meta"] = np.array(json.dumps(meta, default=_json_scalar))
        with hwtopo.atomic_file(path, "wb") as f:
            # numpy's stub: a **dict might name savez's own allow_pickle; these keys are array names
            np.savez(f, **arrays)  # type: ignore[arg-type]
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PerfModel:
        """Read a model written by :meth:`save`; nothing in the file is unpickled or run."""
        path = Path(path)
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:1] == b"\x80":
            raise ValueError(
                f"{path} is a pickled model from an older sysprdict; it is not loaded because unpickling can run "
                "code. Refit it: `sysprdict blockchain-demo` writes a new one, or PerfModel(kind).fit(rows).save(path)"
            )
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != _FORMAT or meta.get("version") != _FORMAT_VERSION:
                    raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
                models = {t: _import(spec, t, z) for t, spec in meta["models"].items()}
        except (ValueError, KeyError, TypeError, OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path} is not a sysprdict model file written by PerfModel.save ({e})") from e
        m = cls(meta["kind"], meta["seed"])
        m.models, m.space = models, meta["space"]
        m.residual_q = {t: tuple(q) for t, q in meta["residual_q"].items()}
        return m


_FORMAT, _FORMAT_VERSION = "sysprdict-perfmodel", 1
_NODE_FIELDS = {"feature": np.int64, "threshold": np.float64, "left": np.int64, "right": np.int64, "value": np.float64}


def _json_scalar(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


class TreeEnsemble:
    """A random forest or histogram gradient boosting regressor as plain node arrays.

    All trees' nodes are concatenated (``roots`` holds each tree's first node; a leaf has ``left`` -1).
    A sample goes left when ``x[feature] <= threshold``, with ``x`` first rounded to float32 for a
    forest, as scikit-learn does; a forest averages its trees, boosting adds them to ``base``. Summed
    in the same order as scikit-learn, the predictions are the same floats.
    """

    def __init__(
        self,
        nodes: dict[str, np.ndarray],
        roots: np.ndarray,
        combine: str,
        base: float = 0.0,
        importances: np.ndarray | None = None,
    ):
        if combine not in ("mean", "sum"):
            raise ValueError(f"combine must be 'mean' or 'sum', not {combine!r}")
        self.nodes = {k: np.asarray(nodes[k]).astype(dt, casting="same_kind") for k, dt in _NODE_FIELDS.items()}
        self.roots = np.asarray(roots).astype(np.int64, casting="same_kind")
        self.combine, self.base = combine, float(base)
        self.feature_importances_ = importances
        _check_nodes(self.nodes, self.roots)

    @classmethod
    def from_regressor(cls, m) -> TreeEnsemble:
        """From a fitted ``RandomForestRegressor`` or ``HistGradientBoostingRegressor`` (numeric splits)."""
        if hasattr(m, "estimators_"):
            trees = [
                (
                    e.tree_.feature,
                    e.tree_.threshold,
                    e.tree_.children_left,
                    e.tree_.children_right,
                    e.tree_.value[:, 0, 0],
                )
                for e in m.estimators_
            ]
            return cls._concat(trees, "mean", 0.0, m.feature_importances_)
        preds = [p for it in m._predictors for p in it]
        if any(p.nodes["is_categorical"].any() for p in preds):
            raise ValueError("categorical splits cannot be saved; sysprdict's features are all numeric")
        trees = []
        for p in preds:
            nd, leaf = p.nodes, p.nodes["is_leaf"].astype(bool)
            left, right = (np.where(leaf, -1, nd[k].astype(np.int64)) for k in ("left", "right"))
            trees.append((nd["feature_idx"], nd["num_threshold"], left, right, nd["value"]))
        return cls._concat(trees, "sum", float(np.ravel(m._baseline_prediction)[0]), None)

    @classmethod
    def _concat(cls, trees, combine, base, importances) -> TreeEnsemble:
        sizes = [len(t[4]) for t in trees]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        cols = list(zip(*trees))
        feature = np.concatenate([np.maximum(f, 0) for f in cols[0]]).astype(np.int64)
        left, right = (np.concatenate([np.where(c >= 0, c + o, -1) for c, o in zip(cols[i], offsets)]) for i in (2, 3))
        nodes = {
            "feature": feature,
            "threshold": np.concatenate(cols[1]).astype(np.float64),
            "left": left.astype(np.int64),
            "right": right.astype(np.int64),
            "value": np.concatenate(cols[4]).astype(np.float64),
        }
        return cls(nodes, offsets, combine, base, importances)

    def tree_predictions(self, x: np.ndarray) -> np.ndarray:
        """Every tree's prediction, shape (trees, samples)."""
        x = np.asarray(x, np.float64)
        if np.isnan(x).any():
            raise ValueError("features must not be NaN")
        if self.combine == "mean":
            x = x.astype(np.float32).astype(np.float64)
        feat, thr, left, right = (self.nodes[k] for k in ("feature", "threshold", "left", "right"))
        if x.shape[1] <= feat.max(initial=0):
            raise ValueError(f"the trees split on feature {feat.max()} but the samples have {x.shape[1]} features")
        node = np.repeat(self.roots[:, None], len(x), axis=1)
        samples = np.arange(len(x))[None, :]
        inner = left[node] >= 0
        while inner.any():
            go_left = x[samples, feat[node]] <= thr[node]
            node = np.where(inner, np.where(go_left, left[node], right[node]), node)
            inner = left[node] >= 0
        return self.nodes["value"][node]

    def predict(self, x: np.ndarray) -> np.ndarray:
        out = np.zeros(len(x)) + (self.base if self.combine == "sum" else 0.0)
        for z in self.tree_predictions(x):
            out += z
        return out / len(self.roots) if self.combine == "mean" else out

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}.{k}": v for k, v in self.nodes.items()} | {f"{prefix}.roots": self.roots}
        if self.feature_importances_ is not None:
            out[f"{prefix}.importances"] = np.asarray(self.feature_importances_, np.float64)
        return out


def _check_nodes(nodes: dict[str, np.ndarray], roots: np.ndarray) -> None:
    """Refuse node arrays a prediction could not walk to a leaf: every child lies after its parent
    (as both scikit-learn builders number them), so every walk ends."""
    n = len(nodes["value"])
    if any(v.ndim != 1 or len(v) != n for v in nodes.values()) or roots.ndim != 1 or len(roots) == 0:
        raise ValueError("tree arrays must be one-dimensional, of one length, with at least one tree")
    idx = np.arange(n)
    inner = nodes["left"] >= 0
    ok = (nodes["right"] >= 0) == inner
    for c in (nodes["left"], nodes["right"]):
        ok &= ~inner | ((c > idx) & (c < n))
    if not ok.all() or (nodes["feature"] < 0).any() or ((roots < 0) | (roots >= n)).any():
        raise ValueError("tree nodes are inconsistent: a child, root or feature index is out of range")


def _tree_predictions(m, x: np.ndarray) -> np.ndarray:
    """Per-tree predictions of a fitted forest or a loaded :class:`TreeEnsemble`."""
    if isinstance(m, TreeEnsemble):
        return m.tree_predictions(x)
    return np.stack([est.predict(x) for est in m.estimators_])


def _export(m, target: str, arrays: dict) -> dict:
    """Add ``m``'s arrays to ``arrays``; returns what :func:`_import` needs besides them."""
    if type(m).__module__.startswith("xgboost"):
        raw = bytes(m.get_booster().save_raw("json"))  # xgboost's own JSON model, no pickle
        arrays[f"{target}.xgboost_json"] = np.frombuffer(raw, np.uint8)
        return {"type": "xgboost"}
    e = m if isinstance(m, TreeEnsemble) else TreeEnsemble.from_regressor(m)
    arrays.update(e.arrays(target))
    return {"type": "trees", "combine": e.combine, "base": e.base}


def _import(spec: dict, target: str, z) -> object:
    if spec["type"] == "xgboost":
        try:
            import xgboost as xgb
        except ImportError as e:
            raise ValueError("its xgboost models need xgboost: pip install 'mlsyskit-sysprdict[xgboost]'") from e
        m = xgb.XGBRegressor()
        m.load_model(bytearray(z[f"{target}.xgboost_json"].tobytes()))
        return m
    if spec["type"] != "trees":
        raise ValueError(f"model type {spec['type']!r} is not known")
    nodes = {k: z[f"{target}.{k}"] for k in _NODE_FIELDS}
    imp = z[f"{target}.importances"] if f"{target}.importances" in z.files else None
    return TreeEnsemble(nodes, z[f"{target}.roots"], spec["combine"], spec["base"], imp)


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


def level_holdout(
    rows: list[dict], kinds: tuple[str, ...] = ("rf", "constant", "linear"), factors=HOLDOUT_FACTORS, seed: int = 0
) -> dict:
    """Leave one level out: for each factor and each of its levels, train on the rows at the other
    levels and predict the rows at that level (a configuration level the model never saw).  SMAPE
    per model and target over every held-out prediction, and per factor; a factor with fewer than
    two levels in the data cannot be held out and is listed as such."""
    out: dict = {"factors": {}, "not_varied": [], "models": {k: {} for k in kinds}}
    preds: dict[str, dict[str, list]] = {k: {t: [] for t in TARGETS} for k in kinds}
    truth: dict[str, list] = {t: [] for t in TARGETS}
    for f in factors:
        levels = sorted({r[f] for r in rows})
        if len(levels) < 2:
            out["not_varied"].append(f)
            continue
        per: dict[str, dict[str, list]] = {k: {t: [] for t in TARGETS} for k in kinds}
        ftrue: dict[str, list] = {t: [] for t in TARGETS}
        for lv in levels:
            train = [r for r in rows if r[f] != lv]
            test = [r for r in rows if r[f] == lv]
            for k in kinds:
                p = PerfModel(k, seed).fit(train).predict(test)
                for t in TARGETS:
                    per[k][t] += list(p[t])
            for t in TARGETS:
                ftrue[t] += [r[t] for r in test]
        out["factors"][f] = {
            "levels": levels,
            **{k: {t: smape(per[k][t], ftrue[t]) for t in TARGETS} for k in kinds},
        }
        for k in kinds:
            for t in TARGETS:
                preds[k][t] += per[k][t]
        for t in TARGETS:
            truth[t] += ftrue[t]
    if not out["factors"]:
        raise ValueError(f"rows: none of {list(factors)} has two or more levels to hold one out")
    for k in kinds:
        out["models"][k] = {t: smape(preds[k][t], truth[t]) for t in TARGETS}
    return out
