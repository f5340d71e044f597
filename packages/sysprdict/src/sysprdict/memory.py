"""Training-memory prediction by per-layer factorization (the paper's core idea).

Each layer of a `layers.Decomposition` contributes five factors:

  parameters     param numel x param dtype                  (ZeRO-3: / world size + one gathered layer)
                 (+ buffers, e.g. rotary tables or compressed experts stored as buffers, never sharded)
  gradients      param numel x param dtype                  (ZeRO-2/3: / world size; DDP adds buckets)
  optimizer      AdamW: 2 states x param dtype; SGD+momentum: 1   (ZeRO-1/2/3: / world size)
  activations    bytes autograd saves for backward, per dtype (with gradient checkpointing only the
                 block inputs, plus one block recomputed during its backward)
  temporaries    gradients of activations while a layer's backward runs (its output + its input),
                 and the optimizer's per-parameter temporaries (AdamW: 2 x, SGD: 1 x the largest parameter)

The peak is not the sum of the factors: it is assembled along the step's timeline, in execution
order.  Forward: activations accumulate layer by layer.  Backward, in reverse order: a layer's
gradients appear and its saved activations are freed.  Optimizer step: states plus temporaries.
The maximum over these events is the predicted peak (steady state: optimizer states already exist,
gradients were set to None by the previous step).  Activations scale linearly with the batch, so
`predict_for_batch` traces batch 1 and 2 once and extrapolates without re-tracing.
"""

from __future__ import annotations

import dataclasses
import logging

from .layers import Decomposition, LayerRecord

log = logging.getLogger(__name__)

__all__ = [
    "OPTIMIZER_STATES",
    "MemoryPrediction",
    "TrainSetup",
    "accelerate_style",
    "predict_memory",
    "with_overhead",
]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0}
STEP_SCALAR_BYTES = 4  # AdamW keeps a float32 `step` tensor per parameter tensor


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """What besides the model and shape decides training memory."""

    optimizer: str = "adamw"
    checkpointing: bool = False
    zero_stage: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer: {self.optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATES)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: {self.zero_stage!r} is not valid; use 0, 1, 2 or 3")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size: {self.world_size!r} is not valid; use a positive integer")


@dataclasses.dataclass
class MemoryPrediction:
    """Predicted peak bytes of one training step, its factors, and where on the timeline it occurs."""

    peak_bytes: float
    peak_event: str
    factors: dict[str, float]
    timeline: list[tuple[str, float]]
    per_layer: list[dict]
    tensor_peak_bytes: float | None = None
    """The tensors' own peak when `peak_bytes` includes the runtime overhead (`with_overhead`)."""
    runtime: dict | None = None

    def as_dict(self) -> dict:
        out = {"peak_bytes": self.peak_bytes, "peak_event": self.peak_event, "factors": self.factors}
        if self.tensor_peak_bytes is not None:
            out |= {"tensor_peak_bytes": self.tensor_peak_bytes, "runtime": self.runtime}
        return out


def _state_count(setup: TrainSetup) -> int:
    return OPTIMIZER_STATES[setup.optimizer]


def _param_tensors(d: Decomposition) -> int:
    # one step scalar per parameter tensor: approximated by layers with params x tensors per layer
    return sum(
        (1 if r.params else 0) + (1 if r.kind in ("linear", "conv", "norm") and r.params else 0) for r in d.records
    )


def _bwd_temp(r: LayerRecord) -> float:
    """Activation gradients alive while layer `r` runs backward: the gradient of its output plus the
    gradient of its input; for the loss (ops outside any module) the gradients of the log-softmax
    output and of the logits, both logits-sized."""
    if r.name.startswith("<") or not r.in_bytes:
        return 2.0 * r.max_out_bytes
    return float(r.max_out_bytes + r.in_bytes)


