"""Command line: ``xronos demo | bench | train | partition``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__

log = logging.getLogger("xronos")


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


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
            seed=args.seed,
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
    if cfg.family not in ("llama", "qwen2"):
        raise UsageError(f"--family must be llama or qwen2, not {cfg.family!r}")
    return cfg


def _model_args(p: argparse.ArgumentParser, steps: int | None = None, training: bool = True) -> None:
    """Model (and, with ``training``, data/optimisation) options; defaults come from :class:`TrainConfig`.

    One source of defaults: the CLI shows and uses ``TrainConfig``'s, except ``--steps`` where a
    command has its own (``steps``).
    """
    from .train import TrainConfig

    d = TrainConfig()
    g = p.add_argument_group("model and data" if training else "model")
    g.add_argument("--family", default=d.family, help=f"llama or qwen2 (tiny config built locally; default {d.family})")
    g.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden size (default {d.hidden})")
    g.add_argument("--layers", type=int, default=d.layers, help=f"decoder layers (default {d.layers})")
    g.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    g.add_argument(
        "--kv-heads",
        type=int,
        default=d.kv_heads,
        help=f"KV heads (default {d.kv_heads}; a KV group is the attention unit, so fewer groups make the "
        "attention split coarser)",
    )
    g.add_argument("--intermediate", type=int, default=d.intermediate, help=f"MLP width (default {d.intermediate})")
    g.add_argument(
        "--mlp-block", type=int, default=d.mlp_block, help=f"MLP columns per partition unit (default {d.mlp_block})"
    )
    if not training:
        return
    g.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    g.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    g.add_argument("--micro-batches", type=int, help=f"pipeline micro-batches (default {d.micro_batches}, or --batch)")
    g.add_argument("--steps", type=int, default=d.steps if steps is None else steps)
    g.add_argument(
        "--vocab-parallel",
        choices=("none", "head", "both"),
        default=d.vocab_parallel,
        help="split the LM head (head), or the LM head and the input embedding (both), by vocabulary across "
        f"ranks in proportion to their MLP shards; none: replicated (default: {d.vocab_parallel})",
    )
    g.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr:g})")
    g.add_argument("--seed", type=int, default=d.seed)


def _emulate_arg(p: argparse.ArgumentParser, default: str | None = "dilate", note: str = "", **kw) -> None:
    p.add_argument(
        "--emulate",
        choices=("dilate", "cgroup"),
        default=default,
        help="how an emulated slower rank is slowed: dilate (default; computes at full speed and sleeps "
        "(1/speed - 1) x its CPU time at every synchronisation, hwtopo.dilate: steady at ms scale) or cgroup "
        "(a CPU quota, hwtopo.throttle: short compute segments of a throttled rank vary by 20-35 %%)" + note,
        **kw,
    )


def _emulation_args(p: argparse.ArgumentParser) -> None:
    _emulate_arg(p)
    p.add_argument(
        "--cpu-share",
        default="auto",
        help="CPUs of the fastest emulated rank (rank r gets speed[r] x this), or 'auto': 1.0 on a quiet machine, "
        "0.5 or 0.3 when other programs (CPU use sampled for 1 s) would keep the CPU quotas from binding",
    )
    p.add_argument(
        "--rebalance-every",
        type=int,
        default=2,
        help="Xronos re-profiles from measured step times every N steps and reshards when the median of the "
        "last 3 such windows says it pays (0: off)",
    )


def _table(summary: dict, speeds: list[float]) -> list[list[str]]:
    rows = [["variant", "step time (s)", "idle ratio (max rank)", "compute stall", "eval loss", "shards / stages"]]
    for name, s in summary.items():
        if name == "machine_load":
            continue
        if "partition" in s:
            p = s["partition"]
            shards = f"heads {p['q_heads']} mlp {p['mlp_columns']}"
        elif "layers_per_stage" in s:
            shards = f"layers {s['layers_per_stage']}" + (
                f", {s['micro_batches']} micro-batches" if s.get("micro_batches") else ""
            )
        else:
            shards = "1 process, full model"
        rows.append(
            [
                name,
                f"{s['step_time_s']:.3f}",
                f"{s['idle_ratio']:.3f}" if "idle_ratio" in s else "-",
                f"{s['compute_stall_ratio']:.3f}" if "compute_stall_ratio" in s else "-",
                f"{s['eval_loss']:.5f}",
                shards,
            ]
        )
    return rows


def _busy_cpus(window_s: float = 1.0) -> float:
    """CPUs busy with other programs right now (from /proc/stat over ``window_s``; load average elsewhere).

    The 1-minute load average lags: right after other programs stop it still reads high, so it is used
    only where /proc/stat is missing.
    """

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    dt = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / dt) if dt > 0 else 0.0


def _cpu_share(text: str, speeds: list[float] | None = None, emulate: str = "cgroup") -> float:
    """'auto' or a number in (0, 1]. Auto: a share the loaded machine can still give each rank, lowered
    (in steps of 0.05) until every rank can be pinned to a CPU without oversubscribing it (3 ranks at
    1.0/0.7/0.4 on 2 cores: 0.9), so no rank's quota is eaten by another rank's threads. Under compute
    dilation no quota has to bind (a rank's speed is relative to the CPU time it gets), so auto starts
    from 1.0 whatever the load (still sampled and recorded) and is lowered only for the pinning."""
    if text == "auto":
        from .launch import pin_ranks

        busy = _busy_cpus()
        per_cpu = busy / (os.cpu_count() or 1)
        _cpu_share.busy_cpus = busy
        share = 1.0 if per_cpu < 0.25 or emulate == "dilate" else 0.5 if per_cpu < 0.75 else 0.3
        while speeds and share > 0.1 and pin_ranks([s * share for s in speeds]) is None:
            share = round(share - 0.05, 2)
        return share
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise UsageError(f"--cpu-share must be 'auto' or a number in (0, 1], not {text!r}")
    return v


def _load_line(summary: dict) -> str:
    ml = summary.get("machine_load", {})
    ach = summary.get("tp", {}).get("achieved_relative_speeds")
    how = (
        "compute dilated at every synchronisation, hwtopo.dilate"
        if ml.get("emulated") == "dilation"
        else "CPU quota, hwtopo.throttle"
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


def _fmt_table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def _timeline_plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'xronos[plot]'); no plot written")
        return False
    names = [n for n in ("xronos", "tp") if n in results[0]["timelines"]]
    if not names:
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _run_compare(args, cfg, speeds, variants):
    from .bench import headline, run_comparison, summarize

    t0 = time.perf_counter()
    args.cpu_share = _cpu_share(args.cpu_share, speeds, args.emulate)
    if args.rebalance_every < 0:
        raise UsageError(f"--rebalance-every must be >= 0 (0 disables), not {args.rebalance_every}")
    from .launch import emulation_label

    load0 = os.getloadavg()[0]
    results = run_comparison(
        cfg, speeds, variants, rebalance_every=args.rebalance_every, cpu_share=args.cpu_share, emulate=args.emulate
    )
    summary = summarize(results)
    summary["machine_load"] = {
        "emulated": emulation_label(args.emulate),
        "loadavg_1min_start": load0,
        "loadavg_1min_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "cpu_share": args.cpu_share,
        "busy_cpus_before": getattr(_cpu_share, "busy_cpus", None),
    }
    return results, summary, headline(summary), time.perf_counter() - t0


def cmd_demo(args) -> int:
    speeds = _speeds(args.speeds)
    cfg = _cfg(args, lora_r=8)
    if cfg.steps < 1:
        raise UsageError(f"--steps must be >= 1 to compare step times, not {cfg.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.quiet:
        print(
            f"xronos demo: LoRA fine-tune on {len(speeds)} emulated ranks at speeds {speeds}, {cfg.steps} steps",
            file=sys.stderr,
        )
    results, summary, head, wall = _run_compare(args, cfg, speeds, ["reference", "xronos", "tp"])
    rows = _table(summary, speeds)
    print(_fmt_table(rows, False))
    print(_load_line(summary))
    print(json.dumps(head, indent=2))
    for r in results:
        r["emulated"] = summary["machine_load"]["emulated"]
    plotted = _timeline_plot(results, out / "timeline.png")
    import hwtopo

    md = [
        f"# xronos demo ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"LoRA (r=8) fine-tuning of a tiny {cfg.family} ({cfg.layers} layers, hidden {cfg.hidden}) on Python "
        f"stdlib sources, {cfg.steps} steps, {len(speeds)} ranks at **emulated** relative speeds {speeds} "
        f"(emulated: {summary['machine_load']['emulated']}, on one shared machine; measured on a loaded 2-core "
        "machine).",
        "",
        _fmt_table(rows, True),
        "",
        "Headline: " + ", ".join(f"`{k}` = {v:.4g}" for k, v in head.items()),
        "",
        _load_line(summary),
        "",
    ]
    if plotted:
        md.append("- timeline.png: one step per rank, computing vs waiting at all-reduces, Xronos vs even TP")
    hwtopo.atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    hwtopo.atomic_write_text(out / "results.json", json.dumps({"summary": summary, "headline": head}, indent=2))
    if not args.quiet:
        print(f"wrote {out / 'report.md'} in {wall:.0f}s", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import hwtopo

    from .bench import emulation_info
    from .launch import worker_env

    speeds = _speeds(args.speeds) if args.speeds else ([1.0, 0.5] if args.quick else [1.0, 0.7, 0.4])
    cfg = _cfg(args, lora_r=args.lora_r)
    if cfg.steps < 1:
        raise UsageError(f"--steps must be >= 1 to compare step times, not {cfg.steps}")
    if not args.quiet:
        print(f"xronos bench: {len(speeds)} emulated ranks at speeds {speeds}, {cfg.steps} steps", file=sys.stderr)
    results, summary, head, wall = _run_compare(args, cfg, speeds, ["reference", "xronos", "tp", "pp"])
    print(_fmt_table(_table(summary, speeds), False))
    print(_load_line(summary))
    print(json.dumps(head, indent=2))
    doc = {
        "package": "xronos",
        "version": __version__,
        "config": {
            **cfg.to_dict(),
            "speeds": speeds,
            "quick": bool(args.quick),
            "wall_s": wall,
            "note": "measured on a shared, loaded machine; ratios are from one interleaved run",
            "worker_env": worker_env(),  # what spawn adds to every rank's environment (all variants alike)
            "emulated": summary["machine_load"]["emulated"],
        },
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": {**summary, "profiles": [r["profile"] for r in results]},
        "headline": head,
        "emulated": {
            **emulation_info(speeds, args.cpu_share, args.emulate),
            "dilation_per_rank": [r.get("dilation") for r in results],
        },
    }
    if args.json:
        hwtopo.atomic_write_text(Path(args.json), json.dumps(doc, indent=2, default=str) + "\n")
    return 0


def cmd_train(args) -> int:
    from .launch import emulation_label
    from .runner import finetune

    speeds = _speeds(args.speeds)
    cfg = _cfg(args, lora_r=args.lora_r)
    if args.data and not Path(args.data).is_file():
        raise UsageError(f"--data: {args.data} is not a readable file")
    if args.torchrun:
        return _train_torchrun(args, cfg, speeds)
    res = finetune(
        cfg,
        speeds,
        args.mode,
        args.ckpt_dir,
        args.ckpt_every,
        args.save,
        None if args.memory is None else _bytes(args.memory),
        emulate=args.emulate or "dilate",
    )
    r0 = res[0]
    print(
        json.dumps(
            {
                "partition": r0["partition"],
                "resumed_from": r0["resumed_from"],
                "final_train_loss": r0["losses"][-1] if r0["losses"] else None,
                "eval_loss": r0["eval_loss"],
                "perplexity": r0["perplexity"],
                "saved": r0["saved"],
                "emulated_speeds": speeds,
                "emulated": emulation_label(args.emulate or "dilate") if min(speeds) < 1 else None,
            },
            indent=2,
        )
    )
    return 0


def _train_torchrun(args, cfg, speeds) -> int:
    """One rank of a torchrun / multi-node launch (env rendezvous); rank 0 prints the report."""
    import torch
    import torch.distributed as dist

    from .launch import emulate_speed, emulation_label, init_from_env
    from .runner import _finetune_worker, cache_dir

    torch.set_num_threads(int(args.threads))
    rank, world = init_from_env(timeout_s=300)
    if len(speeds) not in (1, world):
        raise UsageError(f"--speeds lists {len(speeds)} ranks but WORLD_SIZE is {world}")
    speed = speeds[rank] if len(speeds) == world else speeds[0]
    throttle = emulate_speed(speed, args.emulate) if args.emulate else None
    try:
        ckpt = args.ckpt_dir or str(cache_dir() / f"{cfg.family}-{args.mode}-{world}r-seed{cfg.seed}")
        Path(ckpt).mkdir(parents=True, exist_ok=True)
        mem = None if args.memory is None else _bytes(args.memory)
        r = _finetune_worker(rank, world, cfg.to_dict(), args.mode, ckpt, args.ckpt_every, args.save, mem)
        if rank == 0:
            out = {k: r[k] for k in ("partition", "resumed_from", "eval_loss", "perplexity", "saved")}
            # every output says whether this rank's speed was emulated, and how
            out["emulated"] = emulation_label(args.emulate) if args.emulate else False
            out["speeds"] = list(speeds)
            if args.emulate == "dilate" and args.threads > 1:
                out["emulation_note"] = "dilation counts the main thread's CPU only; intra-op threads run undilated"
            print(json.dumps(out, indent=2), flush=True)
        # no rank tears its process group down while another still talks to it: a rank that exited with
        # its gloo group alive aborted ("terminate called without an active exception") in 2 of 20
        # torchrun runs under load (00:30 UTC), failing a launch whose training had finished
        dist.barrier()
    finally:
        if throttle is not None:
            throttle.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _bytes(text: str) -> float:
    import hwtopo

    try:
        return float(hwtopo.parse_bytes(text))
    except (hwtopo.SpecError, ValueError):
        raise UsageError(f"--memory: {text!r} is not a size; use e.g. 512MiB") from None


def cmd_partition(args) -> int:
    from .partition import costs_from_speeds, even_partition, partition

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
    e = even_partition(shape, len(costs))
    from .partition import segment_objective

    print(
        json.dumps(
            {
                "xronos": p.describe(),
                "even": e.describe(),
                "predicted_speedup_vs_even": segment_objective(costs, e.attn_units, e.mlp_units) / p.predicted_layer_s,
            },
            indent=2,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xronos", description="Heterogeneity-aware tensor parallelism on CPUs.")
    ap.add_argument("--version", action="version", version=f"xronos {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--quiet", action="store_true", help="no progress output")
        p.add_argument("--debug", action="store_true", help="show tracebacks")

    d = sub.add_parser("demo", help="short LoRA fine-tune on an emulated heterogeneous pair, table + timeline plot")
    d.add_argument("--out", default="demo-output/xronos", help="output directory (report.md, timeline.png)")
    d.add_argument("--speeds", default="1.0,0.5", help="emulated relative speed per rank")
    _model_args(d, steps=10)
    _emulation_args(d)
    common(d)
    b = sub.add_parser("bench", help="Xronos vs even TP vs GPipe PP vs single-process reference, side by side")
    b.add_argument("--quick", action="store_true", help="2 ranks at speeds 1.0,0.5 (under 3 minutes)")
    b.add_argument("--json", help="write the results JSON here")
    b.add_argument("--speeds", help="emulated relative speed per rank (default 1.0,0.5 quick; 1.0,0.7,0.4 full)")
    b.add_argument("--lora-r", type=int, default=0, help="LoRA rank for every variant, PP included (0: full)")
    _model_args(b)
    _emulation_args(b)
    common(b)
    t = sub.add_parser("train", help="fine-tune with checkpoints (resumes), evaluate, optionally save_pretrained")
    t.add_argument("--speeds", default="1.0,0.5")
    t.add_argument("--mode", default="xronos", choices=["xronos", "tp"])
    t.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    t.add_argument("--data", help="a text file (default: the Python standard library's sources)")
    t.add_argument("--ckpt-dir", help="checkpoint directory (default under ~/.cache/mlsyskit/xronos)")
    t.add_argument("--ckpt-every", type=int, default=10)
    t.add_argument("--save", help="write the gathered full model here (save_pretrained)")
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
    t.add_argument("--threads", type=int, default=1, help="with --torchrun: torch threads per rank")
    _model_args(t)
    common(t)
    p = sub.add_parser("partition", help="print the partition for given speeds (or an hwtopo cluster spec)")
    p.add_argument("--speeds", default="1.0,0.5")
    p.add_argument("--memory", help="comma-separated memory per rank for shards, e.g. 8MiB,64MiB")
    p.add_argument("--cluster", help="hwtopo cluster spec (name or file) instead of --speeds")
    _model_args(p, training=False)
    common(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    handlers = {"demo": cmd_demo, "bench": cmd_bench, "train": cmd_train, "partition": cmd_partition}
    from .launch import WorkerError
    from .partition import PartitionError

    try:
        return handlers[args.cmd](args)
    except (UsageError, PartitionError) as e:
        if args.debug:
            raise
        print(f"xronos: error: {e}", file=sys.stderr)
        return 2
    except (WorkerError, RuntimeError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"xronos: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - anything else is a runtime failure too: one line unless --debug
        if args.debug:
            raise
        print(f"xronos: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
