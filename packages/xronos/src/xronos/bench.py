"""Side-by-side comparison: Xronos vs even TP vs GPipe PP vs the single-process reference.

One spawned run holds every variant on the same (emulated) ranks. Steps are interleaved (step i of
each variant before step i+1 of any), so load on the machine touches all variants alike. Each step
starts after a barrier; a rank's idle time in a step is the time it spent inside collectives or
transfers plus the time it finished before the slowest rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import TypeVar

import torch.distributed as dist

from hwtopo import resume_point, sync_point

from .baselines import SCHEDULES, DTensorTPTrainer, PipeliningTrainer
from .emulation import TOLERANCE, check_speeds, measure_kernel
from .launch import check_emulation, emulation_label, pin_ranks, spawn, throttle_period_us
from .layers import COMM
from .partition import even_partition, partition
from .profile import profile_group
from .rebalance import Rebalancer
from .train import PPTrainer, TPTrainer, TrainConfig, make_corpus, split_layers
from .waits import segment_compute, segment_jitter, step_waits

__all__ = ["VARIANTS", "run_comparison", "summarize", "headline", "combine_seeds"]

log = logging.getLogger(__name__)

VARIANTS = ("reference", "xronos", "tp", "dtensor", "pp", "pipelining")

# The rebalancer's settings (calibration margin 1 %, at least 3 windows, threshold 1 %, calibration
# after step 5) were chosen on bench runs of seed 0 (model, data and profile); the bench reports others.
DEVELOPMENT_SEEDS = (0,)
REPORT_SEEDS = (1, 2, 3)


def _worker(
    rank: int,
    world: int,
    cfg_dict: dict,
    speeds: list[float],
    variants: list[str],
    timeline_step: int,
    rebalance_every: int,
    rebalance_threshold: float = 0.01,
    calibrate_after: int = 5,
    calibration_margin: float | None = 0.01,
    min_windows: int = 3,
):
    """One rank of the comparison: profile, build every variant, run their steps interleaved, evaluate."""
    import hwtopo

    cfg = TrainConfig(**cfg_dict)
    corpus = make_corpus(cfg)
    shape = cfg.shape()
    solo = [dist.new_group([r]) for r in range(world)]  # one-rank groups: the reference runs without peers
    costs, prof = profile_group(shape, cfg.batch, cfg.seq_len, group=None)
    parts = {"xronos": partition(shape, costs), "tp": even_partition(shape, world)}
    trainers = _build_trainers(cfg, shape, parts, speeds, variants, rank, solo, corpus)
    rebalancer = None
    if "xronos" in trainers and rebalance_every > 0:
        rebalancer = Rebalancer(
            shape,
            costs,
            every=rebalance_every,
            threshold=rebalance_threshold,
            total_steps=cfg.steps,
            calibration_margin=calibration_margin,
            min_windows=min_windows,
        )
    kernel_s: list[list[float]] = []  # every rank's calibrated-kernel time, sampled once per step
    t_start = time.perf_counter()
    records, timelines = _run_steps(
        cfg.steps, variants, trainers, parts, rank, timeline_step, rebalancer, calibrate_after, kernel_s
    )
    train_s = time.perf_counter() - t_start
    # in variant order on every rank, as the evaluations of the distributed variants meet in collectives
    evals = {name: trainers[name].evaluate() for name in variants if name != "reference" or rank == 0}
    dil = hwtopo.current_dilation()
    return {
        "rank": rank,
        "speed": speeds[rank],
        "machine_method": hwtopo.cgroup_available(),
        "dilation": dil.describe() if dil is not None else None,
        "records": records,
        "kernel_s": kernel_s,
        "eval_loss": evals,
        "profile": prof["ranks"][rank],
        "partitions": {k: v.describe() for k, v in parts.items()},
        "pp_layers": next((t.counts for n, t in trainers.items() if n.startswith("pp")), None),
        "timelines": timelines,
        "train_s": train_s,
        "rebalance_history": rebalancer.history if rebalancer is not None else [],
        "num_layers": shape.num_layers,
        "predicted_compute_s": {  # what the start-up profile predicts for this rank's shard, per step
            k: shape.num_layers * (costs[rank].attn_time(p.attn_units[rank]) + costs[rank].mlp_time(p.mlp_units[rank]))
            for k, p in parts.items()
            if k in ("xronos", "tp")
        },
    }


def _build_trainers(cfg: TrainConfig, shape, parts: dict, speeds, variants, rank: int, solo, corpus) -> dict:
    """This rank's trainer for every variant, all on the same corpus (the reference on rank 0 alone)."""
    trainers: dict[str, TPTrainer | PPTrainer | DTensorTPTrainer | PipeliningTrainer] = {}
    for name in variants:
        if name == "reference":
            if rank == 0:
                ref_part = even_partition(shape, 1) if cfg.lora_r else None
                trainers[name] = TPTrainer(cfg, ref_part, 0, solo[0], corpus)
        elif name in parts:
            trainers[name] = TPTrainer(cfg, parts[name], rank, None, corpus)
        elif name == "dtensor":
            trainers[name] = DTensorTPTrainer(cfg, corpus)
        elif name.startswith("ppl-"):  # torch.distributed.pipelining: "ppl-<schedule>-m<micro-batches>"
            pp_cfg = dataclasses.replace(cfg, micro_batches=_micro_batches(name, cfg.micro_batches))
            trainers[name] = PipeliningTrainer(pp_cfg, speeds, name.split("-")[1], corpus)
        elif name.startswith("pp"):
            pp_cfg = dataclasses.replace(cfg, micro_batches=_micro_batches(name, cfg.micro_batches))
            trainers[name] = PPTrainer(pp_cfg, speeds, rank, len(solo), None, corpus, local_group=solo[rank])
    return trainers