def predict_memory(d: Decomposition, setup: TrainSetup | None = None) -> MemoryPrediction:
    """Predicted peak training memory (bytes) of the decomposed model under `setup`."""
    setup = setup or TrainSetup()
    ws = setup.world_size if setup.zero_stage else 1
    recs = sorted(d.records, key=lambda r: r.order)
    param_b = float(d.param_bytes)
    grad_full = param_b  # gradients take the parameters' dtype (autocast casts them back)
    states = _state_count(setup)
    opt_b = states * param_b + (STEP_SCALAR_BYTES * _param_tensors(d) if setup.optimizer in ("adamw", "adam") else 0)

    params_live = param_b / ws if setup.zero_stage >= 3 else param_b
    if setup.zero_stage >= 3:
        params_live += max((r.param_bytes for r in recs), default=0)  # one layer gathered at a time
    opt_live = opt_b / ws if setup.zero_stage >= 1 else opt_b
    grad_div = ws if setup.zero_stage >= 2 else 1
    buckets = grad_full if (setup.world_size > 1 and setup.zero_stage == 0) else 0.0

    base = params_live + d.buffer_bytes + opt_live + d.input_bytes + buckets
    saved = {r.name: float(r.saved_total) for r in recs}
    blocks: dict[str, list[LayerRecord]] = {}
    for r in recs:
        if r.block:
            blocks.setdefault(r.block, []).append(r)
    if setup.checkpointing and blocks:
        for blk, members in blocks.items():
            keep = max((m.in_bytes for m in members if m.name == blk), default=0)
            for m in members:
                saved[m.name] = 0.0
            saved[members[0].name] = float(keep)

    timeline: list[tuple[str, float]] = []
    act = 0.0
    for r in recs:  # forward
        act += saved[r.name]
        timeline.append((f"fwd:{r.name}", base + act + r.max_out_bytes))
    act += d.held_output_bytes
    timeline.append(("fwd:end", base + act))

    grads = 0.0
    recomputed_block = None
    for r in reversed(recs):  # backward
        extra = 0.0
        if setup.checkpointing and r.block and r.block != recomputed_block:
            recomputed_block = r.block
            extra = float(sum(m.saved_total for m in blocks.get(r.block, [])))
        grads += r.param_bytes / grad_div
        temp = _bwd_temp(r)
        timeline.append((f"bwd:{r.name}", base + act + extra + grads + temp))
        act -= saved[r.name]
    act = max(act, 0.0)
    # single-tensor AdamW holds two parameter-sized temporaries (sqrt, then the divided denominator);
    # SGD with momentum one (the momentum update of the largest tensor)
    opt_temp = float(min(states, 2)) * d.largest_param_bytes
    timeline.append(("optimizer", base + act + grads + opt_temp))

    peak_event, peak = max(timeline, key=lambda e: e[1])
    factors = {
        "parameters": params_live,
        "gradients": grad_full / grad_div,
        "optimizer": opt_live,
        "activations": float(sum(saved.values()) + d.held_output_bytes),
        "temporaries": max(max((_bwd_temp(r) for r in recs), default=0.0), opt_temp),
        "inputs": float(d.input_bytes),
        "buffers": float(d.buffer_bytes),
        "ddp_buckets": buckets,
    }
    per_layer = [
        {
            "name": r.name,
            "kind": r.kind,
            "params": r.param_bytes,
            "activations": saved[r.name],
            "temporaries": _bwd_temp(r),
        }
        for r in recs
    ]
    return MemoryPrediction(float(peak), peak_event, factors, timeline, per_layer)


def accelerate_style(d: Decomposition, setup: TrainSetup | None = None) -> float:
    """The `accelerate estimate-memory` / DeepSpeed-estimator baseline: parameters, gradients and
    optimizer states only (batch 1, no activations, no temporaries)."""
    setup = setup or TrainSetup()
    p = float(d.param_bytes)
    return p + p + _state_count(setup) * p


def with_overhead(pred: MemoryPrediction, d: Decomposition, overhead) -> MemoryPrediction:
    """`pred` (the tensors' peak) raised to the process's real peak by a fitted
    `overhead.RuntimeOverhead`: framework baseline, allocator caching, expert-matmul workspace."""
    parts = overhead.predict(d, pred.peak_bytes)
    return dataclasses.replace(pred, peak_bytes=parts["total"], tensor_peak_bytes=pred.peak_bytes, runtime=parts)
