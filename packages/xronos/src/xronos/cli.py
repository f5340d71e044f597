"""Command line: ``xronos demo | bench | train | finetune | partition`` (the mlsyskit convention, hwtopo.console)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

from hwtopo import console
from hwtopo.console import UsageError

from . import __version__

log = logging.getLogger("xronos")

# Bounds of the numeric options: far above any CPU run, low enough that a typo fails before allocating.
MAX_WIDTH = 1 << 16
MAX_COUNT = 1 << 24
MAX_SEED = (1 << 63) - 1


def _cpu_share_arg(text: str) -> str | float:
    """argparse type for --cpu-share: 'auto' or a number in (0, 1]."""
    if text == "auto":
        return text
    try:
        return console.positive_float("--cpu-share", 1.0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--cpu-share must be 'auto' or a number in (0, 1], not {text!r}") from None


def _speeds(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--speeds: {text!r} is not a comma-separated list of numbers, e.g. 1.0,0.5") from None
    if len(vals) < 1 or any(not 0 < v <= 1 for v in vals):
        raise UsageError(f"--speeds: {text!r} must list relative speeds in (0, 1], e.g. 1.0,0.5")
    return vals


def _cfg(args, **extra):
    from .train import TrainConfig

    d = TrainConfig()
    fields = dict(
        family=args.family,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        mlp_block=args.mlp_block,
    )
    if hasattr(args, "batch"):  # training commands; `partition` only describes the model
        fields.update(
            seq_len=args.seq_len,
            batch=args.batch,
            steps=args.steps,
            seed=getattr(args, "seed", d.seed),
            lr=args.lr,
            data=getattr(args, "data", None),
            vocab_parallel=args.vocab_parallel,
            micro_batches=args.micro_batches or (d.micro_batches if args.batch % d.micro_batches == 0 else args.batch),
        )
    fields.update(extra)
    cfg = TrainConfig(**fields)
    try:
        cfg.validate()
        cfg.shape()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def _model_args(
    p: argparse.ArgumentParser,
    steps: int | None = None,
    training: bool = True,
    min_steps: int = 1,
    seed: bool = True,
    shape: bool = True,
):
    """Model (and, with ``training``, data/optimisation) options; defaults come from :class:`TrainConfig`.

    One source of defaults: the CLI shows and uses ``TrainConfig``'s, except ``--steps`` where a
    command has its own (``steps``). ``shape=False``: the model comes from a checkpoint, so only
    ``--mlp-block`` of the model options is offered.
    """
    from .train import TrainConfig

    d = TrainConfig()
    width = functools.partial(console.positive_int, maximum=MAX_WIDTH)
    g = p.add_argument_group("model and data" if training else "model")
    if shape:
        _shape_args(g, d, width)
    g.add_argument("--mlp-block", type=width("--mlp-block"), default=d.mlp_block, help="MLP columns per partition unit")
    if training:
        _training_args(g, d, width, steps, min_steps, seed, pipeline=shape)


def _shape_args(g, d, width) -> None:
    """The tiny config's shape, built locally."""
    from .shard import FAMILIES

    g.add_argument("--family", default=d.family, choices=FAMILIES, help="tiny config built locally")
    g.add_argument("--hidden", type=width("--hidden"), default=d.hidden, help="hidden size")
    g.add_argument("--layers", type=width("--layers"), default=d.layers, help="decoder layers")
    g.add_argument("--heads", type=width("--heads"), default=d.heads, help="attention heads")
    g.add_argument(
        "--kv-heads",
        type=width("--kv-heads"),
        default=d.kv_heads,
        help="KV heads (a KV group is the attention unit, so fewer groups make the attention split coarser)",
    )
    g.add_argument("--intermediate", type=width("--intermediate"), default=d.intermediate, help="MLP width")