_Default = TypeVar("_Default", bound=int | None)


def _micro_batches(name: str, default: _Default) -> int | _Default:
    """The micro-batch count a pipeline variant's name carries ("pp-m8": 8), else ``default``."""
    return int(name.split("-m")[1]) if "-m" in name else default


def _run_steps(
    steps: int,
    variants,
    trainers: dict,
    parts: dict,
    rank: int,
    timeline_step: int,
    rebalancer,
    calibrate_after: int,
    kernel_s: list,
) -> tuple[dict, dict]:
    """Every variant's step records, interleaved so that load on the machine touches all variants alike.

    Step i of each variant runs before step i+1 of any, each distributed step after a barrier. Before
    each step every rank times the same calibrated kernel (appended to ``kernel_s``): the speeds the
    emulation achieves, sampled through the whole run. Also returns the collectives of
    ``timeline_step`` for the partitioned variants, and keeps ``parts["xronos_final"]`` at the
    rebalancer's latest partition.
    """
    records: dict[str, list[dict]] = {name: [] for name in variants}
    timelines: dict[str, dict] = {}
    for step in range(steps):
        kernel_s.append(measure_kernel())
        for name in variants:
            if name == "reference":
                if rank == 0:
                    records[name].append(trainers[name].step())
                continue
            sync_point()  # emulated dilation of the untimed work between steps, before the barrier
            dist.barrier()
            resume_point()
            record = step == timeline_step and name in parts
            COMM.events = [] if record else None
            records[name].append(trainers[name].step())
            if name == "xronos" and rebalancer is not None:
                _rebalance(rebalancer, trainers[name], records[name][-1], step, calibrate_after)
                parts["xronos_final"] = trainers[name].part
            if record:
                assert COMM.events is not None  # recording since before the step
                timelines[name] = {
                    "t0": records[name][-1]["t0"],
                    "step_s": records[name][-1]["step_s"],
                    "events": list(COMM.events),
                }
            COMM.events = None
    return records, timelines


def _rebalance(rebalancer: Rebalancer, trainer, rec: dict, step: int, calibrate_after: int) -> None:
    """Feed step ``rec`` to the rebalancer and let it reshard; its own time goes into ``rec["rebalance_s"]``."""
    t_rb = time.perf_counter()
    if 0 < step <= calibrate_after:
        rebalancer.observe(rec)  # step 0 warms up (first allocations)
    if step == calibrate_after:
        # one reshard, which measures what a reshard costs and starts from the partition the
        # observed steps give (the start-up profile timed shard computations in isolation)
        rec["reshard_calibration_s"] = rebalancer.calibrate(trainer, correct=True)
    elif step > calibrate_after:
        rebalancer.observe(rec)
        rebalancer.maybe_repartition(trainer)
    sync_point()  # emulated: the rebalancer's own compute is paid inside its timing
    rec["rebalance_s"] = time.perf_counter() - t_rb


