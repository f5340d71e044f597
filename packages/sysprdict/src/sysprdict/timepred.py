"""Precision-aware training-time prediction from per-layer features, plus a gradient all-reduce model.

Default model (`kind="opmix"`): step time = sum of non-negative costs of the step's work per op
class *at the dtype each op actually ran at* (`Decomposition.op_mix`; CPU autocast casts dense
matmuls and attention but leaves grouped expert matmuls, norms and the loss in fp32): matmul FLOPs,
fused-attention FLOPs, matmul calls and bytes moved by every other op, each per dtype, plus
dispatched ops, ops dispatched through autocast, optimizer bytes and parameter tensors.  A kernel
that no training family contains cannot get its cost from the data: the grouped (routed-experts)
matmul's cost per FLOP relative to a dense matmul is measured on this machine
(`calibrate_experts`).  Fit by non-negative least squares on relative error.  `kind="additive"`
(the previous default) has one block of costs (per op, matmul FLOP, byte, optimizer byte, layer)
per precision *setting*.  Additive models of work transfer to a held-out family, whose op mix
differs, better than trees over log features (which the `additive+trees` and `loglinear` kinds
add: a ridge trend in log space over per-kind features x precision, with gradient-boosted trees,
xgboost or scikit-learn's histogram boosting, on the residuals).  Data-parallel step time = compute time of the local
batch + ring all-reduce of the gradients (bytes at the gradient dtype; bandwidth and latency from an
`hwtopo.Link`, or the bandwidth the profiler measured).

Baselines in the same evaluation: the same model without precision features, on the static fp32
graph (precision-blind, like predictors built on static graphs), and
an analytical FLOPs-only estimate (total FLOPs / measured matmul FLOP/s).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from collections import defaultdict
from typing import Any

import numpy as np

from . import kernels as _kernels
from .layers import PRECISIONS, Decomposition, decompose
from .memory import OPTIMIZER_STATES
from .zoo import Shape, build

log = logging.getLogger(__name__)

__all__ = [
    "ELEMENTWISE_COST",
    "EXPERTS_MATMUL_COST",
    "AnalyticalFlops",
    "TimePredictor",
    "allreduce_time_s",
    "boosting_backend",
    "calibrate_elementwise",
    "calibrate_experts",
    "calibrate_matmul",
    "cpu_isa",
    "evaluate_holdout_families",
    "evaluate_split",
    "features",
    "mape",
    "opmix_terms",
]

_TREND = ("total_flops", "ops", "optimizer_work", "tokens")  # the log-linear trend's inputs
GROUPS = ("linear", "attention", "conv", "embedding", "norm", "activation")
_DECOMP_CACHE: dict[tuple, Decomposition] = {}


def boosting_backend() -> str:
    try:
        import xgboost  # noqa: F401

        return "xgboost"
    except ImportError:
        return "sklearn-hgb"


def _booster(seed: int = 0):
    if boosting_backend() == "xgboost":
        import xgboost as xgb

        return xgb.XGBRegressor(
            n_estimators=300, max_depth=3, learning_rate=0.05, subsample=0.9, n_jobs=1, random_state=seed
        )
    from sklearn.ensemble import HistGradientBoostingRegressor

    return HistGradientBoostingRegressor(max_depth=3, learning_rate=0.05, max_iter=300, random_state=seed)


def decomposition_for(row: dict) -> Decomposition:
    """The (cached) decomposition of a dataset row's model, local batch shape and precision."""
    key = (row["model"], row["batch"], row["seq_len"], row["image_size"], row["precision"])
    if key not in _DECOMP_CACHE:
        zm = build(row["model"], image_size=row["image_size"])
        _DECOMP_CACHE[key] = decompose(zm, Shape(row["batch"], row["seq_len"], row["image_size"]), row["precision"])
    return _DECOMP_CACHE[key]


