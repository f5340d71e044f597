"""``bicache`` command line: train, calibrate, demo, bench, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__

log = logging.getLogger("bicache")


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _model(args):
    from .train import Recipe, load_or_train

    if getattr(args, "checkpoint", None):
        from .model import DiffusionLM

        return DiffusionLM.load(args.checkpoint)
    return load_or_train(Recipe(), progress=not args.quiet)


def _policy(dlm, args):
    from . import depth

    cal = depth.calibrate(dlm)
    bound = args.bound if getattr(args, "bound", None) is not None else depth.choose_bound(dlm, cal)[0]
    return depth.DepthPolicy(cal, bound)


def cmd_train(args) -> int:
    from .train import Recipe, cache_dir, load_or_train

    dlm = load_or_train(Recipe(), progress=not args.quiet)
    from .train import heldout_accuracy

    print(f"checkpoint in {cache_dir()} ; held-out exact match (one parallel step) {heldout_accuracy(dlm):.3f}")
    return 0


def cmd_calibrate(args) -> int:
    from . import depth

    dlm = _model(args)
    cal = depth.calibrate(dlm)
    bound = args.bound if args.bound is not None else depth.choose_bound(dlm, cal)[0]
    policy = depth.DepthPolicy(cal, bound)
    rows = policy.table()
    if args.json:
        _write_json(args.json, {"calibration": cal.to_dict(), "bound": bound, "policy": rows})
    print(f"drift bound {bound:.4g} ({dlm.num_layers} layers)")
    print("| shared fraction | depth | drift by depth | reason |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['fraction']:.3f} | {r['depth']} | {r['drift_by_depth']} | {r['reason']} |")
    return 0


def _write_json(path: str, obj: dict) -> None:
    import hwtopo

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    hwtopo.atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _table(results: dict, fractions: list[str]) -> str:
    head = (
        "| variant | "
        + " | ".join(f"acc@{f}" for f in fractions)
        + " | "
        + " | ".join(f"tok/s@{f}" for f in fractions)
        + " |"
    )
    lines = [head, "|" + "---|" * (1 + 2 * len(fractions))]
    for name, per in results.items():
        accs = " | ".join(f"{per[f]['accuracy']:.3f}" for f in fractions)
        tps = " | ".join(f"{per[f]['tokens_per_cpu_s']:.0f}" for f in fractions)
        lines.append(f"| {name} | {accs} | {tps} |")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    import hwtopo

    from .bench import run_bench

    dlm = _model(args)
    out = run_bench(dlm, quick=args.quick, progress=not args.quiet, bound=args.bound)
    doc = {
        "package": "bicache",
        "version": __version__,
        "config": out["config"],
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": out["results"],
        "headline": out["headline"],
        "round_ratios": out["round_ratios"],
        "emulated": False,
        "calibration": out["calibration"],
        "policy": out["policy"],
        "note": "CPU time of the decoding thread (and wall-clock, *_wall), variants interleaved in rounds of one "
        "run; the machine may be shared/loaded",
    }
    if args.json:
        _write_json(args.json, doc)
    fr = list(next(iter(out["results"].values())).keys())
    print(_table(out["results"], fr))
    print(json.dumps(out["headline"], indent=2))
    return 0


def cmd_demo(args) -> int:
    from . import depth
    from .bench import run_bench

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dlm = _model(args)
    res = run_bench(dlm, quick=True, repeats=1, progress=not args.quiet)
    fr = list(next(iter(res["results"].values())).keys())
    table = _table(res["results"], fr)
    cal = depth.Calibration.from_dict(res["calibration"])
    lines = [
        "# bicache demo",
        "",
        f"Tiny bidirectional Gemma3 DLM ({dlm.num_layers} layers), table-lookup requests sharing a prefix; "
        f"drift bound {res['config']['drift_bound']:.4g}. CPU wall-clock, one repeat (see `bicache bench`).",
        "",
        table,
        "",
        "Headline: `" + json.dumps(res["headline"]) + "`",
        "",
        "| shared fraction | depth | reason |",
        "|---|---|---|",
    ]
    lines += [f"| {r['fraction']:.3f} | {r['depth']} | {r['reason']} |" for r in res["policy"]]
    plots = _plot_drift(cal, res["config"]["drift_bound"], out_dir)
    lines += [
        "",
        *[f"Plot: {p.name} (per-layer prefix K/V drift vs depth, one line per shared fraction)" for p in plots],
    ]
    import hwtopo

    hwtopo.atomic_write_text(str(out_dir / "report.md"), "\n".join(lines) + "\n")
    print(table)
    print(json.dumps(res["headline"], indent=2))
    print(f"wrote {out_dir / 'report.md'}")
    return 0


def _plot_drift(cal, bound: float, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing (pip install 'bicache[plot]'); no plot written")
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for f, row in zip(cal.fractions, cal.drift):
        ax.plot(range(1, len(row) + 1), row, marker="o", label=f"shared {f:.2f}")
    ax.axhline(bound, color="k", ls="--", lw=1, label="bound")
    ax.set_xticks(range(1, cal.num_layers + 1))
    ax.set_xlabel("reuse depth L (layers < L reuse the shared prefix)")
    ax.set_ylabel("drift exposed (relative L2)")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(fontsize=7)
    ax.set_title("prefix K/V drift vs depth")
    fig.tight_layout()
    path = out_dir / "drift.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def cmd_serve(args) -> int:
    from .engine import Engine, keep_heap
    from .server import serve

    keep_heap()
    dlm = _model(args)
    policy = _policy(dlm, args) if args.mode in ("bicache", "bicache+block") else None
    engine = Engine(dlm, mode=args.mode, policy=policy, max_batch=args.max_batch)
    print(f"bicache serving on http://{args.host}:{args.port} (mode {args.mode}); POST /v1/generate, /v1/completions")
    serve(engine, args.host, args.port, token=args.token)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bicache", description="Shared-prefix KV caching for diffusion LMs (BiCache).")
    p.add_argument("--version", action="version", version=f"bicache {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    common.add_argument("--checkpoint", help="a bicache checkpoint directory (default: train or load the cached one)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", parents=[common], help="train (or load) the tiny DLM checkpoint")
    c = sub.add_parser("calibrate", parents=[common], help="measure drift and print the fraction -> depth policy")
    c.add_argument("--bound", type=float, help="drift bound (default: chosen from calibration requests)")
    c.add_argument("--json", help="write calibration + policy JSON here")
    d = sub.add_parser("demo", parents=[common], help="train/load, serve shared-prefix bursts, table + drift plot")
    d.add_argument("--out", default="demo-output/bicache", help="output directory (default demo-output/bicache)")
    b = sub.add_parser("bench", parents=[common], help="all cache modes side by side")
    b.add_argument("--quick", action="store_true", help="small workload (< 3 minutes once trained)")
    b.add_argument("--json", help="write the JSON report here")
    b.add_argument("--bound", type=float, help="drift bound (default: chosen from calibration requests)")
    s = sub.add_parser("serve", parents=[common], help="HTTP JSON completion server (aiohttp)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--token",
        help="bearer token every request must carry (default: $BICACHE_TOKEN, else none); "
        "required when --host is beyond loopback",
    )
    s.add_argument("--mode", default="bicache", choices=["none", "naive", "bicache", "block", "bicache+block"])
    s.add_argument("--max-batch", type=int, default=16)
    s.add_argument("--bound", type=float, help="drift bound (default: chosen from calibration requests)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on usage errors
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    for name, lo in (("port", 1), ("max_batch", 1)):
        v = getattr(args, name, None)
        if v is not None and v < lo:
            print(f"bicache: error: --{name.replace('_', '-')} must be >= {lo}", file=sys.stderr)
            return 2
    if getattr(args, "bound", None) is not None and args.bound < 0:
        print("bicache: error: --bound must be >= 0", file=sys.stderr)
        return 2
    if args.cmd == "serve":
        from hwtopo.httpguard import check_bind, token_from_env

        args.token = args.token or token_from_env("BICACHE_TOKEN")
        try:
            check_bind(args.host, args.token)  # before the model loads: a refused bind costs nothing
        except ValueError as exc:
            print(f"bicache: error: {exc}", file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(1)
    handler = {
        "train": cmd_train,
        "calibrate": cmd_calibrate,
        "demo": cmd_demo,
        "bench": cmd_bench,
        "serve": cmd_serve,
    }[args.cmd]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line unless --debug
        if args.debug:
            raise
        print(f"bicache: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
