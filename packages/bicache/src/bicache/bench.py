"""Side-by-side benchmark of the cache modes on the trained model (``bicache bench``).

Every variant serves the same requests (same seed) through its own :class:`~bicache.engine.Engine`
with a fresh prefix store. Measurement protocol: glibc keeps freed memory in the heap
(:func:`~bicache.engine.keep_heap`), every variant runs once untimed (warm-up), then the variants
are interleaved in rounds (each round runs every fraction; the variant order rotates from round to
round), the garbage collector is paused inside each timed pass, and throughput is the median over
rounds. The four variants of the headline ratios run in every round, the other baselines in the
first ``side_repeats`` rounds. Accuracy is exact match of the generated answer.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import asdict

import torch

from . import depth as depthmod
from .diffusion import DecodeConfig
from .engine import Engine, keep_heap
from .model import DiffusionLM
from .task import TableTask

log = logging.getLogger(__name__)

FRACTIONS = (0.25, 0.5, 0.75, 0.9)
HEADLINE_VARIANTS = ("nocache", "block_cache", "bicache", "bicache+block_cache")


def variants(dlm: DiffusionLM) -> list[tuple[str, str, int]]:
    """(name, engine mode, fixed depth) for every baseline and bicache."""
    out = [("nocache", "none", 0), ("naive_prefix", "naive", 0)]
    out += [(f"fixed_depth_{d}", "fixed", d) for d in range(1, dlm.num_layers)]
    out += [("block_cache", "block", 0), ("bicache", "bicache", 0), ("bicache+block_cache", "bicache+block", 0)]
    return out


def make_workload(dlm: DiffusionLM, fractions=FRACTIONS, groups: int = 2, per_group: int = 16, seed: int = 2024):
    """Bursts of requests sharing a prefix, per fraction: {fraction: [Request, ...]}."""
    task = TableTask(dlm.spec, seed=seed)
    work = {}
    for f in fractions:
        rows = dlm.spec.shared_rows_for_fraction(f)
        reqs = []
        for g in range(groups):
            reqs += task.burst(per_group, rows, group=g)
        work[f] = reqs
    return work


def run_variant(dlm, mode, fixed_depth, policy, reqs, max_batch, cfg) -> dict:
    engine = Engine(dlm, mode=mode, policy=policy, max_batch=max_batch, fixed_depth=fixed_depth, cfg=cfg)
    gc.collect()
    paused = gc.isenabled()
    gc.disable()  # a collection inside a timed pass would land on whichever variant runs then
    try:
        done = engine.run([r.prompt for r in reqs])
    finally:
        if paused:
            gc.enable()
    correct = sum(int(c.tokens == r.answer) for c, r in zip(done, reqs))
    right = sum(sum(int(a == b) for a, b in zip(c.tokens, r.answer)) for c, r in zip(done, reqs))
    s = engine.stats.summary()
    depths = sorted({c.depth for c in done})
    return {
        "accuracy": correct / len(reqs),
        "token_accuracy": right / max(1, sum(len(r.answer) for r in reqs)),
        "tokens": s["generated_tokens"],
        "seconds": engine.stats.busy_s,
        "cpu_seconds": engine.stats.cpu_s,
        "tokens_per_s": s["tokens_per_s"],
        "latency_p50_s": s["latency_p50_s"],
        "forwards": s["forwards"],
        "token_layers_computed": s["token_layers_computed"],
        "depths": depths,
    }


def _calibrate(dlm, calibration, bound, quick: bool, cfg: DecodeConfig) -> tuple:
    """(calibration, drift bound, bound search report): each measured only where the caller gave none."""
    if calibration is None:
        calibration = depthmod.calibrate(dlm, requests_per_fraction=8 if quick else 16, groups=2)
    bound_report: dict = {}
    if bound is None:
        bound, bound_report = depthmod.choose_bound(
            dlm, calibration, max_disagreement=0.02, requests_per_fraction=16 if quick else 32, cfg=cfg
        )
    return calibration, bound, bound_report


def _measure(dlm, policy, work: dict, repeats: int, side_repeats: int, max_batch: int, cfg, progress: bool) -> dict:
    """Warm every variant up untimed, then time the rounds; returns {variant: {fraction: [run, ...]}}."""
    vs = variants(dlm)
    runs: dict[str, dict[float, list[dict]]] = {name: {f: [] for f in work} for name, _, _ in vs}
    bar = None
    side = [v for v in vs if v[0] not in HEADLINE_VARIANTS]
    head_vs = [v for v in vs if v[0] in HEADLINE_VARIANTS]
    if progress:
        from tqdm import tqdm

        total = len(vs) + (repeats * len(head_vs) + side_repeats * len(side)) * len(work)
        bar = tqdm(total=total, desc="bench", unit="run")
    warm = work[max(work)][: 2 * max_batch]  # two batches (at the default limit: one per prefix group)
    for _name, mode, d in vs:  # warm-up: first-call costs and heap growth, untimed
        run_variant(dlm, mode, d, policy, warm, max_batch, cfg)
        if bar is not None:
            bar.update(1)
    gc.collect()
    gc.freeze()  # long-lived objects (model, workload) leave the collector: the per-pass collect stays short
    try:
        _rounds(dlm, policy, work, head_vs, side, repeats, side_repeats, runs, max_batch, cfg, bar)
    finally:
        gc.unfreeze()
    if bar is not None:
        bar.close()
    return runs


def _summary(rs: list[dict]) -> dict:
    """One variant at one fraction over its rounds: medians of the timings, the rest from round one."""
    secs = statistics.median(r["seconds"] for r in rs)
    cpu = statistics.median(r["cpu_seconds"] for r in rs)
    return {
        "accuracy": rs[0]["accuracy"],
        "token_accuracy": round(rs[0]["token_accuracy"], 4),
        "tokens": rs[0]["tokens"],
        "tokens_per_cpu_s": round(rs[0]["tokens"] / cpu, 2),
        "tokens_per_s": round(rs[0]["tokens"] / secs, 2),
        "median_cpu_seconds": round(cpu, 5),
        "median_seconds": round(secs, 5),
        "latency_p50_s": round(statistics.median(r["latency_p50_s"] for r in rs), 5),
        "rounds": len(rs),
        "cpu_seconds_min_max": [
            round(min(r["cpu_seconds"] for r in rs), 5),
            round(max(r["cpu_seconds"] for r in rs), 5),
        ],
        "token_layers_computed": rs[0]["token_layers_computed"],
        "depths": rs[0]["depths"],
    }


def run_bench(
    dlm: DiffusionLM,
    quick: bool = True,
    repeats: int | None = None,
    max_batch: int = 192,
    progress: bool = True,
    calibration: depthmod.Calibration | None = None,
    bound: float | None = None,
    workload: tuple[int, int] | None = None,
    side_repeats: int = 2,
    heap: bool = True,
    work: dict | None = None,
    cfg: DecodeConfig | None = None,
) -> dict:
    """Calibrate, pick the bound, then measure every variant at every fraction, side by side.

    ``repeats`` rounds for the headline variants (``HEADLINE_VARIANTS``), ``side_repeats`` of them
    for the other baselines; medians over the rounds each variant ran. ``heap`` applies
    :func:`~bicache.engine.keep_heap` (process-wide) so that no variant pays page faults.
    ``work`` ({fraction: [Request, ...]}) replaces the table-task workload (``workload`` sizes it);
    ``cfg`` the decode settings (default: blocks of 2, one token per step).
    """
    torch.set_num_threads(1)
    heap_kept = keep_heap() if heap else False
    repeats = repeats or (5 if quick else 7)
    side_repeats = max(1, min(side_repeats, repeats))
    groups, per_group = workload or ((2, 192) if quick else (4, 192))
    cfg = cfg or DecodeConfig(gen_length=dlm.spec.gen_length, block_length=2, steps=dlm.spec.gen_length)
    t0 = time.perf_counter()
    calibration, bound, bound_report = _calibrate(dlm, calibration, bound, quick, cfg)
    policy = depthmod.DepthPolicy(calibration, bound)
    if work is None:
        work = make_workload(dlm, groups=groups, per_group=per_group)
    requests = {f"{f:g}": len(reqs) for f, reqs in work.items()}
    runs = _measure(dlm, policy, work, repeats, side_repeats, max_batch, cfg, progress)
    rounds = _round_ratios(runs, work)
    results = {name: {f"{f:g}": _summary(rs) for f, rs in per_f.items()} for name, per_f in runs.items()}
    headline = headline_from(results, work)
    return {
        "config": {
            "quick": quick,
            "repeats": repeats,
            "side_repeats": side_repeats,
            "headline_variants": list(HEADLINE_VARIANTS),
            "protocol": "warm-up pass per variant; rounds interleave variants (order rotates per round), gc paused "
            "in timed passes; medians over rounds",
            "allocator": "glibc mallopt: freed memory kept in the heap" if heap_kept else "default",
            "fractions": list(work),
            "requests_per_fraction": requests,
            "max_batch": max_batch,
            "decode": {"gen_length": cfg.gen_length, "block_length": cfg.block_length, "steps": cfg.steps},
            "model": {
                "arch": f"{type(dlm.model).__name__} (bidirectional)",
                "layer_types": dlm.layer_types,
                "layers": dlm.num_layers,
                "hidden": dlm.config.hidden_size,
                "params": sum(p.numel() for p in dlm.model.parameters()),
            },
            "task": {"spec": asdict(dlm.spec), "prompt_length": dlm.spec.prompt_length},
            "drift_bound": bound,
            "threads": torch.get_num_threads(),
            "timer": "throughput per CPU-second of the decoding thread (time.thread_time); *_wall: wall-clock",
            "seconds": round(time.perf_counter() - t0, 1),
        },
        "calibration": calibration.to_dict(),
        "policy": policy.table(),
        "bound_search": bound_report,
        "results": results,
        "headline": headline,
        "round_ratios": rounds,
    }


def _rounds(dlm, policy, work, head_vs, side, repeats, side_repeats, runs, max_batch, cfg, bar) -> None:
    """Timed rounds: every fraction, the headline variants each round, the others in the first rounds."""
    for r in range(repeats):
        order = head_vs + (side if r < side_repeats else [])
        order = order[r % len(order) :] + order[: r % len(order)]
        for f, reqs in work.items():
            for name, mode, d in order:
                runs[name][f].append(run_variant(dlm, mode, d, policy, reqs, max_batch, cfg))
                if bar is not None:
                    bar.update(1)


def _round_ratios(runs: dict, work: dict) -> dict:
    """The pooled (fractions >= 0.5) CPU-time ratios of each round on its own: the spread of the headline."""
    high = [f for f in work if f >= 0.5]

    def ratio(fast: str, base: str, i: int) -> float:
        t_base = sum(runs[base][f][i]["cpu_seconds"] for f in high)
        t_fast = sum(runs[fast][f][i]["cpu_seconds"] for f in high)
        return round(t_base / t_fast, 3)

    n = len(runs["nocache"][high[0]]) if high else 0
    return {
        "vs_nocache": [ratio("bicache", "nocache", i) for i in range(n)],
        "vs_block_cache": [ratio("bicache+block_cache", "block_cache", i) for i in range(n)],
    }


def _pooled(results: dict, name: str, fracs: list[str], timer: str) -> tuple[float, float]:
    """(accuracy, tokens per second) pooled over ``fracs``: total tokens / total median seconds."""
    rs = [results[name][f] for f in fracs]
    acc = sum(r["accuracy"] for r in rs) / len(rs)
    return acc, sum(r["tokens"] for r in rs) / sum(r[timer] for r in rs)


def headline_from(results: dict, work: dict) -> dict:
    """Headline keys (fractions >= 0.5 pooled unless named). Throughput is per CPU-second of the
    decoding thread (``*_wall`` keys: wall-clock), the robust measure on a shared machine."""
    high = [f"{f:g}" for f in work if f >= 0.5]
    head: dict = {}
    for suffix, timer in (("", "median_cpu_seconds"), ("_wall", "median_seconds")):
        acc_none, tps_none = _pooled(results, "nocache", high, timer)
        acc_naive, _ = _pooled(results, "naive_prefix", high, timer)
        acc_bi, tps_bi = _pooled(results, "bicache", high, timer)
        acc_biblock, tps_biblock = _pooled(results, "bicache+block_cache", high, timer)
        acc_block, tps_block = _pooled(results, "block_cache", high, timer)
        if not suffix:
            head.update(
                {
                    "acc_nocache": round(acc_none, 4),
                    "acc_naive_prefix": round(acc_naive, 4),
                    "acc_bicache": round(acc_bi, 4),
                    "acc_drop_bicache": round(acc_none - acc_bi, 4),
                    "acc_block_cache": round(acc_block, 4),
                    "acc_bicache_block_cache": round(acc_biblock, 4),
                }
            )
        head[f"throughput_ratio_vs_nocache{suffix}"] = round(tps_bi / tps_none, 3)
        head[f"throughput_ratio_vs_block_cache{suffix}"] = round(tps_biblock / tps_block, 3)
        for f in work:
            k = f"{f:g}"
            r_bi, r_none = results["bicache"][k], results["nocache"][k]
            head[f"throughput_ratio_vs_nocache{suffix}@{k}"] = round(
                (r_bi["tokens"] / r_bi[timer]) / (r_none["tokens"] / r_none[timer]), 3
            )
        if "0.5" in results["block_cache"]:
            # the strongest baseline: Fast-dLLM's dual cache alone vs bicache on top of it, at 50%
            r_dual, r_both = results["block_cache"]["0.5"], results["bicache+block_cache"]["0.5"]
            head[f"throughput_ratio_vs_dual_cache{suffix}"] = round(
                (r_both["tokens"] / r_both[timer]) / (r_dual["tokens"] / r_dual[timer]), 3
            )
            head["acc_drop_vs_dual_cache"] = round(r_dual["accuracy"] - r_both["accuracy"], 4)
    return head
