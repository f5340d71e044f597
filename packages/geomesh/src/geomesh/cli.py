"""geomesh command line: demo, bench, plan."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import hwtopo

from . import __version__

QUICK = {"outer_steps": 12, "repeat_seeds": 2}  # GeoMesh vs DiLoCo-fp32 at 3 seeds
FULL = {"outer_steps": 20, "hidden": 96, "text_bytes": 3_000_000}


class UsageError(Exception):
    pass


def _progress(quiet: bool):
    start = time.perf_counter()

    def say(method: str) -> None:
        if not quiet:
            print(
                f"[{time.perf_counter() - start:6.1f}s] running {method} (3 workers, emulated speeds and WAN)",
                file=sys.stderr,
                flush=True,
            )

    return say


def _config(args, quick: bool):
    from .bench import BenchConfig

    kw = dict(QUICK if quick else FULL)
    if args.outer_steps is not None:
        kw["outer_steps"] = args.outer_steps
    if args.seeds is not None:
        if args.seeds < 1:
            raise UsageError(f"--seeds: {args.seeds} must be >= 1 (seeds of the GeoMesh vs DiLoCo-fp32 comparison)")
        kw["repeat_seeds"] = args.seeds - 1
    if args.methods:
        kw["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    kw["cluster"] = args.cluster
    kw["wan"] = args.wan
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
    rows = [
        "| method (emulated speeds + WAN) | wall s | time to target s | final val ppl | tokens | straggler idle | comm fraction | bytes/worker/sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["results"].items():
        rows.append(
            f"| {name} | {r['wall_s']:.1f} | {_fmt(r.get('time_to_target_s'))} | {r['final_ppl']:.2f} | {r['tokens']} | "
            f"{r['straggler_idle']:.3f} | {r['comm_fraction']:.3f} | {r['payload_bytes_per_worker_per_sync']} |"
        )
    head = ["", "| headline | value |", "|---|---|"] + [
        f"| `{k}` | {_fmt(v, 4)} |" for k, v in result["headline"].items()
    ]
    return "\n".join(rows + head)


def _bench(cfg, quiet: bool) -> dict:
    from .bench import run_bench

    res = run_bench(cfg, progress=_progress(quiet))
    return {
        "package": "geomesh",
        "version": __version__,
        "config": res["config"],
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": res["results"],
        "headline": res["headline"],
        "repeats": res.get("repeats", []),
        "emulated": res["emulated"],
    }


def _plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger(__name__).warning("matplotlib is missing: pip install 'geomesh[plot]' for plots")
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
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def cmd_bench(args) -> int:
    cfg = _config(args, args.quick)
    result = _bench(cfg, args.quiet)
    print(table(result))
    if args.json:
        hwtopo.atomic_write_text(args.json, json.dumps(result, indent=2, default=str) + "\n")
    return 0


def cmd_demo(args) -> int:
    cfg = _config(args, True)
    os.makedirs(args.out, exist_ok=True)
    result = _bench(cfg, args.quiet)
    text = table(result)
    print(text)
    hwtopo.atomic_write_text(os.path.join(args.out, "bench.json"), json.dumps(result, indent=2, default=str) + "\n")
    plotted = _plot(result, os.path.join(args.out, "ppl_vs_time.png"))
    report = [
        "# geomesh demo",
        "",
        f"3 workers (emulated speeds {cfg.cpus:g} x cluster speeds of `{cfg.cluster}`, cgroup CPU quota via hwtopo.throttle), "
        "WAN links of the cluster spec emulated per collective; tiny Llama on Python stdlib sources. "
        f"Measured on this machine ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), possibly loaded.",
        "",
        text,
        "",
    ]
    if plotted:
        report.append("ppl_vs_time.png: validation perplexity against wall time for every method.")
    hwtopo.atomic_write_text(os.path.join(args.out, "report.md"), "\n".join(report) + "\n")
    return 0


def cmd_plan(args) -> int:
    from .balance import MemoryModel, plan, profiles_from_cluster

    try:
        cluster = hwtopo.load(args.cluster)
    except (hwtopo.SpecError, OSError, ValueError) as e:
        raise UsageError(f"--cluster: {e}") from None
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch must be >= 1 (or omitted: the largest that fits), not {args.batch}")
    profiles = profiles_from_cluster(cluster, args.tokens_per_s)
    mem = MemoryModel(hwtopo.parse_bytes(args.fixed_memory), hwtopo.parse_bytes(args.memory_per_sample))
    p = plan(profiles, args.seq_len, args.target_tokens, memory=mem, preferred_batch=args.batch)
    print(f"phase {p.phase_s:.3f} s, tokens {p.tokens} (target {p.target_tokens}), imbalance {p.imbalance:.3%}")
    print("| worker | batch | inner steps | tokens | phase s | weight |\n|---|---|---|---|---|---|")
    for w in p.workers:
        print(f"| {w.name} | {w.batch} | {w.inner_steps} | {w.tokens} | {w.phase_s:.3f} | {w.weight:.3f} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="geomesh", description="Workload-balanced, sign-compressed geo-distributed training."
    )
    ap.add_argument("--version", action="version", version=f"geomesh {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument(
            "--cluster",
            default="geo-3region",
            help="hwtopo cluster spec (bundled name or file); one worker per machine",
        )
        p.add_argument("--outer-steps", type=int, default=None, help="outer steps per method")
        p.add_argument(
            "--seeds",
            type=int,
            default=None,
            help="seeds of the GeoMesh vs DiLoCo-fp32 comparison; the perplexity gap is their mean (3 with --quick)",
        )
        p.add_argument("--methods", default=None, help="comma list of geomesh,diloco-fp32,diloco-fp16,ddp,async")
        p.add_argument(
            "--wan",
            default="auto",
            choices=("auto", "netns", "inprocess"),
            help="WAN emulation: netns = real tbf shaping between network namespaces (root, ip, tc), "
            "inprocess = every collective stretched in-process; auto = netns when possible (default)",
        )
        p.add_argument("--quiet", action="store_true", help="no progress lines")
        p.add_argument("--debug", action="store_true", help="tracebacks and debug logging")

    b = sub.add_parser("bench", help="GeoMesh and the baselines side by side in one run")
    b.add_argument("--quick", action="store_true", help="the short configuration (under 3 minutes on 2 cores)")
    b.add_argument("--json", default=None, metavar="PATH", help="write the result JSON here")
    common(b)
    b.set_defaults(func=cmd_bench)
    d = sub.add_parser("demo", help="run the quick bench, print the table, write report.md and a plot")
    d.add_argument("--out", default="demo-output/geomesh", help="output directory")
    common(d)
    d.set_defaults(func=cmd_demo)
    p = sub.add_parser("plan", help="per-worker batch and inner steps for a cluster spec")
    p.add_argument("--cluster", default="geo-3region")
    p.add_argument("--tokens-per-s", type=float, default=20000.0, help="throughput of a speed-1.0 machine")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--target-tokens", type=int, default=1 << 20, help="tokens per outer step, all workers")
    p.add_argument("--batch", type=int, default=None, help="preferred batch size")
    p.add_argument("--fixed-memory", default="4GiB", help="weights + optimizer state per worker")
    p.add_argument("--memory-per-sample", default="512MiB", help="activation memory per sequence")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(func=cmd_plan)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from .balance import BalanceError
    from .diloco import GeoMeshError

    try:
        return args.func(args)
    except (UsageError, BalanceError, hwtopo.SpecError) as e:
        if args.debug:
            raise
        print(f"geomesh: error: {e}", file=sys.stderr)
        return 2
    except (GeoMeshError, RuntimeError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"geomesh: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - anything else is a runtime failure too: one line unless --debug
        if args.debug:
            raise
        print(f"geomesh: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