def _training_args(g, d, width, steps: int | None, min_steps: int, seed: bool, pipeline: bool) -> None:
    """Data and optimisation options."""
    g.add_argument("--seq-len", type=width("--seq-len"), default=d.seq_len, help="tokens per sequence")
    g.add_argument("--batch", type=width("--batch"), default=d.batch, help="sequences per step")
    if pipeline:
        g.add_argument(
            "--micro-batches",
            type=width("--micro-batches"),
            help=f"pipeline micro-batches ({d.micro_batches} or --batch)",
        )
    steps_type = console.positive_int("--steps", MAX_COUNT) if min_steps else console.integer("--steps", 0, MAX_COUNT)
    g.add_argument("--steps", type=steps_type, default=d.steps if steps is None else steps, help="training steps")
    g.add_argument(
        "--vocab-parallel",
        choices=("none", "head", "both"),
        default=d.vocab_parallel,
        help="split the LM head (head), or the LM head and the input embedding (both), by vocabulary across "
        "ranks in proportion to their MLP shards; none: replicated",
    )
    g.add_argument("--lr", type=console.positive_float("--lr", 10.0), default=d.lr, help="AdamW learning rate")
    if seed:
        g.add_argument(
            "--seed", type=console.integer("--seed", 0, MAX_SEED), default=d.seed, help="model, data and profile seed"
        )


def _emulate_arg(p: argparse.ArgumentParser, default: str | None = "auto", note: str = "", **kw) -> None:
    p.add_argument(
        "--emulate",
        choices=("auto", "dilate", "cgroup"),
        default=default,
        help="how an emulated slower rank is slowed: cgroup (a CPU quota, hwtopo.throttle: binds under load), "
        "dilate (computes at full speed and sleeps (1/speed - 1) x its CPU time and its waits for a CPU at "
        "every synchronisation) or auto (cgroup where a cgroup cpu controller is writable, else dilate)" + note,
        **kw,
    )


def _emulation_args(p: argparse.ArgumentParser) -> None:
    _emulate_arg(
        p, note="; every run measures the speeds achieved and marks itself invalid when a rank is off by > 10 %%"
    )
    p.add_argument(
        "--cpu-share",
        type=_cpu_share_arg,
        default="auto",
        help="CPUs of the fastest emulated rank (rank r gets speed[r] x this), or 'auto': 1.0, lower only where "
        "the ranks could not each be pinned to a CPU without oversubscribing it",
    )
    p.add_argument(
        "--rebalance-every",
        type=console.integer("--rebalance-every", 0, MAX_COUNT),
        default=2,
        help="Xronos re-profiles from measured step times every N steps and reshards when the median of the "
        "last 3 such windows says it pays (0: off)",
    )


# summary entries that describe the run, not a variant
_RUN_KEYS = ("machine_load", "emulation", "free_comm_bound")


def _rows(summary: dict) -> list[dict]:
    """One table row per variant: step time, idle, stall, loss and how the model was split."""
    rows = []
    for name, s in summary.items():
        if name in _RUN_KEYS:
            continue
        if "partition" in s:
            p = s["partition"]
            shards = f"heads {p['q_heads']} mlp {p['mlp_columns']}"
        elif "layers_per_stage" in s:
            shards = f"layers {s['layers_per_stage']}" + (
                f", {s['micro_batches']} micro-batches" if s.get("micro_batches") else ""
            )
            if "schedule" in s:
                shards += f", pipelining {s['schedule']}"
        elif name == "dtensor":
            shards = "DTensor even TP (parallelize_module)"
        else:
            shards = "1 process, full model"
        rows.append(
            {
                "variant": name,
                "step time (s)": f"{s['step_time_s']:.3f}",
                "idle ratio (max rank)": f"{s['idle_ratio']:.3f}" if "idle_ratio" in s else "-",
                "compute stall": f"{s['compute_stall_ratio']:.3f}" if "compute_stall_ratio" in s else "-",
                "eval loss": f"{s['eval_loss']:.5f}",
                "shards / stages": shards,
            }
        )
    return rows


