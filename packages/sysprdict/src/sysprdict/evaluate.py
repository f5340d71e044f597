"""The side-by-side evaluation behind `sysprdict bench` and `sysprdict demo`.

1. Profile a grid of real training steps (or read a dataset file).
2. Time: hold out each model family; precision-aware vs precision-blind vs analytical FLOPs-only.
3. Memory: the factorized predictor vs the accelerate-style estimate (params/grads/optimizer only)
   against MemTracker's measured peak, on multimodal models (the predictor is analytical: it never
   saw these models) and on all models.
4. OoM guard: the largest batch predicted to fit a limit is then run for real; a measured peak above
   the limit is a violation.
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np

import hwtopo

from .memory import TrainSetup, accelerate_style, predict_memory
from .profile import GridPoint, default_grid, profile_grid
from .timepred import boosting_backend, calibrate_experts, decomposition_for, evaluate_holdout_families, mape
from .train import measure_training
from .zoo import Shape, build

log = logging.getLogger(__name__)

__all__ = ["GUARD_CASES", "evaluate_memory", "evaluate_oom_guard", "run_evaluation"]

STEPS, ROUNDS = 4, 4
"""Timed steps per point in each of the interleaved timing passes over the grid (min CPU time kept)."""
GUARD_CASES = [("llava-clip-s", "8MiB"), ("llava-siglip-s", "10MiB"), ("llama-m", "12MiB"), ("vit-m", "6MiB")]


def evaluate_memory(rows: list[dict]) -> dict:
    """Predicted vs measured peak for every single-process row that has a measured peak."""
    pts = []
    for r in rows:
        if r["world_size"] != 1 or not r["peak_bytes"]:
            continue
        d = decomposition_for(r)
        setup = TrainSetup(r["optimizer"], r["checkpointing"])
        pred = predict_memory(d, setup)
        pts.append(
            {
                "model": r["model"],
                "family": r["family"],
                "modality": r["modality"],
                "precision": r["precision"],
                "batch": r["batch"],
                "true": r["peak_bytes"],
                "pred": pred.peak_bytes,
                "accelerate_style": accelerate_style(d, setup),
                "peak_event": pred.peak_event,
            }
        )

    def _m(sel, key="pred"):
        return mape([p[key] for p in sel], [p["true"] for p in sel])

    mm = [p for p in pts if p["modality"] == "multimodal"]
    return {
        "mape_multimodal": _m(mm),
        "mape_multimodal_accelerate_style": _m(mm, "accelerate_style"),
        "mape_all": _m(pts),
        "mape_all_accelerate_style": _m(pts, "accelerate_style"),
        "per_modality": {m: _m([p for p in pts if p["modality"] == m]) for m in sorted({p["modality"] for p in pts})},
        "per_family": {f: _m([p for p in pts if p["family"] == f]) for f in sorted({p["family"] for p in pts})},
        "per_precision": {
            q: _m([p for p in pts if p["precision"] == q]) for q in sorted({p["precision"] for p in pts})
        },
        "n_rows": len(pts),
        "n_multimodal": len(mm),
        "points": pts,
    }


def evaluate_oom_guard(cases=GUARD_CASES, seq_len: int = 32, margin: float = 0.1) -> dict:
    """Fit each model into its limit, then train at that batch and compare the measured peak."""
    from .fit import largest_batch

    out = []
    for name, limit in cases:
        fit = largest_batch(name, limit, seq_len=seq_len, margin=margin)
        measured = 0
        if fit.fits:
            res = measure_training(
                build(name), Shape(fit.batch, seq_len, 32), fit.precision, fit.optimizer, fit.checkpointing, steps=1
            )
            measured = res.peak_bytes
        out.append(
            {
                **fit.as_dict(),
                "measured_peak_bytes": measured,
                "violation": bool(fit.fits and measured > fit.limit_bytes),
                "pred_error": (fit.predicted_peak_bytes / measured - 1) if measured else None,
            }
        )
    return {"cases": out, "violations": sum(c["violation"] for c in out), "margin": margin}


def run_evaluation(
    quick: bool = True, rows: list[dict] | None = None, progress: bool = True, points: list[GridPoint] | None = None
) -> dict:
    """Everything `bench` reports; `rows` skips profiling (a dataset read from a file)."""
    t0 = time.perf_counter()
    if rows is None:
        rows = profile_grid(points or default_grid(quick), steps=STEPS, progress=progress, rounds=ROUNDS)
    t_profile = time.perf_counter() - t0
    mm = hwtopo.matmul_flops(256, threads=1, seconds=0.3)
    experts_cost = calibrate_experts()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timing = evaluate_holdout_families(rows, mm.flops)
    memory = evaluate_memory(rows)
    guard = evaluate_oom_guard(GUARD_CASES[:3] if quick else GUARD_CASES)
    headline = {
        "time_mape": timing["aware"]["mape"],
        "time_mape_precision_blind": timing["blind"]["mape"],
        "time_mape_analytical_flops": timing["analytical"]["mape"],
        "mem_mape": memory["mape_multimodal"],
        "mem_mape_accelerate_style": memory["mape_multimodal_accelerate_style"],
        "mem_mape_all_models": memory["mape_all"],
        "oom_guard_violations": guard["violations"],
    }
    single = [r for r in rows if r["world_size"] == 1]
    ratios = [r["step_cpu_s"] for r in single if r["precision"] == "fp16"]
    fp32 = {(r["model"], r["batch"]): r["step_cpu_s"] for r in single if r["precision"] == "fp32"}
    slow = [
        r["step_cpu_s"] / fp32[(r["model"], r["batch"])]
        for r in single
        if r["precision"] == "fp16" and (r["model"], r["batch"]) in fp32
    ]
    return {
        "rows": rows,
        "timing": timing,
        "memory": memory,
        "oom_guard": guard,
        "headline": headline,
        "config": {
            "quick": quick,
            "grid_points": len(rows),
            "families": sorted({r["family"] for r in rows}),
            "precisions": sorted({r["precision"] for r in rows}),
            "time_target": timing["target"],
            "timing": f"min process CPU time over {ROUNDS} interleaved passes x {STEPS} steps per point",
            "boosting_backend": boosting_backend(),
            "matmul_flops_per_s": mm.flops,
            "experts_matmul_cost_measured": experts_cost,
            "fp16_autocast_slowdown_median": float(np.median(slow)) if slow and ratios else None,
            "profile_wall_s": t_profile,
            "eval_wall_s": time.perf_counter() - t0 - t_profile,
        },
    }