def run_comparison(
    cfg: TrainConfig,
    speeds: list[float],
    variants=VARIANTS,
    timeout_s: float = 900.0,
    timeline_step: int | None = None,
    rebalance_every: int = 2,
    cpu_share: float = 1.0,
    rebalance_threshold: float = 0.01,
    pin: bool = True,
    calibrate_after: int = 5,
    emulate: str = "auto",
    calibration_margin: float | None = 0.01,
    min_windows: int = 3,
) -> list[dict]:
    """Run every variant side by side on ``len(speeds)`` emulated ranks; the per-rank raw results.

    Rank r runs at ``speeds[r] * cpu_share`` of one CPU (emulated), pinned to a CPU when the shares fit
    the machine's CPUs one CPU's worth each (:func:`xronos.launch.pin_ranks`; ``pin=False``: never).
    ``rebalance_every`` > 0 lets
    Xronos re-profile from its measured step compute times and reshard every that many steps, when the
    corrected cost model predicts a layer time shorter by more than ``rebalance_threshold`` (1 %: one
    MLP block of a slow rank is ~0.5 % of a layer, a reshard costs a few tens of ms once).
    After step ``calibrate_after`` (steps 1.. observed, step 0 is a warm-up) Xronos reshards once to the
    partition its measured steps give (each rank's median over those steps, per segment), which also
    measures what a reshard costs (:meth:`xronos.rebalance.Rebalancer.calibrate`). Five steps, not two:
    the first steps after the warm-up are still unsettled (steps 1-2 read the slow rank's MLP 2-9 %
    off its later, steady value, which varies by ~1 % a step), and a median of two is their mean.
    ``calibration_margin``: the predicted gain the calibrating reshard needs to move (default 1 %, the
    threshold: the reshard is paid either way and a five-step median is steady enough; ``None``: the
    rebalancer's 5 % hysteresis, which kept a rank 9 % heavy in the MLP, a 4.4 % predicted gain).
    ``min_windows``: later reshards are decided on the median of at least that many windows (the
    calibration's counts as one), so one window's transient slowdown cannot move the partition; with
    2-step windows a wrong calibration (a rank slowed through steps 1-5) can be corrected from step 9,
    when a reshard (one flat gather of the moved shards, ~0.03-0.14 s) pays for itself.
    ``emulate``: "dilate" (compute dilation at every synchronisation that charges CPU waits,
    :func:`xronos.emulation.dilate_wall`), "cgroup" (``hwtopo.throttle``'s CPU quota) or "auto" (cgroup
    where writable); every variant runs under the same one.
    """
    cfg.validate()
    emulate = check_emulation(emulate)
    if not 0 < cpu_share <= 1:
        raise ValueError(f"cpu_share must be in (0, 1], not {cpu_share!r}")
    bad = [v for v in variants if v not in VARIANTS and not v.startswith(("pp-m", "ppl-"))]
    if bad:
        raise ValueError(f"variants: {bad[0]!r} is not one of {', '.join(VARIANTS)}")
    variants = _expand_pipelines(cfg, len(speeds), list(variants))
    _check_before_launch(cfg, len(speeds), variants)
    ts = cfg.steps // 2 if timeline_step is None else timeline_step
    shares = [s * cpu_share for s in speeds]
    return spawn(
        _worker,
        len(speeds),
        (
            cfg.to_dict(),
            list(speeds),
            list(variants),
            ts,
            rebalance_every,
            rebalance_threshold,
            max(0, min(calibrate_after, cfg.steps - 1)),
            calibration_margin,
            min_windows,
        ),
        speeds=shares,
        timeout_s=timeout_s,
        pg_timeout_s=300,
        cpus=pin_ranks(shares) if pin else None,
        emulate=emulate,
    )