def _cpu_share(value: str | float, speeds: list[float], emulate: str) -> tuple[float, float | None]:
    """(share, CPUs busy before the run or None). Auto: 1.0, lowered (in steps of 0.05) until every rank
    can be pinned to a CPU without oversubscribing it (3 ranks at 1.0/0.7/0.4 on 2 cores: 0.9), so no
    rank's quota is eaten by another rank's threads. Other programs' load does not lower it: a cgroup
    rank has top priority on its CPU up to its quota, and dilation charges a rank's waits for a CPU as
    compute; the load is still sampled and recorded, and the achieved speeds are checked."""
    if value != "auto":
        return float(value), None
    from .launch import busy_cpus, pin_ranks

    busy = busy_cpus()
    share = 1.0
    while speeds and share > 0.1 and pin_ranks([s * share for s in speeds]) is None:
        share = round(share - 0.05, 2)
    return share, busy


def _validity_line(summary: dict) -> str:
    """The emulation's verdict, said in every report: a run off its requested speeds does not count."""
    em = summary.get("emulation")
    if em is None:
        return "Emulation not checked."
    speeds = "; ".join(
        f"{how} {', '.join(f'{a:.2f}' for a in c['achieved_relative_speeds'])} "
        f"(asked {', '.join(f'{w:.2f}' for w in c['requested_relative_speeds'])})"
        for how, c in em["checks"].items()
    )
    if em["valid"]:
        return f"Emulation valid: every rank within {em['tolerance']:.0%} of its requested speed ({speeds})."
    return (
        f"INVALID RUN: the emulation missed its requested speeds by more than {em['tolerance']:.0%} "
        f"({'; '.join(em['invalid_because'])}); the comparison above does not count. Achieved: {speeds}."
    )


def _bound_line(summary: dict) -> str:
    """What no partition could beat here: perfect uneven TP with free communication (or nothing)."""
    b = summary.get("free_comm_bound")
    if b is None:
        return ""
    return (
        f"Free-communication bound: each rank repeats {b['replicated_s']:.3f} s of a step whatever its share, "
        f"{b['sharded_s']:.3f} s shards; a perfect uneven split would take {b['step_time_s']:.3f} s, "
        f"{b['ratio_vs_fast_alone']:.2f} x the fastest device alone."
    )


def _load_line(summary: dict) -> str:
    ml = summary.get("machine_load", {})
    ach = summary.get("tp", {}).get("achieved_relative_speeds")
    how = (
        "compute dilated at every synchronisation, hwtopo.dilate"
        if ml.get("emulated") == "dilation"
        else "a top-priority cgroup CPU quota per rank, xronos.emulation.RankQuota"
    )
    parts = [
        f"emulated: {ml.get('emulated', 'cgroup')}. Machine load (1-min load average) "
        f"{ml.get('loadavg_1min_start', 0):.1f} -> {ml.get('loadavg_1min_end', 0):.1f} on {ml.get('cpus')} CPUs; "
        f"emulated ranks run at speed x {ml.get('cpu_share', 1.0):g} ({how})."
    ]
    if ach:
        parts.append(
            "Relative speeds the emulation actually achieved (even-TP compute time): "
            + ", ".join(f"{a:.2f}" for a in ach)
            + "."
        )
    return " ".join(parts)