def features(d: Decomposition, precision_aware: bool = True, optimizer: str = "adamw") -> dict[str, float]:
    """Per-kind layer features (x precision when `precision_aware`), plus the optimizer's update
    work (parameters x state tensors it reads and writes)."""
    kinds = d.by_kind()
    f: dict[str, float] = {}
    other: defaultdict[str, float] = defaultdict(float)
    for k, v in kinds.items():
        tgt = f if k in GROUPS else None
        if tgt is None:
            for key in ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "count"):
                other[key] += v.get(key, 0.0)
    for g in GROUPS:
        v = kinds.get(g, {})
        f[f"{g}_flops"] = math.log1p(v.get("fwd_flops", 0.0) + v.get("bwd_flops", 0.0))
        f[f"{g}_bytes"] = math.log1p(v.get("fwd_bytes", 0.0) + v.get("bwd_bytes", 0.0))
        f[f"{g}_count"] = v.get("count", 0.0)
    f["other_flops"] = math.log1p(other["fwd_flops"] + other["bwd_flops"])
    f["other_bytes"] = math.log1p(other["fwd_bytes"] + other["bwd_bytes"])
    f["ops"] = math.log1p(sum(r.ops for r in d.records))
    f["layers"] = float(len(d.records))
    f["tokens"] = math.log1p(d.tokens)
    f["saved"] = math.log1p(d.saved_bytes)
    states = OPTIMIZER_STATES.get(optimizer, 1)
    f["optimizer_states"] = float(states)
    f["optimizer_work"] = math.log1p(d.params * (1 + states))
    f["param_layers"] = float(sum(1 for r in d.records if r.params))
    f["params"] = math.log1p(d.params)
    total_flops = d.fwd_flops + d.bwd_flops
    f["total_flops"] = math.log1p(total_flops)
    if precision_aware:
        for p in PRECISIONS:
            on = float(d.precision == p)
            f[f"prec_{p}"] = on
            f[f"flops_x_{p}"] = on * math.log1p(total_flops)
            f[f"ops_x_{p}"] = on * f["ops"]
        f["param_dtype_bytes"] = float(d.param_dtype_bytes)
        f["compute_dtype_bytes"] = float(d.compute_dtype_bytes)
    return f


KINDS = ("opmix", "calibrated", "additive", "additive+trees", "loglinear")
"""calibrated: opmix with every matmul, convolution and fused attention costed by the fwd+bwd time
it took replayed on this machine at its exact shape and dtype (`kernels.kernel_seconds`; a matmul too
large to replay by the size table of `calibrate_matmul`), summed and scaled by one fitted factor
(`TimePredictor.kernel_in_step_factor`: in a step the operands come cold from memory and the time is
a median, while a replay keeps its quietest run; fixing the factor at 1 left that gap, and any load
the run's ground truth saw that the replays did not, to the other terms); the dispatched ops and
the other ops' bytes per dtype costed at this machine's measured elementwise costs
(`calibrate_elementwise`), with one fitted factor, and the remaining terms fitted beside them; opmix (the default): non-negative costs of the work per op class and executed dtype; additive: per-precision non-negative costs per op, matmul FLOP, byte moved and optimizer byte,
summed (the previous default; within run-to-run noise of opmix overall, worse on MoE); additive+trees: the same plus boosted
trees on the log residual; loglinear: a ridge trend on log features plus boosted residual trees."""
_LINEAR_COST_KINDS = ("opmix", "calibrated", "additive", "additive+trees")  # fitted as non-negative cost terms
_MATMUL_KINDS = ("linear", "conv", "attention", "experts")


class _NoResidual:
    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.zeros(len(x))


_ADDITIVE = ("ops", "matmul_flops", "other_bytes", "optimizer_work", "layers")


def additive_terms(d: Decomposition, optimizer: str = "adamw") -> dict[str, float]:
    """The step's work in natural units, for the additive (roofline-like) part of the predictor:
    dispatched ops (per-op overhead dominates small models on a CPU), matmul/conv/attention FLOPs,
    bytes moved by every other op, the optimizer's per-parameter work, and layers."""
    states = OPTIMIZER_STATES.get(optimizer, 1)
    return {
        "ops": float(sum(r.ops for r in d.records)),
        "matmul_flops": float(sum(r.fwd_flops + r.bwd_flops for r in d.records if r.kind in _MATMUL_KINDS)),
        "other_bytes": float(sum(r.fwd_bytes + r.bwd_bytes for r in d.records if r.kind not in _MATMUL_KINDS)),
        "optimizer_work": float(d.params * (1 + states) * d.param_dtype_bytes),
        "layers": float(len(d.records)),
    }


_DTYPES = ("float32", "bfloat16", "float16")
_MIX_TERMS = (
    *(f"mm_flops:{t}" for t in _DTYPES),
    *(f"sdpa_flops:{t}" for t in _DTYPES),
    *(f"mm_count:{t}" for t in _DTYPES),
    *(f"other_bytes:{t}" for t in _DTYPES),
    "ops",
    "ops_autocast",
    *(f"optimizer_bytes:{t}" for t in _DTYPES[:2]),
    "param_tensors",
)
EXPERTS_MATMUL_COST: dict[str, float] = {}
"""Cost of a grouped (routed-experts) matmul FLOP relative to a dense matmul FLOP at the same dtype,
measured on this machine (`calibrate_experts`); 1.0 where not measured."""