def _expand_pipelines(cfg: TrainConfig, world: int, variants: list[str]) -> list[str]:
    """``pp`` and ``pipelining`` become one variant per micro-batch count (and schedule).

    Each pipeline baseline runs at every count among a few sensible ones that divides the batch
    (GPipe suggests M >= 4 x stages; fewer, larger micro-batches run faster GEMMs and 1F1B needs
    M >= stages), and the headline compares with the fastest, so no single choice handicaps it.
    """
    counts = sorted(
        {m for m in (cfg.micro_batches, world, 4, 8, 4 * world) if world <= m <= cfg.batch and cfg.batch % m == 0}
    )
    out = []
    for name in variants:
        if name == "pp":
            out += [f"pp-m{m}" for m in counts if m in (cfg.micro_batches, 4, 8, 4 * world)]
        elif name == "pipelining":
            out += [f"ppl-{s}-m{m}" for s in SCHEDULES for m in counts]
        else:
            out.append(name)
    return out


def _check_before_launch(cfg: TrainConfig, world: int, variants) -> None:
    """The errors a rank would hit, raised here before any process starts (one message each)."""
    shape = cfg.shape()
    for name in variants:
        if name in ("xronos", "tp", "dtensor"):
            even_partition(shape, world)  # heads/MLP blocks cannot be split across this many ranks
            if name == "dtensor" and cfg.lora_r:
                raise ValueError("the dtensor baseline fine-tunes every weight; drop it or use lora_r 0")
        elif name.startswith("pp"):
            split_layers(cfg.layers, [1.0] * world)  # fewer layers than stages
            if name.startswith("ppl-") and cfg.lora_r:
                raise ValueError("the pipelining baseline fine-tunes every weight; drop it or use lora_r 0")
            mb = _micro_batches(name, cfg.micro_batches)
            if cfg.batch % mb:
                raise ValueError(f"batch ({cfg.batch}) must be a multiple of the micro-batch count {mb} ({name})")


def summarize(results: list[dict], skip: int = 1) -> dict:
    """Per variant: median step time, per-rank idle ratios, compute stall, losses; and under
    ``"emulation"`` the speeds the emulation achieved (:func:`emulation_check`)."""
    out = {}
    for name in list(results[0]["records"]):
        if name == "reference":
            out[name] = _summarize_reference(results, skip)
        else:
            out[name] = _summarize_distributed(results, name, skip)
    out["emulation"] = emulation_check(results, out)
    bound = free_comm_bound(out, [res["speed"] for res in results])
    if bound is not None:
        out["free_comm_bound"] = bound
    return out


def free_comm_bound(summary: dict, speeds: list[float]) -> dict | None:
    """The step perfect uneven TP would take with free communication, from this run's own compute.

    Rank 0's compute per step in each segment (attention, MLP, the rest) is measured at two shares
    (even TP's 1/n and Xronos'); a straight line through them splits each into a part every rank
    repeats whatever its share (norms, residuals, rotary, embedding, the fixed cost of each GEMM
    call) and a part that shards. The rest ("other": embedding, LM head, loss, clipping, optimizer)
    is fitted against the MLP share, which the vocabulary split of the LM head follows and which
    holds most of the parameters the optimizer updates. Each rank r then takes ``(A + B f_r) / s_r``
    for share ``f_r``; equal times summing the shares to 1 give ``T = (B + n A) / sum(s)``. None when
    the run lacks what it needs.
    """
    try:
        tp, xr = summary["tp"]["segment_compute_s_per_rank"][0], summary["xronos"]["segment_compute_s_per_rank"][0]
        part, ref = summary["xronos"]["partition"], summary["reference"]["step_time_s"]
    except (KeyError, IndexError):
        return None
    n = len(speeds)
    mlp_share = part["mlp_columns"][0] / sum(part["mlp_columns"])
    shares = {"attn": part["q_heads"][0] / sum(part["q_heads"]), "mlp": mlp_share, "other": mlp_share}
    if speeds[0] != max(speeds) or any(abs(f - 1 / n) < 0.05 for f in shares.values()):
        return None  # the reference is not on the fastest rank, or the two shares are too close to fit a line
    # noise can tilt a short segment's line below zero: its sharded part is then at least nothing
    slope = {k: max(0.0, (xr[k] - tp[k]) / (f - 1 / n)) for k, f in shares.items()}
    replicated = sum(tp[k] - slope[k] / n for k in shares)
    sharded = sum(slope.values())
    step = (sharded + n * replicated) / sum(v / speeds[0] for v in speeds)
    return {
        "replicated_s": replicated,
        "sharded_s": sharded,
        "step_time_s": step,
        "ratio_vs_fast_alone": step / ref,
        "note": "rank 0's compute per segment at even TP's and Xronos' shares, split into repeated and "
        "sharded work; the step of a perfect uneven split with free communication",
    }