def _timeline_plot(results: list[dict], path: Path) -> bool:
    plt = console.pyplot("xronos")
    names = [n for n in ("xronos", "tp") if n in results[0]["timelines"]]
    if plt is None or not names:
        return False
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.6 + 1.1 * len(results) * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        t_base = min(r["timelines"][name]["t0"] for r in results)
        for r in results:
            tl = r["timelines"][name]
            y = r["rank"]
            ax.broken_barh([(tl["t0"] - t_base, tl["step_s"])], (y - 0.35, 0.7), color="tab:green")
            ax.broken_barh([(a - t_base, b - a) for a, b in tl["events"]], (y - 0.35, 0.7), color="tab:red")
        ax.set_yticks([r["rank"] for r in results], [f"rank {r['rank']} (speed {r['speed']})" for r in results])
        ax.set_title(
            f"{name}: one step, green = computing, red = waiting in all-reduce "
            f"(emulated: {results[0].get('emulated', 'cgroup')})"
        )
        ax.set_xlabel("seconds")
    console.save_figure(fig, path, dpi=100)
    return True


def _run_compare(args, cfg, speeds, variants):
    from .bench import headline, run_comparison, summarize
    from .launch import check_emulation, emulation_label

    t0 = time.perf_counter()
    args.emulate = check_emulation(args.emulate)  # auto -> the method this machine allows
    share, busy = _cpu_share(args.cpu_share, speeds, args.emulate)
    load0 = os.getloadavg()[0]
    results = run_comparison(
        cfg, speeds, variants, rebalance_every=args.rebalance_every, cpu_share=share, emulate=args.emulate
    )
    summary = summarize(results)
    summary["machine_load"] = {
        "emulated": emulation_label(args.emulate),
        "loadavg_1min_start": load0,
        "loadavg_1min_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "cpu_share": share,
        "busy_cpus_before": busy,
    }
    return results, summary, headline(summary), time.perf_counter() - t0