_EXPERT_SHAPES = ((128, 64, 128), (192, 96, 192), (128, 64, 64))
"""(token-slots, in, out) of the calibration grouped matmuls (expert projections of a few hundred
token-slots; not taken from any profiled model)."""


def _experts_ratio(dt, gmm, g, best, experts: int) -> float:
    """Geometric mean over `_EXPERT_SHAPES` of grouped / dense matmul forward + backward time."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    logs = []
    for s, k, n in _EXPERT_SHAPES:
        a = torch.randn(s, k, generator=g).to(dt).requires_grad_()
        w = torch.randn(experts, n, k, generator=g).to(dt).requires_grad_()
        dense = torch.randn(n, k, generator=g).to(dt).requires_grad_()
        go = torch.randn(s, n, generator=g).to(dt)
        # group sizes of a random (untrained) router: uneven, like the profiled steps' routing
        counts = torch.bincount(torch.randint(experts, (s,), generator=g), minlength=experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        t_g = best(lambda a=a, w=w, go=go, offs=offs: gmm(a, w.transpose(-2, -1), offs=offs).backward(go))
        t_d = best(lambda a=a, dense=dense, go=go: F.linear(a, dense).backward(go))
        logs.append(math.log(t_g / t_d))
    return float(math.exp(sum(logs) / len(logs)))


def calibrate_experts(repeats: int = 20, experts: int = 4) -> dict[str, float]:
    """Measure, on this machine, the forward+backward cost of a grouped (routed-experts) matmul
    relative to a dense matmul of the same FLOPs, per dtype (geometric mean over `_EXPERT_SHAPES`,
    minimum process CPU time over `repeats`).  Families without experts cannot teach the time
    model this kernel's cost, so it is measured directly; the result is stored in
    `EXPERTS_MATMUL_COST` and returned."""
    import time

    import torch
    import torch.nn.functional as F  # noqa: N812

    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is None:
        return {}

    def best(fn) -> float:
        fn()
        out = math.inf
        for _ in range(repeats):
            c = time.process_time()
            fn()
            out = min(out, time.process_time() - c)
        return max(out, 1e-7)

    g = torch.Generator().manual_seed(0)
    res: dict[str, float] = {}
    with _kernels.one_thread():
        for name in _DTYPES:
            res[name] = _experts_ratio(getattr(torch, name), gmm, g, best, experts)
    EXPERTS_MATMUL_COST.clear()
    EXPERTS_MATMUL_COST.update(res)
    return res


MATMUL_SECONDS: dict[str, list[tuple[float, float]]] = {}
"""Per dtype, (log FLOPs, log seconds per FLOP) of dense matmuls' forward + backward measured on this
machine (`calibrate_matmul`), sorted by FLOPs."""
_MM_CAL_SHAPES = tuple((m, k, n) for m in (32, 256, 1024) for k, n in ((64, 64), (128, 256), (256, 256), (512, 512)))
"""(rows, in, out) of the calibration matmuls: token counts and widths of the zoo and above
(not taken from any profiled or held-out model)."""


def cpu_isa() -> list[str]:
    """The matmul-relevant instruction-set extensions of this CPU (``hwtopo.probe().isa``): AMX and
    AVX-512 BF16/FP16 decide whether reduced precision is faster or slower than fp32 here."""
    return list(_probed_isa())


@functools.lru_cache(maxsize=1)
def _probed_isa() -> tuple[str, ...]:
    import hwtopo

    return hwtopo.probe(gpus=False).isa


def _best_cpu_s(fn, budget_s: float = 0.05, most: int = 20) -> float:
    """Minimum process CPU time of `fn` over repeats (at least 3, until `budget_s` is spent)."""
    import time

    fn()
    best, spent, n = math.inf, 0.0, 0
    while n < 3 or (spent < budget_s and n < most):
        c = time.process_time()
        fn()
        dt = time.process_time() - c
        best, spent, n = min(best, dt), spent + dt, n + 1
    return max(best, 1e-7)


def calibrate_matmul() -> dict[str, list[tuple[float, float]]]:
    """Measure dense matmul forward + backward (input and weight gradients) per dtype at
    `_MM_CAL_SHAPES` on this machine: the kernel speed per size that the CPU's ISA decides (AMX makes
    large bf16 matmuls fast, small ones gain nothing).  Stored in `MATMUL_SECONDS` and returned."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    g = torch.Generator().manual_seed(0)
    res: dict[str, list[tuple[float, float]]] = {}
    with _kernels.one_thread():
        for name in _DTYPES:
            dt = getattr(torch, name)
            pts = []
            for m, k, n in _MM_CAL_SHAPES:
                a = torch.randn(m, k, generator=g).to(dt).requires_grad_()
                w = torch.randn(n, k, generator=g).to(dt).requires_grad_()
                go = torch.randn(m, n, generator=g).to(dt)
                t = _best_cpu_s(lambda a=a, w=w, go=go: F.linear(a, w).backward(go))
                flops = 2.0 * m * k * n
                pts.append((math.log(flops), math.log(t / flops)))
            res[name] = sorted(pts)
    MATMUL_SECONDS.clear()
    MATMUL_SECONDS.update(res)
    return res