def emulation_check(results: list[dict], summary: dict) -> dict:
    """Did every rank run at its requested speed? Two independent measurements, both must hold.

    ``kernel``: the calibrated kernel all ranks ran together before every step; ``even_tp``: the
    compute time per rank of even TP, where every rank does the same work. A rank off its requested
    speed (relative to the fastest) by more than the tolerance makes the run invalid.
    """
    speeds = [res["speed"] for res in results]
    checks = {}
    if results[0].get("kernel_s"):
        checks["kernel"] = check_speeds(speeds, results[0]["kernel_s"])
    if "tp" in summary:
        checks["even_tp"] = check_speeds(speeds, [summary["tp"]["compute_s_per_rank"]])
    valid = bool(checks) and all(c["valid"] for c in checks.values())
    reasons = [
        f"{how}: rank {r} ran at {c['achieved_relative_speeds'][r]:.2f} of the fastest, asked "
        f"{c['requested_relative_speeds'][r]:.2f}"
        for how, c in checks.items()
        for r in c["invalid_ranks"]
    ]
    if not checks:
        reasons.append("no achieved speed was measured")
    return {"valid": valid, "tolerance": TOLERANCE, "checks": checks, "invalid_because": reasons}


def _summarize_reference(results: list[dict], skip: int) -> dict:
    """The single-process reference on rank 0: median step time and losses."""
    recs = results[0]["records"]["reference"]
    steps = [r["step_s"] for r in recs[skip:]] or [r["step_s"] for r in recs]
    return {
        "step_time_s": statistics.median(steps),
        "final_train_loss": recs[-1]["loss"] if recs else None,
        "eval_loss": results[0]["eval_loss"]["reference"],
        "train_losses": [r["loss"] for r in recs],
    }


def _step_ratios(per_rank: list[list[dict]], skip: int) -> tuple[list[float], list, list, list]:
    """Each step's wall time and, per rank, its waiting, transfer and not-computing shares of it.

    Not computing = inside collectives or transfers, plus finished before the slowest rank.
    """
    world, n = len(per_rank), len(per_rank[0])
    sys_t = []
    idle: list[list[float]] = [[] for _ in range(world)]
    inside: list[list[float]] = [[] for _ in range(world)]
    transfer: list[list[float]] = [[] for _ in range(world)]
    for i in range(min(skip, n - 1) if n > 1 else 0, n):
        waits = step_waits([per_rank[r][i] for r in range(world)])
        t_sys = waits[0]["step_s"]
        sys_t.append(t_sys)
        for r in range(world):
            idle[r].append(waits[r]["wait_s"] / t_sys)
            transfer[r].append(waits[r]["transfer_s"] / t_sys)
            inside[r].append((per_rank[r][i]["comm_s"] + waits[r]["early_s"]) / t_sys)
    return sys_t, idle, inside, transfer