def _fmt(value) -> str:
    """A headline value for the report: numbers to 4 significant digits, lists element-wise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return f"{value:.4g}"


def _demo_report(cfg, speeds, summary, head, rows, plotted: bool) -> str:
    md = [
        f"# xronos demo ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"LoRA (r=8) fine-tuning of a tiny {cfg.family} ({cfg.layers} layers, hidden {cfg.hidden}) on Python "
        f"stdlib sources, {cfg.steps} steps, {len(speeds)} ranks at **emulated** relative speeds {speeds} "
        f"(emulated: {summary['machine_load']['emulated']}, on one shared machine).",
        "",
        console.table(rows),
        "",
        "Headline: " + ", ".join(f"`{k}` = {_fmt(v)}" for k, v in head.items()),
        "",
        _load_line(summary),
        "",
        _validity_line(summary),
        "",
    ]
    if plotted:
        md.append("- timeline.png: one step per rank, computing vs waiting at all-reduces, Xronos vs even TP")
    return "\n".join(md) + "\n"


def cmd_demo(args) -> int:
    import hwtopo

    speeds = _speeds(args.speeds)
    cfg = _cfg(args, lora_r=8)
    out = console.output_dir(args.out, "--out")
    if not args.quiet:
        print(
            f"xronos demo: LoRA fine-tune on {len(speeds)} emulated ranks at speeds {speeds}, {cfg.steps} steps",
            file=sys.stderr,
        )
    results, summary, head, wall = _run_compare(args, cfg, speeds, ["reference", "xronos", "tp"])
    rows = _rows(summary)
    print(console.table(rows))
    print(_load_line(summary))
    print(_validity_line(summary))
    print(json.dumps(head, indent=2))
    for r in results:
        r["emulated"] = summary["machine_load"]["emulated"]
    plotted = _timeline_plot(results, out / "timeline.png")
    hwtopo.atomic_write_text(out / "report.md", _demo_report(cfg, speeds, summary, head, rows, plotted))
    hwtopo.atomic_write_text(out / "results.json", json.dumps({"summary": summary, "headline": head}, indent=2))
    if not args.quiet:
        print(f"wrote {out / 'report.md'} in {wall:.0f}s", file=sys.stderr)
    return 0


def _bench_seeds(args) -> list[int]:
    """The seeds the bench reports: --seeds, else the held-out ones (one with --quick)."""
    from .bench import REPORT_SEEDS

    if args.seeds is None:
        return list(REPORT_SEEDS[:1] if args.quick else REPORT_SEEDS)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(not 0 <= x <= MAX_SEED for x in seeds) or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds: {args.seeds!r} must list distinct integers >= 0, e.g. 1,2,3")
    return seeds


def cmd_bench(args) -> int:
    from .bench import combine_seeds

    speeds = _speeds(args.speeds) if args.speeds else ([1.0, 0.5] if args.quick else [1.0, 0.7, 0.4])
    seeds = _bench_seeds(args)
    cfgs = [_cfg(args, lora_r=args.lora_r, seed=seed) for seed in seeds]
    json_path = console.output_file(args.json, "--json") if args.json else None
    if not args.quiet:
        print(
            f"xronos bench: {len(speeds)} emulated ranks at speeds {speeds}, {cfgs[0].steps} steps, seeds {seeds}",
            file=sys.stderr,
        )
    # the libraries' baselines fine-tune every weight; with --lora-r the hand-written GPipe stays
    libraries = ["dtensor", "pipelining"] if not args.lora_r else []
    variants = ["reference", "xronos", "tp", *libraries[:1], "pp", *libraries[1:]]
    runs = {}
    for seed, cfg in zip(seeds, cfgs):
        results, summary, head, wall = _run_compare(args, cfg, speeds, variants)
        print(f"seed {seed}:")
        print(console.table(_rows(summary)))
        print(_load_line(summary))
        print(_validity_line(summary))
        print(_bound_line(summary))
        runs[seed] = (results, summary, head, wall)
    head = combine_seeds({seed: run[2] for seed, run in runs.items()})
    print(json.dumps(head, indent=2))
    if json_path is not None:
        console.write_json(json_path, _bench_doc(args, cfgs[0], speeds, runs, head))
    return 0


def _bench_doc(args, cfg, speeds: list[float], runs: dict, head: dict) -> dict:
    """The bench JSON: config (seeds listed), machine, per-seed results, headline over the seeds."""
    from .bench import DEVELOPMENT_SEEDS, emulation_info
    from .launch import worker_env

    first = next(iter(runs.values()))
    summary = first[1]
    config = {
        **{k: v for k, v in cfg.to_dict().items() if k != "seed"},
        "speeds": speeds,
        "quick": bool(args.quick),
        "wall_s": sum(run[3] for run in runs.values()),
        "seeds": {
            "reported": list(runs),
            "development": list(DEVELOPMENT_SEEDS),
            "held_out": not set(runs) & set(DEVELOPMENT_SEEDS),
            "note": "the rebalancer's settings (calibration margin, window minimum, threshold) were chosen "
            "on the development seeds; the headline is the median over the reported seeds",
        },
        "note": "measured on a shared, loaded machine; ratios are from interleaved runs, one per seed",
        "worker_env": worker_env(),  # what spawn adds to every rank's environment (all variants alike)
        "emulated": summary["machine_load"]["emulated"],
    }
    results = {f"seed_{seed}": {**run[1], "profiles": [r["profile"] for r in run[0]]} for seed, run in runs.items()}
    emulated = {
        **emulation_info(speeds, summary["machine_load"]["cpu_share"], args.emulate),
        "dilation_per_rank": {f"seed_{seed}": [r.get("dilation") for r in run[0]] for seed, run in runs.items()},
    }
    return console.bench_doc("xronos", __version__, config, results, head, emulated=emulated)


def _save_target(text: str) -> Path:
    """--save: a directory that save_pretrained replaces whole, in a directory that exists already."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--save {text!r} exists and is not a directory")
    return console.output_file(p, "--save") if not p.is_dir() else console.output_dir(p, "--save")


