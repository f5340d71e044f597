"""Real peak memory = the tensors the step keeps alive + what the runtime adds around them.

`memory.predict_memory` assembles the peak of the tensors themselves (parameters, gradients,
optimizer state, autograd's saved activations, temporaries) along the step's timeline.  The process
pays more: the framework's lazily created state on the first step (kernel libraries' scratch and
caches, which differ between fp32, bf16 weights and autocast), and the allocator's caching and
rounding (freed blocks glibc keeps and cannot reuse for a larger request), which grows with the
bytes that pass through it.  `RuntimeOverhead` models

    real peak = baseline[precision group] + tensor_factor x tensor peak
                + experts_factor x bytes the grouped (routed-experts) matmuls move at bf16
                + per_kernel x distinct heavy-kernel shapes + per_param_layer x parameterised layers
The last two are state the runtime keeps per distinct matmul/convolution/attention shape (kernel
libraries cache a primitive, its generated code and scratch per shape) and per layer that owns
parameters (autograd's gradient accumulators, the optimizer's per-tensor state, the module objects);
they were chosen over layer, op and call counts by leave-one-family-out error on the training
families.

with non-negative terms fitted (relative error, one robust refit without gross outliers) only on
training configurations measured by `groundtruth`.  `margin` is the largest under-prediction the
fit leaves on those training configurations (measured / predicted - 1), the safety margin the OoM
guard keeps.

A fitted overhead belongs to the machine and software it was measured on: it records them, and
`RuntimeOverhead.load` refuses one measured elsewhere (a stale calibration would mislead).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
from pathlib import Path

import numpy as np

from .layers import Decomposition

log = logging.getLogger(__name__)

__all__ = ["PRECISION_GROUPS", "RuntimeOverhead", "fit_overhead", "precision_group", "software_key"]

PRECISION_GROUPS = ("fp32", "bf16", "autocast")
"""fp32 weights; bf16 weights; autocast (fp16 autocast or bf16 mixed precision over fp32 weights)."""
_TERMS = ("tensor_factor", "experts_factor", "per_kernel", "per_param_layer")


def precision_group(precision: str) -> str:
    """The framework-baseline group of a precision setting."""
    return {"fp32": "fp32", "bf16": "bf16", "fp16": "autocast", "mixed": "autocast"}[precision]


def software_key() -> dict:
    """What a calibration depends on: machine, Python, torch, transformers, sysprdict."""
    import torch
    import transformers

    from . import __version__

    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sysprdict": __version__,
    }


def _experts_bytes(d: Decomposition) -> float:
    return float(d.op_mix.get("experts_bytes:bfloat16", 0.0))


def _counts(d: Decomposition) -> tuple[float, float]:
    """(distinct heavy-kernel shapes, layers that own parameters) of `d`."""
    return float(len(d.kernel_calls)), float(sum(1 for r in d.records if r.params))


def _row_features(d: Decomposition, tensor_peak: float) -> list[float]:
    g = precision_group(d.precision)
    return [float(g == p) for p in PRECISION_GROUPS] + [float(tensor_peak), _experts_bytes(d), *_counts(d)]


@dataclasses.dataclass
class RuntimeOverhead:
    """The fitted runtime terms (see the module docstring)."""

    baseline: dict[str, float]
    tensor_factor: float
    experts_factor: float
    margin: float
    n_fit: int
    fitted_on: list[str]
    software: dict = dataclasses.field(default_factory=dict)
    allocator: str = "cpu"
    """Whose peak it predicts: "cpu" (the process's RSS) or "cuda" (the caching allocator's reserved
    bytes, whose block rounding and caching the same terms absorb)."""
    per_kernel: float = 0.0
    per_param_layer: float = 0.0

    def predict(self, d: Decomposition, tensor_peak: float) -> dict[str, float]:
        """The real peak of `d` (whose tensor peak is `tensor_peak`) and its parts."""
        g = precision_group(d.precision)
        parts = {
            "tensors": float(tensor_peak),
            "framework_baseline": self.baseline.get(g, max(self.baseline.values())),
            "allocator": (self.tensor_factor - 1.0) * float(tensor_peak),
            "experts_workspace": self.experts_factor * _experts_bytes(d),
            "per_kernel_and_layer": float(np.dot([self.per_kernel, self.per_param_layer], _counts(d))),
        }
        parts["total"] = sum(parts.values())
        return parts

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        import hwtopo

        hwtopo.atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike, check_software: bool = True) -> RuntimeOverhead:
        """Read a calibration; one measured on another machine or software is refused."""
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
            obj = cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"calibration {str(p)!r} is not a sysprdict runtime-overhead file: {e}") from None
        if check_software:
            now = software_key()
            diff = [k for k in now if obj.software.get(k) != now[k]]
            if diff:
                raise ValueError(
                    f"calibration {str(p)!r} was measured with a different {', '.join(diff)} "
                    f"({', '.join(f'{k}={obj.software.get(k)}' for k in diff)}); run `sysprdict calibrate` again"
                )
        return obj


def _nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (weights 1 / y^2)."""
    from sklearn.linear_model import LinearRegression

    scale = np.maximum(a.max(axis=0), 1e-30)
    reg = LinearRegression(positive=True, fit_intercept=False).fit(a / scale, y, sample_weight=1.0 / y**2)
    return reg.coef_ / scale


def fit_overhead(
    decomps: list[Decomposition], tensor_peaks: list[float], measured: list[float], allocator: str = "cpu"
) -> RuntimeOverhead:
    """Fit the runtime terms on training configurations: their decompositions, predicted tensor
    peaks and measured real peaks (`groundtruth` CPU peaks).  After a first fit, configurations
    the fit misses by more than 3x the median relative error (at least 5%) are left out and the
    terms refitted, so one odd configuration does not set the terms for all."""
    if not decomps or not (len(decomps) == len(tensor_peaks) == len(measured)):
        raise ValueError("fit_overhead: need equally many decompositions, tensor peaks and measurements (>= 1)")
    a = np.array([_row_features(d, t) for d, t in zip(decomps, tensor_peaks)])
    y = np.asarray(measured, float)
    if (y <= 0).any():
        raise ValueError("measured: every real peak must be > 0 bytes")
    if allocator not in ("cpu", "cuda"):
        raise ValueError(f"allocator: {allocator!r} is not valid; use 'cpu' or 'cuda'")
    c = _nnls_relative(a, y)
    keep = np.ones(len(y), bool)
    for _ in range(3):  # an outlier the first fit partly absorbed shows once the others are fitted
        err = np.abs(a @ c / y - 1)
        nxt = err <= max(3 * float(np.median(err[keep])), 0.05)
        if nxt.sum() < a.shape[1] or (nxt == keep).all():
            break
        keep = nxt
        c = _nnls_relative(a[keep], y[keep])
    under = y / np.maximum(a @ c, 1.0) - 1  # > 0 where the fit predicts less than was measured
    k = len(PRECISION_GROUPS)
    present = {p for d in decomps for p in [precision_group(d.precision)]}
    return RuntimeOverhead(
        baseline={p: float(c[i]) for i, p in enumerate(PRECISION_GROUPS) if p in present},
        tensor_factor=float(c[k]),
        experts_factor=float(c[k + 1]),
        per_kernel=float(c[k + 2]),
        per_param_layer=float(c[k + 3]),
        margin=float(max(under.max(), 0.0)),
        n_fit=len(y),
        fitted_on=sorted({d.model for d in decomps}),
        software=software_key(),
        allocator=allocator,
    )
