"""geomesh command line: demo, bench, plan (the mlsyskit convention, hwtopo.console)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hwtopo
from hwtopo import console
from hwtopo.console import UsageError

from . import __version__

# the reference run, GeoMesh vs DiLoCo-fp32 at 2 held-out seeds on latency-bound links (where fp16 runs
# as fast as fp32: same hops, bytes a small part of a sync), and GeoMesh vs DiLoCo fp32 and fp16 on
# bandwidth-bound links; DiLoCo-fp16, DDP and async on latency-bound links in the full run
QUICK = {"outer_steps": 12, "repeat_seeds": 1, "methods": ("geomesh", "diloco-fp32")}
FULL = {"outer_steps": 20, "hidden": 96, "text_bytes": 3_000_000}
# Bounds of `plan`'s numbers: far beyond any real run, low enough that a typo fails instead of
# printing a plan of absurd sizes.
MAX_TOKENS = 10**12  # tokens of one outer step, all workers together
MAX_TOKENS_PER_S = 1e9  # training throughput of a speed-1.0 machine
MAX_SEQ_LEN = 1 << 20
MAX_BYTES = 1 << 50  # 1 PiB of memory per worker


def _config(args, quick: bool):
    from .bench import BenchConfig

    kw: dict[str, Any] = dict(QUICK if quick else FULL)
    if args.outer_steps is not None:
        kw["outer_steps"] = args.outer_steps
    if args.seeds is not None:
        kw["repeat_seeds"] = args.seeds - 1
    if args.methods:
        kw["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    kw["cluster"] = args.cluster
    kw["wan"] = args.wan
    kw["cpu_emulation"] = args.cpu_emulation
    cfg = BenchConfig(**kw)
    try:
        cfg.validate()
    except (ValueError, OSError) as e:  # SpecError (a ValueError) or OSError: the --cluster spec
        spec_problem = isinstance(e, (hwtopo.SpecError, OSError))
        raise UsageError(f"--cluster: {e}" if spec_problem else str(e)) from None
    return cfg


def _fmt(v, digits=3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x, digits)}" for k, x in v.items())
    return str(v)


def table(result: dict) -> str:
    """The methods side by side (latency-bound, then bandwidth-bound links), then the headline keys."""
    rows = _rows(result["results"], "latency-bound")
    rows += _rows(result.get("bw_bound", {}).get("results", {}), "bandwidth-bound")
    head = [{"headline": f"`{k}`", "value": _fmt(v, 4)} for k, v in result["headline"].items()]
    return console.table(rows) + "\n\n" + console.table(head)


def _rows(results: dict, links: str) -> list[dict]:
    return [
        {
            "method (emulated speeds + WAN)": name,
            "links": links,
            "wall s": f"{r['wall_s']:.1f}",
            "time to target s": _fmt(r.get("time_to_target_s")),
            "final val ppl": f"{r['final_ppl']:.2f}",
            "tokens": r["tokens"],
            "straggler idle": f"{r['straggler_idle']:.3f}",
            "comm fraction": f"{r['comm_fraction']:.3f}",
            "bytes/worker/sync": r["payload_bytes_per_worker_per_sync"],
            "wire bytes measured": _fmt(r.get("measured_wire_bytes_per_worker_per_sync")),
        }
        for name, r in results.items()
    ]


@contextlib.contextmanager
def _progress(cfg, quiet: bool) -> Iterator[Callable[[str], None]]:
    """A bar over the bench's method runs; the callable names each run as it starts."""
    pair = ("geomesh", "diloco-fp32")
    repeats = cfg.repeat_seeds * len(pair) if all(m in cfg.methods for m in pair) else 0
    bw = len(cfg.bw_bound_methods) if cfg.bw_bound_scale > 0 else 0
    loss = 1 if cfg.worker_loss else 0
    bar = console.progress(total=1 + len(cfg.methods) + repeats + bw + loss, desc="geomesh bench", quiet=quiet)
    started: list[str] = []

    def starting(method: str) -> None:
        if started:
            bar.update(1)
        started.append(method)
        bar.set_postfix_str(f"{method}: 3 workers, emulated speeds and WAN")

    try:
        yield starting
        bar.update(1 if started else 0)
    finally:
        bar.close()


def _bench(cfg, quiet: bool) -> dict:
    from .bench import run_bench

    with _progress(cfg, quiet) as progress:
        res = run_bench(cfg, progress=progress)
    return {
        "package": "geomesh",
        "version": __version__,
        "config": res["config"],
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "seeds": res["seeds"],
        "reference": res["reference"],
        "results": res["results"],
        "headline": res["headline"],
        "repeats": res.get("repeats", []),
        "bw_bound": res["bw_bound"],
        "simulation": res["simulation"],
        "worker_loss": res["worker_loss"],
        "emulated": res["emulated"],
    }