def _train_paths(args) -> dict:
    """The output and input paths of ``xronos train``, checked before any rank starts."""
    if args.data and not Path(args.data).is_file():
        raise UsageError(f"--data: {args.data} is not a readable file")
    return {
        "ckpt_dir": None if args.ckpt_dir is None else str(console.output_dir(args.ckpt_dir, "--ckpt-dir")),
        "save_dir": None if args.save is None else str(_save_target(args.save)),
        "memory_bytes": None if args.memory is None else _bytes(args.memory),
    }


def cmd_train(args) -> int:
    from .launch import emulation_label
    from .runner import finetune

    speeds = _speeds(args.speeds)
    cfg = _cfg(args, lora_r=args.lora_r)
    paths = _train_paths(args)
    if args.torchrun:
        return _train_torchrun(args, cfg, speeds, paths)
    res = finetune(cfg, speeds, args.mode, ckpt_every=args.ckpt_every, emulate=args.emulate or "dilate", **paths)
    r0 = res[0]
    report = {
        "partition": r0["partition"],
        "resumed_from": r0["resumed_from"],
        "final_train_loss": r0["losses"][-1] if r0["losses"] else None,
        "eval_loss": r0["eval_loss"],
        "perplexity": r0["perplexity"],
        "saved": r0["saved"],
        "emulated_speeds": speeds,
        "emulated": emulation_label(args.emulate or "dilate") if min(speeds) < 1 else None,
    }
    print(json.dumps(report, indent=2))
    return 0


def _train_torchrun(args, cfg, speeds, paths) -> int:
    """One rank of a torchrun / multi-node launch (env rendezvous); rank 0 prints the report."""
    from .launch import emulation_label
    from .runner import finetune_torchrun

    world = os.environ.get("WORLD_SIZE")
    if world is not None and len(speeds) not in (1, int(world)):
        raise UsageError(f"--speeds lists {len(speeds)} ranks but WORLD_SIZE is {world}")
    r = finetune_torchrun(
        cfg, speeds, args.mode, ckpt_every=args.ckpt_every, emulate=args.emulate, threads=args.threads, **paths
    )
    if r is not None:
        out = {k: r[k] for k in ("partition", "resumed_from", "eval_loss", "perplexity", "saved")}
        # every output says whether this rank's speed was emulated, and how
        out["emulated"] = emulation_label(args.emulate) if args.emulate else False
        out["speeds"] = list(speeds)
        if args.emulate == "dilate" and args.threads > 1:
            out["emulation_note"] = "dilation counts the main thread's CPU only; intra-op threads run undilated"
        print(json.dumps(out, indent=2), flush=True)
    return 0


