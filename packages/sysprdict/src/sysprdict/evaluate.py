"""The side-by-side evaluation behind `sysprdict bench` and `sysprdict demo`.

1. Measure every configuration in its own process (`groundtruth`: real peak RSS, median step
   time, one thread), or read a dataset file.  Roles: the training families (those sharing no
   component with a held-out architecture, `split.strict_split`) at small sizes, some of them at
   the larger size, and the held-out architectures at a small and the larger size.
2. Time, leave-architecture-out: trained on the training families, reported on the held-out
   architectures; size extrapolation: trained on the small sizes, reported on the larger one;
   precision-aware vs precision-blind vs analytical FLOPs-only.
3. Memory: the runtime overhead fitted on the training families' real peaks, the held-out
   architectures' real peaks predicted (tensors + runtime), beside tensors-only and
   accelerate-style (params/grads/optimizer only) estimates.
4. OoM guard: the largest batch predicted to fit a limit is then run for real in a fresh process; a
   real peak above the limit is a violation.

The tensor-accounting self-check (predictor vs MemTracker) and the family hold-out among zoo
families (which share components) are reported as diagnostics under names that say so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from typing import Any

import hwtopo

from .kernels import KERNEL_SECONDS, time_kernels
from .memory import TrainSetup, accelerate_style, predict_memory, with_overhead
from .names import HELDOUT_FAMILIES, MODALITY, parse_model_name
from .timepred import (
    ELEMENTWISE_COST,
    MATMUL_SECONDS,
    boosting_backend,
    calibrate_elementwise,
    calibrate_experts,
    calibrate_matmul,
    cpu_isa,
    decomposition_for,
    evaluate_holdout_families,
    mape,
)
from .train import measure_training
from .zoo import Shape, build

log = logging.getLogger(__name__)

__all__ = [
    "GUARD_CASES",
    "RSS_GUARD_CASES",
    "evaluate_memory",
    "evaluate_memory_rss",
    "evaluate_oom_guard",
    "evaluate_oom_guard_rss",
    "fit_runtime_overhead",
    "overhead_from_rows",
    "harness_plan",
    "measure_plan",
    "run_evaluation",
]

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


SIZE_EXTRAP_FAMILIES = ("llama", "gpt2", "vit")
"""Training families also measured at the extrapolation size (the size-extrapolation test set)."""
XL: dict[str, Any] = {"size": "xl", "batch": 4, "seq_len": 128, "image_size": 96}
"""The larger test size: hidden 256, 4 layers, batch 4, 128 text tokens, 96-pixel images (144
patches): above every training size in width, batch and tokens."""
RSS_GUARD_CASES = [("gpt-neox-m", "64MiB"), ("dinov2-m", "56MiB"), ("opt-m", "72MiB"), ("llava-dinov2-phi-m", "96MiB")]
"""OoM-guard cases on held-out architectures (limits set before any measurement)."""
GUARD_SEQ = 128
TIME_KIND = "calibrated"
"""The time predictor the bench reports: every matmul, convolution and fused attention costed as
replayed on this machine at its exact shape and dtype (`kernels`; the CPU's ISA decides the speed),
the other work by costs fitted on the training rows."""


def harness_plan(quick: bool = True, train_families: list[str] | None = None) -> list[dict]:
    """The configurations the bench measures, one process each, with their role: "train" (the
    component-disjoint training families at the zoo's small sizes), "extrap" (some training
    families at the larger size: the size-extrapolation test, and memory training), "heldout"
    (the held-out architectures at a small and the larger size)."""
    from .split import strict_split

    fams = train_families or strict_split()[0]
    precs = ["fp32", "bf16", "fp16"] if quick else ["fp32", "bf16", "fp16", "mixed"]
    small = ["s", "m"] if quick else ["s", "m", "l"]
    plan: list[dict] = []

    def add(role: str, fam: str, size: str, batch: int, seq: int, image: int) -> None:
        group = len(plan) // len(precs)
        for i, p in enumerate(precs):
            # alternate so every precision runs with both optimizers across models: tied to the
            # precision, a precision's elementwise cost and the optimizer's could not be told apart
            opt = "sgd" if (group + i) % 2 == 0 else "adamw"
            plan.append(
                {"role": role, "model": f"{fam}-{size}", "batch": batch, "seq_len": seq, "image_size": image}
                | {"precision": p, "optimizer": opt}
            )

    for fam in fams:
        for size in small:
            add("train", fam, size, 2, 32 if size == "s" else 48, 32)
    for fam in SIZE_EXTRAP_FAMILIES:
        add("extrap", fam, XL["size"], XL["batch"], XL["seq_len"], XL["image_size"])
    for fam in HELDOUT_FAMILIES:
        add("heldout", fam, "m", 2, 48, 32)
        add("heldout", fam, XL["size"], XL["batch"], XL["seq_len"], XL["image_size"])
    return plan


GT_STEPS, GT_MIN_TIME_S = 5, 0.3
"""Timed steps per configuration after its warm-up step: at least 5 (on a shared machine a burst
of load slows a few steps, and the median of 5 moves only when 3 of them are slow), and more until
they used 0.3 s of CPU time: between two runs of the bench, 5-15 ms steps' medians differed by
7-9%, 0.1-0.4 s steps' by 3%."""


def measure_plan(
    plan: list[dict],
    progress: bool = True,
    steps: int = GT_STEPS,
    device: str = "cpu",
    min_time_s: float = GT_MIN_TIME_S,
) -> list[dict]:
    """Measure every planned configuration in its own process (`groundtruth`) into dataset rows."""
    import platform

    import torch

    from hwtopo import console

    from .groundtruth import measure

    rows = []
    bar = console.progress(total=len(plan), desc="ground truth", quiet=not progress)
    for c in plan:
        kw = {k: c[k] for k in ("model", "batch", "seq_len", "image_size", "precision", "optimizer")}
        m = measure(
            "sysprdict.groundtruth:training_step",
            kw,
            steps=steps,
            min_time_s=min_time_s,
            diagnostic=c["role"] == "train" and c["model"].endswith("-s"),
            # refused before it starts if even its tensors would not fit this machine
            predicted_bytes=_tensor_peak(c)[1].peak_bytes,
            device=device,
        )
        family, size = parse_model_name(c["model"])
        rows.append(
            {
                **c,
                "checkpointing": False,
                "world_size": 1,
                "family": family,
                "size": size,
                "modality": MODALITY[family],
                "step_time_s": m.step_time_s,
                "step_cpu_s": m.step_cpu_s,
                "step_times_s": m.step_times_s,
                "rss_peak_bytes": m.cpu_peak_bytes,
                "device": device,
                "gpu_max_reserved_bytes": m.gpu_max_reserved_bytes,
                "gpu_max_allocated_bytes": m.gpu_max_allocated_bytes,
                "peak_bytes": m.tensor_accounting_bytes or 0,
                "threads": m.threads,
                "host": platform.node(),
                "torch": torch.__version__,
                "emulated": False,
            }
        )
        bar.update(1)
    bar.close()
    return rows


def _tensor_peak(r: dict):
    d = decomposition_for(r)
    return d, predict_memory(d, TrainSetup(r["optimizer"]))


_PEAK_OF = {"cpu": "rss_peak_bytes", "cuda": "gpu_max_reserved_bytes"}
"""The measured real peak an allocator's overhead is fitted to: the process's RSS on the CPU, the
CUDA caching allocator's reserved bytes on a GPU."""


def overhead_from_rows(rows: list[dict], allocator: str = "cpu"):
    """Fit `overhead.RuntimeOverhead` on measured rows (their real peaks: `_PEAK_OF[allocator]`)."""
    from .overhead import fit_overhead

    fitted = [_tensor_peak(r) for r in rows]
    measured = [r[_PEAK_OF[allocator]] for r in rows]
    return fit_overhead([d for d, _ in fitted], [p.peak_bytes for _, p in fitted], measured, allocator)


def fit_runtime_overhead(quick: bool = True, progress: bool = True, device: str = "cpu"):
    """Measure the training configurations of the bench (one process each) on this machine's
    `device` ("cpu" or "cuda") and fit that allocator's runtime overhead (`sysprdict calibrate`)."""
    if device not in _PEAK_OF:
        raise ValueError(f"device: {device!r} is not valid; use one of {list(_PEAK_OF)}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("device: cuda was asked for, but torch sees no CUDA device on this machine")
    plan = [c for c in harness_plan(quick) if c["role"] != "heldout"]
    return overhead_from_rows(measure_plan(plan, progress=progress, device=device), device)


def evaluate_memory_rss(rows: list[dict]) -> tuple[dict, object]:
    """Fit the runtime overhead on the training families' rows, then predict the real (RSS) peak of
    the held-out architectures' rows; beside it the tensors-only and accelerate-style estimates."""
    fit_rows = [r for r in rows if r["role"] != "heldout"]
    ov = overhead_from_rows(fit_rows)
    pts = []
    for r in (r for r in rows if r["role"] == "heldout"):
        d, p = _tensor_peak(r)
        real = with_overhead(p, d, ov)
        pts.append(
            {
                **{k: r[k] for k in ("model", "family", "size", "modality", "precision", "batch")},
                "true": r["rss_peak_bytes"],
                "pred": real.peak_bytes,
                "tensors_only": p.peak_bytes,
                "accelerate_style": accelerate_style(d, TrainSetup(r["optimizer"])),
            }
        )

    def _m(sel, key="pred"):
        return mape([p[key] for p in sel], [p["true"] for p in sel])

    return {
        "mape_rss": _m(pts),
        "mape_rss_tensors_only": _m(pts, "tensors_only"),
        "mape_rss_accelerate_style": _m(pts, "accelerate_style"),
        "per_family": {f: _m([p for p in pts if p["family"] == f]) for f in sorted({p["family"] for p in pts})},
        "per_size": {s: _m([p for p in pts if p["size"] == s]) for s in sorted({p["size"] for p in pts})},
        "overhead": dataclasses.asdict(ov),
        "points": pts,
        "n_fit": len(fit_rows),
        "ground_truth": "peak RSS (VmHWM after clear_refs) minus RSS before the model was built, one process each",
    }, ov


def evaluate_oom_guard_rss(overhead, cases=RSS_GUARD_CASES, seq_len: int = GUARD_SEQ) -> dict:
    """Fit each held-out model into its limit with the real-peak predictor (margin: the overhead's
    own), then train it at that batch in a fresh process and compare its real peak to the limit."""
    from .fit import largest_batch
    from .groundtruth import measure

    out = []
    for name, limit in cases:
        fit = largest_batch(name, limit, seq_len=seq_len, margin=None, overhead=overhead, checkpointing=False)
        measured = 0
        if fit.fits:
            kw = {"model": name, "batch": fit.batch, "seq_len": seq_len, "precision": fit.precision}
            measured = measure("sysprdict.groundtruth:training_step", kw | {"optimizer": fit.optimizer}).cpu_peak_bytes
        out.append(
            {
                **fit.as_dict(),
                "measured_peak_bytes": measured,
                "violation": bool(fit.fits and measured > fit.limit_bytes),
                "pred_error": (fit.predicted_peak_bytes / measured - 1) if measured else None,
            }
        )
    return {"cases": out, "violations": sum(c["violation"] for c in out), "margin": overhead.margin}


def _tensor_accounting(rows: list[dict]) -> float:
    """The old self-check, kept as a diagnostic: the tensor predictor vs MemTracker's tensor peak."""
    sel = [r for r in rows if r.get("peak_bytes")]
    pred = [predict_memory(decomposition_for(r), TrainSetup(r["optimizer"])).peak_bytes for r in sel]
    return mape(pred, [r["peak_bytes"] for r in sel])


def run_evaluation(
    quick: bool = True, rows: list[dict] | None = None, progress: bool = True, points: list[dict] | None = None
) -> dict:
    """Everything `bench` reports; `rows` skips measuring (a dataset read from a file)."""
    from .timepred import evaluate_split

    t0 = time.perf_counter()
    if rows is None:
        rows = measure_plan(points or harness_plan(quick), progress=progress)
    if not any(r.get("role") == "heldout" for r in rows):
        raise ValueError("rows: no held-out rows (role 'heldout'); save a dataset with `bench --save-dataset`")
    t_measure = time.perf_counter() - t0
    mm = hwtopo.matmul_flops(256, threads=1, seconds=0.3)
    experts_cost = calibrate_experts()
    calibrate_matmul()
    calibrate_elementwise()
    time_kernels([s for r in rows for s in decomposition_for(r).kernel_calls])
    train = [r for r in rows if r["role"] == "train"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        heldout = [r for r in rows if r["role"] == "heldout"]
        strict = evaluate_split([r for r in rows if r["role"] != "heldout"], heldout, mm.flops, kind=TIME_KIND)
        extrap = evaluate_split(train, [r for r in rows if r["role"] == "extrap"], mm.flops, kind=TIME_KIND)
        leaky = evaluate_holdout_families(train, mm.flops, kind=TIME_KIND)
    memory, ov = evaluate_memory_rss(rows)
    guard = evaluate_oom_guard_rss(ov, RSS_GUARD_CASES[:3] if quick else RSS_GUARD_CASES)
    headline = {
        "mem_mape_rss": memory["mape_rss"],
        "mem_mape_rss_tensors_only": memory["mape_rss_tensors_only"],
        "mem_mape_rss_accelerate_style": memory["mape_rss_accelerate_style"],
        "oom_guard_violations_rss": guard["violations"],
        "time_mape_strict": strict["aware"]["mape"],
        "time_mape_precision_blind_strict": strict["blind"]["mape"],
        "time_blind_over_aware_strict": strict["blind"]["mape"] / max(strict["aware"]["mape"], 1e-12),
        "time_mape_analytical_flops_strict": strict["analytical"]["mape"],
        "time_mape_size_extrapolation": extrap["aware"]["mape"],
        "time_mape_family_holdout_shared_components": leaky["aware"]["mape"],
        "mem_mape_tensor_accounting": _tensor_accounting(train),
    }
    return {
        "rows": rows,
        "timing": strict,
        "timing_size_extrapolation": extrap,
        "timing_family_holdout_shared_components": leaky,
        "memory": memory,
        "oom_guard": guard,
        "headline": headline,
        "config": {
            "quick": quick,
            "configurations": len(rows),
            "train_families": strict["train_families"],
            "heldout_families": sorted({r["family"] for r in rows if r["role"] == "heldout"}),
            "size_extrapolation": {"train_sizes": sorted({r["size"] for r in train}), "test": XL},
            "precisions": sorted({r["precision"] for r in rows}),
            "time_target": strict["target"],
            "timing": f"median process CPU time of at least {GT_STEPS} timed steps and {GT_MIN_TIME_S} s after one "
            "warm-up step, 1 thread, one process "
            "per configuration",
            "boosting_backend": boosting_backend(),
            "time_predictor": TIME_KIND,
            "cpu_isa": cpu_isa(),
            "matmul_calibration_s_per_flop": {
                dt: [[round(math.exp(x)), math.exp(y)] for x, y in pts] for dt, pts in MATMUL_SECONDS.items()
            },
            "matmul_flops_per_s": mm.flops,
            "elementwise_cost_s_per_op_and_per_byte": dict(ELEMENTWISE_COST),
            "heavy_kernels_timed": len(KERNEL_SECONDS),
            "kernel_in_step_factor": {
                "strict": strict.get("kernel_in_step_factor"),
                "size_extrapolation": extrap.get("kernel_in_step_factor"),
            },
            "heavy_kernel_timing": "every forward matmul, convolution and fused attention of every row's model "
            "replayed on random data at its shape and dtype, forward + backward, 1 thread, minimum process CPU "
            "time over 3 interleaved passes; measured in this run (no cache across runs)",
            "experts_matmul_cost_measured": experts_cost,
            "measure_wall_s": t_measure,
            "eval_wall_s": time.perf_counter() - t0 - t_measure,
        },
    }