ELEMENTWISE_COST: dict[str, tuple[float, float]] = {}
"""Per dtype, (seconds per dispatched op, seconds per byte moved) of an elementwise op on this
machine at one thread (`calibrate_elementwise`)."""
_EW_CAL_SIZES = (256, 4096, 65536, 262144, 1048576)
"""Elements per operand of the calibration multiplies: from dispatch-bound to streaming sizes."""


def calibrate_elementwise() -> dict[str, tuple[float, float]]:
    """Measure an elementwise multiply per dtype at `_EW_CAL_SIZES` on this machine and fit its time
    as a per-op cost plus a per-byte cost (least squares on relative error).  The training models'
    op counts and bytes grow together, so a fit over them cannot tell the two costs apart, and one
    that puts the time on bytes over-predicts a larger model, whose ops move more bytes each; the
    measured split holds at any size.  Stored in `ELEMENTWISE_COST` and returned."""
    import torch

    g = torch.Generator().manual_seed(0)
    res: dict[str, tuple[float, float]] = {}
    with _kernels.one_thread():
        for name in _DTYPES:
            dt = getattr(torch, name)
            nbytes, secs = [], []
            for n in _EW_CAL_SIZES:
                a, b = (torch.randn(n, generator=g).to(dt) for _ in range(2))
                secs.append(_best_cpu_s(lambda a=a, b=b: torch.mul(a, b)))
                nbytes.append(3.0 * n * a.element_size())
            y = np.asarray(secs)
            design = np.column_stack([np.ones(len(y)), nbytes]) / y[:, None]
            per_op, per_byte = np.linalg.lstsq(design, np.ones(len(y)), rcond=None)[0]
            res[name] = (float(max(per_op, 1e-8)), float(max(per_byte, 0.0)))
    ELEMENTWISE_COST.clear()
    ELEMENTWISE_COST.update(res)
    return res


def _grid_seconds(dt: str, shape: str, table: dict[str, list[tuple[float, float]]]) -> float:
    """Forward + backward seconds of one dense matmul ("b:m:k:n") at dtype `dt`: its FLOPs x the
    measured seconds per FLOP at its size (log-interpolated in `table`)."""
    pts = table.get(dt) or table.get("float32")
    if not pts:
        raise ValueError("matmul calibration: empty; run calibrate_matmul() first")
    b, m, k, n = (int(x) for x in shape.split(":"))
    flops = 2.0 * b * m * k * n
    xs, ys = zip(*pts)
    return flops * math.exp(float(np.interp(math.log(flops), xs, ys)))


def matmul_seconds(d: Decomposition, table: dict[str, list[tuple[float, float]]]) -> float:
    """Forward + backward seconds of `d`'s dense matmuls at this machine's measured kernel speed:
    each matmul's FLOPs x the measured seconds per FLOP at its size (log-interpolated)."""
    total = 0.0
    for key, count in d.matmul_shapes.items():
        dt, shape = key.split(":", 1)
        total += count * _grid_seconds(dt, shape, table)
    return total