def _bytes(text: str) -> float:
    import math

    import hwtopo

    try:
        v = float(hwtopo.parse_bytes(text))
    except (hwtopo.SpecError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise UsageError(f"--memory: {text!r} is not a positive size; use e.g. 512MiB")
    return v


def cmd_partition(args) -> int:
    from .partition import costs_from_speeds, even_partition, partition, segment_objective

    cfg = _cfg(args)
    shape = cfg.shape()
    if args.cluster:
        import hwtopo

        from .profile import costs_from_cluster

        try:
            cluster = hwtopo.load(args.cluster)
        except (hwtopo.SpecError, OSError) as e:
            raise UsageError(f"--cluster: {e}") from None
        costs = costs_from_cluster(cluster, shape)
    else:
        speeds = _speeds(args.speeds)
        mem = [_bytes(m) for m in args.memory.split(",")] if args.memory else None
        if mem is not None and len(mem) != len(speeds):
            raise UsageError(f"--memory lists {len(mem)} sizes but --speeds lists {len(speeds)} ranks")
        costs = costs_from_speeds(speeds, shape, memory_bytes=mem)
    p = partition(shape, costs)
    even = even_partition(shape, len(costs))
    assert p.predicted_layer_s is not None  # partition() predicts it
    speedup = segment_objective(costs, even.attn_units, even.mlp_units) / p.predicted_layer_s
    print(json.dumps({"xronos": p.describe(), "even": even.describe(), "predicted_speedup_vs_even": speedup}, indent=2))
    return 0


def _train_parser(sub) -> None:
    t = console.command(sub, "train", "fine-tune with checkpoints (resumes), evaluate, optionally save_pretrained")
    t.add_argument("--speeds", default="1.0,0.5", help="emulated relative speed per rank")
    t.add_argument("--mode", default="xronos", choices=["xronos", "tp"])
    t.add_argument(
        "--lora-r", type=console.integer("--lora-r", 0, MAX_WIDTH), default=0, help="LoRA rank (0: full fine-tuning)"
    )
    t.add_argument("--data", help="a text file (default: the Python standard library's sources)")
    t.add_argument("--ckpt-dir", help="checkpoint directory (default: in the user cache directory)")
    t.add_argument(
        "--ckpt-every", type=console.integer("--ckpt-every", 0, MAX_COUNT), default=10, help="0: at the end only"
    )
    t.add_argument("--save", help="write the gathered full model to this directory (save_pretrained)")
    t.add_argument("--memory", help="memory per rank for shards, e.g. 64MiB")
    t.add_argument(
        "--torchrun",
        action="store_true",
        help="run as one rank of a torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
    )
    _emulate_arg(
        t,
        default=None,
        note="; with --torchrun a rank is slowed only when --emulate is given (alone: dilate)",
        nargs="?",
        const="dilate",
    )
    t.add_argument("--threads", type=console.positive_int("--threads", 1024), default=1, help="with --torchrun")
    _model_args(t, min_steps=0)


def _finetune_paths(args) -> dict:
    """``xronos finetune``'s model directory and output, checked before any rank starts."""
    from .pretrained import PretrainedError, check_finetune

    if args.data and not Path(args.data).is_file():
        raise UsageError(f"--data: {args.data} is not a readable file")
    try:
        check_finetune(args.model, args.cfg, len(args.speed_list))
    except PretrainedError as e:
        raise UsageError(f"--model: {e}") from None
    save = None
    if args.save_merged is not None:
        p = Path(args.save_merged)
        if p.exists() and not p.is_dir():
            raise UsageError(f"--save-merged {args.save_merged!r} exists and is not a directory")
        save = str(
            console.output_file(p, "--save-merged") if not p.exists() else console.output_dir(p, "--save-merged")
        )
    return {"save_dir": save, "memory_bytes": None if args.memory is None else _bytes(args.memory)}


def cmd_finetune(args) -> int:
    from .launch import emulation_label
    from .pretrained import finetune_pretrained
    from .train import TrainConfig

    args.speed_list = _speeds(args.speeds)
    fields = dict(
        seq_len=args.seq_len,
        batch=args.batch,
        micro_batches=args.batch,  # no pipeline here
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        data=args.data,
        vocab_parallel=args.vocab_parallel,
        mlp_block=args.mlp_block,
        lora_r=args.lora_r,
    )
    args.cfg = TrainConfig(**fields)
    paths = _finetune_paths(args)
    res = finetune_pretrained(args.model, args.cfg, args.speed_list, args.mode, emulate=args.emulate, **paths)
    r0 = res[0]
    report = {
        "model": str(args.model),
        "partition": r0["partition"],
        "vocab_parallel": r0["vocab_parallel"],
        "tokens": r0["tokens"],
        "load_per_rank": [r["load"] for r in res],
        "final_train_loss": r0["losses"][-1] if r0["losses"] else None,
        "eval_loss": r0["eval_loss"],
        "saved_merged": r0["saved"],
        "emulated_speeds": args.speed_list,
        "emulated": emulation_label(args.emulate) if min(args.speed_list) < 1 else None,
    }
    print(json.dumps(report, indent=2))
    return 0


def _finetune_parser(sub) -> None:
    f = console.command(
        sub,
        "finetune",
        "LoRA fine-tune a pretrained model from a local directory (safetensors; Llama, Qwen2, Mistral), each rank "
        "reading only its uneven shard, and save the merged model for from_pretrained",
    )
    f.add_argument("--model", required=True, help="local model directory: config.json and *.safetensors")
    f.add_argument(
        "--save-merged", help="write the model with LoRA merged into its weights here (replaced whole; from_pretrained)"
    )
    f.add_argument("--speeds", default="1.0,0.5", help="emulated relative speed per rank")
    f.add_argument("--mode", default="xronos", choices=["xronos", "tp"], help="uneven (xronos) or even shards (tp)")
    f.add_argument(
        "--lora-r", type=console.integer("--lora-r", 0, MAX_WIDTH), default=8, help="LoRA rank (0: full fine-tuning)"
    )
    f.add_argument(
        "--data",
        help="a text file, tokenized by the model directory's tokenizer, else trained on as bytes (default: the "
        "Python standard library's sources)",
    )
    f.add_argument("--memory", help="memory per rank for shards, e.g. 64MiB")
    _emulate_arg(f, default="dilate")
    _model_args(f, steps=10, min_steps=0, shape=False)


def build_parser() -> argparse.ArgumentParser:
    ap, sub = console.parser("xronos", "Heterogeneity-aware tensor parallelism on CPUs.", __version__)
    d = console.command(sub, "demo", "short LoRA fine-tune on an emulated heterogeneous pair, table + timeline plot")
    d.add_argument(
        "--out", default="demo-output/xronos", help="directory for report.md and timeline.png (its parent must exist)"
    )
    d.add_argument("--speeds", default="1.0,0.5", help="emulated relative speed per rank")
    _model_args(d, steps=10)
    _emulation_args(d)
    b = console.command(
        sub,
        "bench",
        "Xronos vs even TP (its own and DTensor's) vs pipelines (hand-written GPipe, torch.distributed.pipelining "
        "GPipe and 1F1B) vs the fastest device alone, side by side",
    )
    b.add_argument("--quick", action="store_true", help="2 ranks at speeds 1.0,0.5 (under 3 minutes)")
    b.add_argument("--json", help="write the results JSON here")
    b.add_argument("--speeds", help="emulated relative speed per rank (1.0,0.5 with --quick; else 1.0,0.7,0.4)")
    b.add_argument("--lora-r", type=console.integer("--lora-r", 0, MAX_WIDTH), default=0, help="LoRA rank (0: full)")
    b.add_argument(
        "--seeds",
        help="comma-separated seeds to report (default: the held-out seed 1 with --quick, else 1,2,3; the "
        "settings were chosen on seed 0)",
    )
    _model_args(b, seed=False)
    _emulation_args(b)
    _train_parser(sub)
    _finetune_parser(sub)
    p = console.command(sub, "partition", "print the partition for given speeds (or an hwtopo cluster spec)")
    p.add_argument("--speeds", default="1.0,0.5", help="emulated relative speed per rank")
    p.add_argument("--memory", help="comma-separated memory per rank for shards, e.g. 8MiB,64MiB")
    p.add_argument("--cluster", help="hwtopo cluster spec (name or file) instead of --speeds")
    _model_args(p, training=False)
    return ap


def _input_errors(handler):
    """A model that cannot be split as asked (PartitionError) is bad input: exit 2, not a failure."""

    @functools.wraps(handler)
    def run(args):
        from .partition import PartitionError

        try:
            return handler(args)
        except PartitionError as e:
            raise UsageError(str(e)) from None

    return run


def main(argv: list[str] | None = None) -> int:
    handlers = {
        "demo": cmd_demo,
        "bench": cmd_bench,
        "train": cmd_train,
        "finetune": cmd_finetune,
        "partition": cmd_partition,
    }
    return console.run(build_parser(), {k: _input_errors(v) for k, v in handlers.items()}, argv)


if __name__ == "__main__":
    sys.exit(main())