def _summarize_distributed(results: list[dict], name: str, skip: int) -> dict:
    """One distributed variant: step and total time, idle and stall ratios, compute, losses, its shards."""
    world = len(results)
    per_rank = [res["records"][name] for res in results]
    sys_t, idle, inside, transfer = _step_ratios(per_rank, skip)
    rebalance_s = [sum(r.get("rebalance_s", 0.0) for r in recs) for recs in per_rank]
    idle_med = [statistics.median(x) for x in idle]
    not_computing = [statistics.median(x) for x in inside]
    compute = [
        statistics.median(rec["step_s"] - rec["comm_s"] for rec in per_rank[r][1:] or per_rank[r]) for r in range(world)
    ]
    layers = results[0].get("num_layers")
    segs = [[segment_compute(rec, layers) for rec in per_rank[r][1:]] for r in range(world)] if layers else []
    out = {
        "step_time_s": statistics.median(sys_t),
        # the same steps' wall time summed, plus every re-profiling/reshard pause (slowest rank):
        # what the median step time leaves out
        "total_time_s": sum(sys_t) + max(rebalance_s),
        "idle_ratio_per_rank": idle_med,
        "idle_ratio": max(idle_med),
        "transfer_ratio_per_rank": [statistics.median(x) for x in transfer],
        "not_computing_ratio_per_rank": not_computing,
        "compute_stall_ratio": min(not_computing),
        "compute_s_per_rank": compute,
        "final_train_loss": per_rank[0][-1]["loss"],
        "eval_loss": results[0]["eval_loss"][name],
        "train_losses": [r["loss"] for r in per_rank[0]],
    }
    reshard_steps = [e["step"] for e in results[0].get("rebalance_history", []) if e.get("resharded")]
    if name in ("xronos", "tp"):  # after the last reshard: the same shards in every step compared
        start = max([skip, *reshard_steps]) if name == "xronos" else skip
        out["segment_jitter_cv_per_rank"] = [segment_jitter(rec[start:]) for rec in per_rank]
    known = [[x for x in rank_segs if x is not None] for rank_segs in segs]
    if segs and all(len(kept) == len(seg) for kept, seg in zip(known, segs)):
        out["segment_compute_s_per_rank"] = [
            {k: statistics.median(x[k] for x in rank_segs) for k in ("attn", "mlp", "other")} for rank_segs in known
        ]
    if name in results[0]["partitions"]:
        out["partition"] = results[0]["partitions"][name]
        pred = [res.get("predicted_compute_s", {}).get(name) for res in results]
        if all(p is not None for p in pred):
            out["profiled_compute_s_per_rank"] = pred
    if name == "xronos":
        out.update(_rebalance_summary(results, out, rebalance_s, reshard_steps))
    if name.startswith("pp"):
        out["layers_per_stage"] = results[0]["pp_layers"]
        out["micro_batches"] = _micro_batches(name, None)
    if name == "dtensor" or name.startswith("ppl-"):
        # the libraries' collectives are not timed: no idle, stall or compute split to report
        for key in ("idle_ratio_per_rank", "idle_ratio", "transfer_ratio_per_rank", "not_computing_ratio_per_rank"):
            out.pop(key, None)
        for key in ("compute_stall_ratio", "compute_s_per_rank"):
            out.pop(key, None)
        out["library"] = "torch.distributed.tensor (DTensor)" if name == "dtensor" else "torch.distributed.pipelining"
        if name.startswith("ppl-"):
            out["schedule"] = name.split("-")[1]
    if name == "tp":  # equal work per rank: the speeds the emulation actually achieved under load
        out["achieved_relative_speeds"] = [min(compute) / c for c in compute]
    return out


def _rebalance_summary(results: list[dict], out: dict, rebalance_s: list[float], reshard_steps: list[int]) -> dict:
    """What Xronos' re-profiling cost and changed: pauses, reshards, and its final partition."""
    extra = {
        "rebalance_s_total": max(rebalance_s),
        "reshards": len(reshard_steps),
        "reshard_calibration_s": max(
            (rec.get("reshard_calibration_s", 0.0) for res in results for rec in res["records"]["xronos"]),
            default=0.0,
        ),
        "rebalance_history": results[0]["rebalance_history"],
    }
    if "xronos_final" in results[0]["partitions"]:
        extra["partition_initial"] = out["partition"]
        extra["partition"] = results[0]["partitions"]["xronos_final"]
    return extra