def opmix_terms(
    d: Decomposition, optimizer: str = "adamw", experts_cost: dict[str, float] | None = None
) -> dict[str, float]:
    """The step's work per op class at the dtype each op ran at (`Decomposition.op_mix`): matmul
    FLOPs (dense, fused attention, and grouped expert matmuls weighted by their measured relative
    cost) and matmul count per dtype, bytes moved by every other op per dtype, dispatched ops (and
    ops dispatched through autocast, which adds a cast check to each), optimizer bytes at the
    parameter dtype and parameter tensors (per-tensor optimizer overhead). `experts_cost` is the grouped
    matmul's relative cost per dtype (default: the process's `EXPERTS_MATMUL_COST`)."""
    cost = EXPERTS_MATMUL_COST if experts_cost is None else experts_cost
    mix = d.op_mix
    t: dict[str, float] = defaultdict(float, dict.fromkeys(_MIX_TERMS, 0.0))
    for key, v in mix.items():
        q, dt = key.split(":")
        cls, qty = q.rsplit("_", 1)
        dt = dt if dt in _DTYPES else "float32"
        if qty == "count":
            t["ops"] += v
        if cls in ("matmul", "sdpa", "experts"):
            if qty == "flops" and cls == "sdpa":  # fused attention: its own kernel, own cost per dtype
                t[f"sdpa_flops:{dt}"] += v
            elif qty == "flops":
                t[f"mm_flops:{dt}"] += v * (cost.get(dt, 1.0) if cls == "experts" else 1.0)
            elif qty == "count":
                t[f"mm_count:{dt}"] += v
        elif qty == "bytes":
            t[f"other_bytes:{dt}"] += v
    if d.precision in ("fp16", "mixed"):
        t["ops_autocast"] = t["ops"]
    states = OPTIMIZER_STATES.get(optimizer, 1)
    pdt = "bfloat16" if d.param_dtype_bytes == 2 else "float32"
    t[f"optimizer_bytes:{pdt}"] = float(d.params * (1 + states) * d.param_dtype_bytes)
    t["param_tensors"] = float(sum(1 for r in d.records if r.params)) * (1 + states)
    return t


_CAL_TERMS = (
    *(c for c in _MIX_TERMS if c != "ops" and not c.startswith("other_bytes:")),
    "elementwise_s",
    "mm_calibrated_s",  # last: `TimePredictor.kernel_in_step_factor` reads its coefficient
)


def calibrated_terms(
    d: Decomposition,
    optimizer: str,
    experts_cost: dict[str, float],
    table: dict[str, list[tuple[float, float]]],
    elementwise: dict[str, tuple[float, float]] | None = None,
) -> dict[str, float]:
    """`opmix_terms` with the heavy kernels taken out of the fitted terms and costed as measured on
    this machine: each replayable matmul, convolution and fused attention at its exact shape and
    dtype (`kernels.kernel_seconds`), a dense matmul too large to replay by the size-interpolated
    table (`_grid_seconds`); routed-expert FLOPs and unreplayed kernels keep their fitted terms.
    `elementwise_s`: the dispatched ops and the other ops' bytes per dtype at the measured
    elementwise costs (`elementwise`, default `ELEMENTWISE_COST`; the per-op cost is fp32's, as
    dispatch does not depend on the dtype)."""
    ew = ELEMENTWISE_COST if elementwise is None else elementwise
    t = opmix_terms(d, optimizer, experts_cost)
    if ew:
        per_byte = sum(t[f"other_bytes:{dt}"] * ew.get(dt, ew["float32"])[1] for dt in _DTYPES)
        t["elementwise_s"] = t["ops"] * ew["float32"][0] + per_byte
    measured = 0.0
    for spec, n in d.kernel_calls.items():
        info = _kernels.spec_info(spec)
        dt = info["dtype"] if info["dtype"] in _DTYPES else "float32"
        if _kernels.replayable(spec):
            measured += n * _kernels.kernel_seconds(spec)
        elif info["mm"]:
            measured += n * _grid_seconds(dt, info["mm"], table)
        else:
            continue
        cls = "sdpa_flops" if info["class"] == "sdpa" else "mm_flops"
        t[f"{cls}:{dt}"] = max(t[f"{cls}:{dt}"] - n * info["flops"], 0.0)
        t[f"mm_count:{dt}"] = max(t[f"mm_count:{dt}"] - n, 0.0)
    t["mm_calibrated_s"] = measured
    return t


def mape(pred, true) -> float:
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    return float(np.mean(np.abs(pred - true) / np.abs(true))) if len(true) else float("nan")