def _plot(result: dict, path: Path) -> bool:
    plt = console.pyplot("geomesh")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in result["results"].items():
        c = r["curve"]
        ax.plot([p["time_s"] for p in c], [p["ppl"] for p in c], marker="o", ms=3, label=name)
    target = result["headline"].get("target_ppl")
    if target:
        ax.axhline(target, color="grey", ls="--", lw=0.8, label="target ppl")
    ax.set_yscale("log")
    ax.set_xlabel("wall time, s (emulated CPU speeds 1.0/0.7/0.4 and WAN links)")
    ax.set_ylabel("validation perplexity (bytes)")
    ax.set_title("geomesh vs baselines: tiny Llama on Python stdlib text, 3 workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cmd_bench(args) -> int:
    cfg = _config(args, args.quick)
    out = console.output_file(args.json, "--json") if args.json else None
    result = _bench(cfg, args.quiet)
    print(table(result))
    if out is not None:
        hwtopo.atomic_write_text(out, json.dumps(result, indent=2, default=str) + "\n")
    return 0


def cmd_demo(args) -> int:
    cfg = _config(args, True)
    out = console.output_dir(args.out, "--out")
    result = _bench(cfg, args.quiet)
    text = table(result)
    print(text)
    hwtopo.atomic_write_text(out / "bench.json", json.dumps(result, indent=2, default=str) + "\n")
    plotted = _plot(result, out / "ppl_vs_time.png")
    report = [
        "# geomesh demo",
        "",
        f"3 workers (emulated speeds {cfg.cpus:g} x cluster speeds of `{cfg.cluster}`, by "
        f"{'compute dilation (hwtopo.dilate)' if cfg.cpu_emulation == 'dilation' else 'cgroup CPU quota (hwtopo.throttle)'}"
        "), WAN links of the cluster spec emulated per collective; tiny Llama on Python stdlib "
        f"sources. Measured on this machine ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), possibly "
        "loaded.",
        "",
        text,
        "",
    ]
    if plotted:
        report.append("ppl_vs_time.png: validation perplexity against wall time for every method.")
    hwtopo.atomic_write_text(out / "report.md", "\n".join(report) + "\n")
    return 0


def cmd_plan(args) -> int:
    from .balance import BalanceError, MemoryModel, plan, profiles_from_cluster

    try:
        cluster = hwtopo.load(args.cluster)
    except (hwtopo.SpecError, OSError, ValueError) as e:
        raise UsageError(f"--cluster: {e}") from None
    profiles = profiles_from_cluster(cluster, args.tokens_per_s)
    mem = MemoryModel(args.fixed_memory, args.memory_per_sample)
    try:
        p = plan(profiles, args.seq_len, args.target_tokens, memory=mem, preferred_batch=args.batch)
    except BalanceError as e:
        raise UsageError(str(e)) from None
    print(f"phase {p.phase_s:.3f} s, tokens {p.tokens} (target {p.target_tokens}), imbalance {p.imbalance:.3%}")
    rows = [
        {
            "worker": w.name,
            "batch": w.batch,
            "inner steps": w.inner_steps,
            "tokens": w.tokens,
            "phase s": f"{w.phase_s:.3f}",
            "weight": f"{w.weight:.3f}",
        }
        for w in p.workers
    ]
    print(console.table(rows))
    return 0


def _run_args(p) -> None:
    """Options of the commands that train (bench, demo)."""
    p.add_argument("--cluster", default="geo-3region", help="hwtopo cluster spec (name or file); one worker a machine")
    p.add_argument("--outer-steps", type=console.positive_int("--outer-steps", 100_000), help="outer steps per method")
    p.add_argument(
        "--seeds",
        type=console.positive_int("--seeds", 100),
        help="seeds of the GeoMesh vs DiLoCo-fp32 comparison; held-out seeds from 100 (2 with --quick)",
    )
    p.add_argument(
        "--methods",
        help="comma list of geomesh,diloco-fp32,diloco-fp16,ddp,async (ablations: geomesh-fp32, diloco-sign, geomesh-rs)",
    )
    p.add_argument(
        "--wan",
        default="auto",
        choices=("auto", "netns", "inprocess"),
        help="WAN emulation: netns = real tbf shaping between network namespaces (root, ip, tc), "
        "inprocess = every collective stretched in-process; auto = netns when possible",
    )
    p.add_argument(
        "--cpu-emulation",
        default="dilation",
        choices=("dilation", "quota"),
        help="slower workers by compute dilation (each step's CPU time / speed; waits for a CPU taken off) "
        "or by a cgroup CPU quota per worker",
    )


def build_parser() -> argparse.ArgumentParser:
    ap, sub = console.parser("geomesh", "Workload-balanced, sign-compressed geo-distributed training.", __version__)
    b = console.command(sub, "bench", "GeoMesh and the baselines side by side in one run")
    b.add_argument(
        "--quick", action="store_true", help="the short configuration: 10 runs, about 5-6 minutes on 2 cores"
    )
    b.add_argument("--json", metavar="PATH", help="write the result JSON here")
    _run_args(b)
    d = console.command(sub, "demo", "run the quick bench, print the table, write report.md and a plot")
    d.add_argument("--out", default="demo-output/geomesh", help="output directory (its parent must exist)")
    _run_args(d)
    p = console.command(sub, "plan", "per-worker batch and inner steps for a cluster spec")
    p.add_argument("--cluster", default="geo-3region", help="hwtopo cluster spec (name or file)")
    p.add_argument(
        "--tokens-per-s",
        type=console.positive_float("--tokens-per-s", MAX_TOKENS_PER_S),
        default=20000.0,
        help="training throughput of a speed-1.0 machine",
    )
    p.add_argument("--seq-len", type=console.positive_int("--seq-len", MAX_SEQ_LEN), default=1024)
    p.add_argument(
        "--target-tokens",
        type=console.positive_int("--target-tokens", MAX_TOKENS),
        default=1 << 20,
        help="tokens per outer step, all workers",
    )
    p.add_argument("--batch", type=console.positive_int("--batch", 1 << 20), help="preferred batch size")
    p.add_argument(
        "--fixed-memory",
        type=console.size("--fixed-memory", MAX_BYTES),
        default="4GiB",
        help="weights + optimizer state",
    )
    p.add_argument(
        "--memory-per-sample",
        type=console.size("--memory-per-sample", MAX_BYTES),
        default="512MiB",
        help="activation memory per sequence",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    handlers = {"bench": cmd_bench, "demo": cmd_demo, "plan": cmd_plan}
    return console.run(build_parser(), handlers, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