def headline(summary: dict) -> dict:
    """The issue's headline keys from a :func:`summarize` result (ratios of medians, same run)."""
    h = {}
    if "emulation" in summary:
        h["emulation_valid"] = summary["emulation"]["valid"]
        kern = summary["emulation"]["checks"].get("kernel")
        if kern is not None:
            h["achieved_relative_speeds"] = kern["achieved_relative_speeds"]
    if "xronos" in summary:
        h["idle_ratio_xronos"] = summary["xronos"]["idle_ratio"]
    if "tp" in summary:
        h["idle_ratio_tp"] = summary["tp"]["idle_ratio"]
        if "xronos" in summary:
            h["step_time_ratio_vs_tp"] = summary["xronos"]["step_time_s"] / summary["tp"]["step_time_s"]
            # honest about what the median leaves out: summed step times plus Xronos' reshards and the
            # measurement of their cost, against even TP's summed step times over the same steps
            h["total_time_ratio_vs_tp"] = summary["xronos"]["total_time_s"] / summary["tp"]["total_time_s"]
            h["rebalance_s_total"] = summary["xronos"].get("rebalance_s_total", 0.0)
            h["reshards"] = summary["xronos"].get("reshards", 0)
    pps = [n for n in summary if n.startswith("pp")]
    if pps and "xronos" in summary:
        # the fastest pipeline configuration: the library's GPipe/1F1B or the hand-written GPipe, any
        # micro-batch count
        best = min(pps, key=lambda n: summary[n]["step_time_s"])
        h["step_time_ratio_vs_pp"] = summary["xronos"]["step_time_s"] / summary[best]["step_time_s"]
        h["pp_baseline"] = best
    if "dtensor" in summary and "tp" in summary:
        h["tp_step_ratio_vs_dtensor"] = summary["tp"]["step_time_s"] / summary["dtensor"]["step_time_s"]
    if "reference" in summary and "xronos" in summary:
        kern = summary.get("emulation", {}).get("checks", {}).get("kernel")
        if kern is None or kern["requested_relative_speeds"][0] == 1.0:
            # the reference ran on rank 0, the fastest device, alone: what a user gets without distributing
            h["step_time_ratio_vs_fast_alone"] = summary["xronos"]["step_time_s"] / summary["reference"]["step_time_s"]
            if "free_comm_bound" in summary:  # what no partition can beat on this model and machine
                h["free_comm_bound_vs_fast_alone"] = summary["free_comm_bound"]["ratio_vs_fast_alone"]
        ref = summary["reference"]["eval_loss"]
        h["loss_rel_diff_vs_reference"] = abs(summary["xronos"]["eval_loss"] - ref) / abs(ref)
    return h


def emulation_info(speeds: list[float], cpu_share: float = 1.0, emulate: str = "auto") -> dict:
    """How the run emulated its devices: method, parameters, pinning (labelled emulated)."""
    if check_emulation(emulate) == "dilate":
        return {
            "emulated": True,
            "method": emulation_label(emulate),
            "relative_speeds": list(speeds),
            "cpu_share": cpu_share,
            "dilation_speed_per_rank": [s * cpu_share for s in speeds],
            "pinned_cpus": pin_ranks([s * cpu_share for s in speeds]),
            "oversubscribed": sum(s * cpu_share for s in speeds) > len(os.sched_getaffinity(0)),
            "note": "ranks share one machine; rank r computes at full speed and sleeps (1/speed - 1) x its thread "
            "CPU time plus its waits for a CPU at every synchronisation point (xronos.emulation.dilate_wall over "
            "hwtopo.dilate), the same for every variant",
        }
    from .emulation import PRIORITY_SHARES

    shares = [s * cpu_share for s in speeds]
    return {
        "emulated": True,
        "relative_speeds": list(speeds),
        "cpu_share": cpu_share,
        "cpus_per_rank": shares,
        "method": "cgroup",
        "cgroup_period_us": [throttle_period_us(s) for s in shares],
        "cgroup_quota_cores": [s if s < 1 else None for s in shares],
        "cgroup_shares": PRIORITY_SHARES,
        "pinned_cpus": pin_ranks(shares),
        "oversubscribed": sum(shares) > len(os.sched_getaffinity(0)),
        "note": "ranks share one machine; each rank runs in its own cgroup (xronos.emulation.RankQuota): a CPU "
        "quota of cpus_per_rank cores per period (none at 1.0) and top cpu.shares, so other programs on its "
        "CPU cannot push it below its quota",
    }


def combine_seeds(per_seed: dict) -> dict:
    """One headline over several seeds' headlines: the median of each number, its spread, every seed's.

    ``emulation_valid`` holds only when every seed's run was valid; a ratio whose side of 1.0 differs
    between seeds is listed in ``flips_with_seed``.
    """
    seeds = list(per_seed)
    if len(seeds) == 1:
        return {**per_seed[seeds[0]], "seeds": seeds}
    out: dict = {"seeds": seeds}
    keys = [k for k in per_seed[seeds[0]] if all(k in h for h in per_seed.values())]
    spread, flips = {}, []
    for k in keys:
        vals = [per_seed[s][k] for s in seeds]
        if k == "emulation_valid":
            out[k] = all(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = statistics.median(vals)
            spread[k] = [min(vals), max(vals)]
            if "ratio" in k and min(vals) < 1.0 < max(vals):
                flips.append(k)
    out["spread"] = spread
    out["flips_with_seed"] = flips
    out["per_seed"] = {str(s): per_seed[s] for s in seeds}
    return out