def allreduce_time_s(nbytes: float, world_size: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce: 2(p-1)/p of the bytes cross the slowest link, 2(p-1) latency hops."""
    if world_size <= 1:
        return 0.0
    p = world_size
    return 2 * (p - 1) / p * nbytes / bandwidth_bytes_per_s + 2 * (p - 1) * latency_s


def grad_bytes(d: Decomposition) -> float:
    """Bytes all-reduced per step: every parameter's gradient at the parameter dtype."""
    return float(d.params * d.param_dtype_bytes)


@dataclasses.dataclass
class TimePredictor:
    """Step-time regressor over layer features; `precision_aware=False` is the precision-blind baseline."""

    precision_aware: bool = True
    seed: int = 0
    kind: str = "opmix"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not known; use one of {list(KINDS)}")
        self._cols: list[str] = []
        # fitted sklearn/xgboost estimators (untyped libraries), None until fit
        self._ridge: Any = None
        self._trees: Any = None
        self._add: Any = None
        self._ranges: dict[str, tuple[float, float]] = {}
        self._experts_cost: dict[str, float] = {}  # the grouped-matmul cost the fit used, kept for predict
        self._mm_table: dict[str, list[tuple[float, float]]] = {}  # the dense matmul speeds it used
        self._elementwise: dict[str, tuple[float, float]] = {}  # and the elementwise costs
        self.isa: list[str] = []  # the CPU extensions of the machine the fit measured

    def _additive_matrix(self, ds: list[Decomposition], optimizers: list[str]) -> np.ndarray:
        """One block of additive terms per precision (precision-aware: every precision has its own
        cost per op, per FLOP, per byte) or one shared block (blind)."""
        if self.kind == "opmix":
            terms = (opmix_terms(d, o, self._experts_cost) for d, o in zip(ds, optimizers))
            return np.array([[t[k] for k in _MIX_TERMS] for t in terms])
        if self.kind == "calibrated":
            cal = (
                calibrated_terms(d, o, self._experts_cost, self._mm_table, self._elementwise)
                for d, o in zip(ds, optimizers)
            )
            return np.array([[t[k] for k in _CAL_TERMS] for t in cal])
        blocks = PRECISIONS if self.precision_aware else ("any",)
        out = np.zeros((len(ds), len(blocks) * len(_ADDITIVE)))
        for i, (d, o) in enumerate(zip(ds, optimizers)):
            t = additive_terms(d, o)
            b = blocks.index(d.precision) if self.precision_aware else 0
            out[i, b * len(_ADDITIVE) : (b + 1) * len(_ADDITIVE)] = [t[k] for k in _ADDITIVE]
        return out

    def _additive_fit(self, ds: list[Decomposition], y: np.ndarray, optimizers: list[str]) -> None:
        from sklearn.linear_model import LinearRegression

        a = self._additive_matrix(ds, optimizers)
        self._scale = np.maximum(a.max(axis=0), 1e-30)
        # non-negative costs, least squares on relative error (weights 1/y^2); for kind "calibrated"
        # the replayed kernels' seconds get one fitted factor too (`kernel_in_step_factor`)
        self._add = LinearRegression(positive=True, fit_intercept=False).fit(a / self._scale, y, sample_weight=1 / y**2)

    @property
    def kernel_in_step_factor(self) -> float | None:
        """Kind "calibrated": the fitted factor from the replayed kernels' seconds to their share of
        a step (the step's operands come cold from memory, its time is a median, not the quietest
        replay); None for other kinds or before fit."""
        if self.kind != "calibrated" or self._add is None:
            return None
        return float(self._add.coef_[-1] / self._scale[-1])

    def _additive_predict(self, ds: list[Decomposition], optimizers: list[str]) -> np.ndarray:
        return np.maximum(self._add.predict(self._additive_matrix(ds, optimizers) / self._scale), 1e-9)

    def _matrix(self, ds: list[Decomposition], optimizers: list[str] | None = None) -> np.ndarray:
        opts = optimizers or ["adamw"] * len(ds)
        rows = [features(d, self.precision_aware, o) for d, o in zip(ds, opts)]
        if not self._cols:
            self._cols = sorted(rows[0])
        return np.array([[r.get(c, 0.0) for c in self._cols] for r in rows])

    def fit(self, ds: list[Decomposition], times_s: list[float], optimizers: list[str] | None = None) -> TimePredictor:
        from sklearn.linear_model import Ridge

        self._cols = []
        opts = optimizers or ["adamw"] * len(ds)
        x = self._matrix(ds, opts)
        y = np.log(np.asarray(times_s, float))
        if self.kind in ("opmix", "calibrated") and not EXPERTS_MATMUL_COST:
            calibrate_experts()  # once per process: the grouped expert matmul's cost on this machine
        if self.kind == "calibrated" and not MATMUL_SECONDS:
            calibrate_matmul()  # once per process: dense matmul speed per size and dtype here
        if self.kind == "calibrated" and not ELEMENTWISE_COST:
            calibrate_elementwise()
        # predictions use the costs this fit saw, even if the process recalibrates later
        self._experts_cost = dict(EXPERTS_MATMUL_COST)
        self._mm_table = dict(MATMUL_SECONDS)
        self._elementwise = dict(ELEMENTWISE_COST)
        self.isa = cpu_isa()
        if self.kind in _LINEAR_COST_KINDS:
            self._additive_fit(ds, np.asarray(times_s, float), opts)
            trend = np.log(self._additive_predict(ds, opts))
        else:
            self._trend_idx = [
                i for i, c in enumerate(self._cols) if c in _TREND or c.startswith(("prec_", "flops_x_", "ops_x_"))
            ]
            self._ridge = Ridge(alpha=1.0).fit(x[:, self._trend_idx], y)
            trend = self._ridge.predict(x[:, self._trend_idx])
        self._trees = (
            _booster(self.seed).fit(x, y - trend)
            if self.kind.endswith("trees") or self.kind == "loglinear"
            else _NoResidual()
        )
        self._ranges = {c: (float(x[:, i].min()), float(x[:, i].max())) for i, c in enumerate(self._cols)}
        return self

    def predict(self, ds: list[Decomposition], optimizers: list[str] | None = None) -> np.ndarray:
        """Predicted compute step time (s) of each decomposition; warns outside the training range."""
        if self._trees is None:
            raise RuntimeError("TimePredictor.predict called before fit")
        opts = optimizers or ["adamw"] * len(ds)
        x = self._matrix(ds, opts)
        if self.isa and cpu_isa() != self.isa:
            warnings.warn(
                f"predicting on a CPU with extensions {cpu_isa()}; the predictor was fitted on {self.isa} "
                "(reduced-precision speed depends on them)",
                stacklevel=2,
            )
        for name in ("total_flops", "params", "tokens"):
            i = self._cols.index(name)
            lo, hi = self._ranges[name]
            span = max(hi - lo, 1e-9)
            if (x[:, i] < lo - 0.05 * span).any() or (x[:, i] > hi + 0.05 * span).any():
                warnings.warn(
                    f"predicting for {name} outside the training range [{math.expm1(lo):.3g}, {math.expm1(hi):.3g}]",
                    stacklevel=2,
                )
        if self.kind in _LINEAR_COST_KINDS:
            trend = np.log(self._additive_predict(ds, opts))
        else:
            trend = self._ridge.predict(x[:, self._trend_idx])
        return np.exp(trend + self._trees.predict(x))

    def predict_step(
        self, d: Decomposition, world_size: int = 1, link=None, bandwidth_bytes_per_s=None, optimizer: str = "adamw"
    ) -> float:
        """Data-parallel step time: compute of the local batch + gradient all-reduce over `link`
        (an hwtopo.Link) or `bandwidth_bytes_per_s`."""
        t = float(self.predict([d], [optimizer])[0])
        if world_size > 1:
            bw = link.bandwidth_bytes_per_s if link is not None else bandwidth_bytes_per_s
            lat = link.latency_s if link is not None else 0.0
            if not bw:
                raise ValueError("bandwidth: give an hwtopo link or bandwidth_bytes_per_s for world_size > 1")
            t += allreduce_time_s(grad_bytes(d), world_size, bw, lat)
        return t


@dataclasses.dataclass
class AnalyticalFlops:
    """FLOPs-only baseline: (forward + backward FLOPs) / the machine's measured matmul FLOP/s."""

    flops_per_s: float

    def predict(self, ds: list[Decomposition]) -> np.ndarray:
        return np.array([(d.fwd_flops + d.bwd_flops) / self.flops_per_s for d in ds])


def _fit_predict(
    train: list[dict], test: list[dict], analytical: AnalyticalFlops, seed: int, target: str, kind: str | None
) -> tuple[dict[str, list], TimePredictor]:
    """Train the precision-aware and precision-blind predictors on `train`, predict `test` with
    them and with the analytical baseline."""
    kw = {"kind": kind} if kind else {}
    otrain = [r.get("optimizer", "adamw") for r in train]
    otest = [r.get("optimizer", "adamw") for r in test]
    ytrain = [r[target] for r in train]
    aware = TimePredictor(True, seed, **kw).fit([decomposition_for(r) for r in train], ytrain, otrain)
    # the precision-blind baseline sees the static fp32 graph (as precision-unaware predictors do)
    blind = TimePredictor(False, seed, **kw).fit(
        [decomposition_for({**r, "precision": "fp32"}) for r in train], ytrain, otrain
    )
    dtest = [decomposition_for(r) for r in test]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preds = {
            "aware": list(aware.predict(dtest, otest)),
            "blind": list(blind.predict([decomposition_for({**r, "precision": "fp32"}) for r in test], otest)),
            "analytical": list(analytical.predict(dtest)),
        }
    return preds, aware


def _summarize(preds: dict[str, list], truth: list[float], meta: list[dict], target: str) -> dict:
    fams = sorted({m["family"] for m in meta})
    out: dict = {"backend": boosting_backend(), "target": target, "n_rows": len(truth), "families": fams}
    for name, p in preds.items():
        out[name] = {
            "mape": mape(p, truth),
            "per_family": {f: mape(*_sel(p, truth, meta, "family", f)) for f in fams},
            "per_precision": {
                q: mape(*_sel(p, truth, meta, "precision", q))
                for q in PRECISIONS
                if any(m["precision"] == q for m in meta)
            },
        }
    out["points"] = [
        {
            "model": m["model"],
            "family": m["family"],
            "precision": m["precision"],
            "batch": m["batch"],
            "true": t,
            "pred": float(p),
        }
        for m, t, p in zip(meta, truth, preds["aware"])
    ]
    return out


def evaluate_split(
    train: list[dict],
    test: list[dict],
    flops_per_s: float,
    seed: int = 0,
    target: str = "step_cpu_s",
    kind: str | None = None,
) -> dict:
    """Train on the `train` rows, report on the `test` rows (a leave-architecture-out or a size
    split): MAPE overall, per family and per precision, for the precision-aware, precision-blind
    and analytical predictors."""
    train = [r for r in train if r.get(target) and r["world_size"] == 1]
    test = [r for r in test if r.get(target) and r["world_size"] == 1]
    if not train or not test:
        raise ValueError(f"rows: need training and test rows with {target!r} (got {len(train)} and {len(test)})")
    preds, aware = _fit_predict(train, test, AnalyticalFlops(flops_per_s), seed, target, kind)
    out = _summarize(preds, [r[target] for r in test], test, target)
    out["train_families"] = sorted({r["family"] for r in train})
    if aware.kernel_in_step_factor is not None:
        out["kernel_in_step_factor"] = aware.kernel_in_step_factor
    return out


def evaluate_holdout_families(
    rows: list[dict], flops_per_s: float, seed: int = 0, target: str = "step_cpu_s", kind: str | None = None
) -> dict:
    """Leave-one-family-out: for each family, train on all other families' single-process rows and
    predict its rows.  Data-parallel rows are predicted by the model trained without their family
    plus the all-reduce model at the bandwidth measured in that run.  MAPE per family, per
    precision, and overall for the precision-aware, precision-blind and analytical predictors.
    Zoo families share components (a LLaVA's decoder is a Llama), so this split is not held out
    in the strict sense; `evaluate_split` with a component-disjoint split is."""
    rows = [r for r in rows if r.get(target)]
    single = [r for r in rows if r["world_size"] == 1]
    fams = sorted({r["family"] for r in single})
    if len(fams) < 2:
        raise ValueError("rows: need at least two model families to hold one out")
    preds: dict[str, list] = {"aware": [], "blind": [], "analytical": []}
    truth, meta = [], []
    dp_pred, dp_true = [], []
    analytical = AnalyticalFlops(flops_per_s)
    for fam in fams:
        test = [r for r in single if r["family"] == fam]
        p, aware = _fit_predict([r for r in single if r["family"] != fam], test, analytical, seed, target, kind)
        for k in preds:
            preds[k] += p[k]
        for r in rows:
            if r["world_size"] > 1 and r["family"] == fam:
                dp_pred.append(
                    aware.predict_step(
                        decomposition_for(r),
                        r["world_size"],
                        bandwidth_bytes_per_s=r["allreduce_bandwidth_bytes_per_s"],
                        optimizer=r.get("optimizer", "adamw"),
                    )
                )
                dp_true.append(r[target])
        truth += [r[target] for r in test]
        meta += test
    out = _summarize(preds, truth, meta, target)
    if dp_true:
        out["data_parallel"] = {"mape": mape(dp_pred, dp_true), "n_rows": len(dp_true)}
    return out


def _sel(pred, truth, meta, key, val):
    idx = [i for i, m in enumerate(meta) if m[key] == val]
    return [pred[i] for i in idx], [truth[i] for i in idx]
