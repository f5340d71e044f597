"""``bicache`` command line: train, calibrate, demo, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hwtopo import console

from . import __version__

SERVE_MODES = ("none", "naive", "bicache", "block", "bicache+block")
MAX_BATCH = 4096
MAX_BOUND = 10.0  # a relative L2 drift; far above any measured one, so "reuse everywhere"


def _checkpoint(text: str) -> Path:
    p = Path(text)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"--checkpoint {text!r} is not a directory")
    return p


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _model(args):
    _one_thread()
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
    _one_thread()
    from .train import Recipe, cache_dir, load_or_train

    dlm = load_or_train(Recipe(), progress=not args.quiet)
    from .train import heldout_accuracy

    print(f"checkpoint in {cache_dir()} ; held-out exact match (one parallel step) {heldout_accuracy(dlm):.3f}")
    return 0


def cmd_calibrate(args) -> int:
    from . import depth

    json_path = console.output_file(args.json, "--json") if args.json else None
    dlm = _model(args)
    cal = depth.calibrate(dlm)
    bound = args.bound if args.bound is not None else depth.choose_bound(dlm, cal)[0]
    policy = depth.DepthPolicy(cal, bound)
    rows = policy.table()
    if json_path:
        console.write_json(json_path, {"calibration": cal.to_dict(), "bound": bound, "policy": rows})
    print(f"drift bound {bound:.4g} ({dlm.num_layers} layers)")
    keys = ("fraction", "depth", "drift_by_depth", "reason")
    print(console.table([[r[k] for k in keys] for r in rows], ["shared fraction", "depth", "drift by depth", "reason"]))
    return 0


def _table(results: dict, fractions: list[str], acc: str = "accuracy") -> str:
    headers = ["variant", *(f"acc@{f}" for f in fractions), *(f"tok/s@{f}" for f in fractions)]
    rows = [
        [
            name,
            *(round(per[f][acc], 3) for f in fractions),
            *(round(per[f]["tokens_per_cpu_s"]) for f in fractions),
        ]
        for name, per in results.items()
    ]
    return console.table(rows, headers)


def _table_suite(args) -> dict:
    """The table-lookup model (Gemma3, 4 sliding-window layers of 6; one shipped seed)."""
    from .bench import run_bench

    dlm = _model(args)
    out = run_bench(dlm, quick=args.quick, progress=not args.quiet, bound=args.bound)
    return {k: out[k] for k in ("config", "results", "headline", "round_ratios", "calibration", "policy")}


def _text_suite(args) -> dict:
    """The all-global (LLaDA-shaped) stdlib-text models, one run per shipped seed."""
    import sysconfig

    from .corpus import stdlib_files
    from .textbench import run_text_bench

    _one_thread()
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {s: [p.relative_to(root).as_posix() for p in fs] for s, fs in stdlib_files().items()}
    out = run_text_bench(quick=args.quick, progress=not args.quiet)
    seeds = {
        str(s): {
            k: r[k] for k in ("config", "results", "headline", "round_ratios", "calibration", "policy", "bound_search")
        }
        for s, r in out["per_seed"].items()
    }
    config = {
        "seeds": sorted(out["per_seed"]),
        "tuned_on": "dev split of the stdlib files (calibration, drift bound)",
        "reported_on": "test split of the stdlib files (held out from training and tuning)",
        "stdlib": str(root),
        "files": {"train": len(files["train"]), "dev": files["dev"], "test": files["test"]},
        "model": out["per_seed"][min(out["per_seed"])]["config"]["model"],
        "headline": "median over seeds; <key>_spread holds min, max and the per-seed values",
    }
    return {"config": config, "results": out["results"], "headline": out["headline"], "per_seed": seeds}


def cmd_bench(args) -> int:
    json_path = console.output_file(args.json, "--json") if args.json else None
    suites = {"text": _text_suite, "table": _table_suite}
    names = list(suites) if args.suite == "all" else [args.suite]
    runs = {name: suites[name](args) for name in names}
    main = runs[names[0]]
    extra = {k: v for k, v in main.items() if k not in ("config", "results", "headline")}
    if "table" in runs and names[0] != "table":
        extra["table_task"] = runs["table"]
    doc = console.bench_doc(
        "bicache",
        __version__,
        {**main["config"], "suite": names[0]},
        main["results"],
        main["headline"],
        **extra,
        emulated=False,
        note="CPU time of the decoding thread (and wall-clock, *_wall), variants interleaved in rounds of one "
        "run; the machine may be shared/loaded",
    )
    if json_path:
        console.write_json(json_path, doc)
    for name in names:
        fr = list(next(iter(runs[name]["results"].values())).keys())
        text = name == "text"  # its acc: per-byte accuracy (exact answers are rare at this model size)
        print(f"{name} suite" + (" (medians over seeds; acc per byte)" if text else ""))
        print(_table(runs[name]["results"], fr, "token_accuracy" if text else "accuracy"))
    print(json.dumps({k: v for k, v in main["headline"].items() if not k.endswith("_spread")}, indent=2))
    return 0


def cmd_demo(args) -> int:
    from . import depth
    from .bench import run_bench

    out_dir = console.output_dir(args.out, "--out")
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
        console.table(
            [[r["fraction"], r["depth"], r["reason"]] for r in res["policy"]], ["shared fraction", "depth", "reason"]
        ),
    ]
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
    plt = console.pyplot("bicache")
    if plt is None:
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
    path = out_dir / "drift.png"
    console.save_figure(fig, path, dpi=110)
    return [path]


def cmd_serve(args) -> int:
    from hwtopo.httpguard import check_bind, token_from_env

    args.token = args.token or token_from_env("BICACHE_TOKEN")
    try:
        check_bind(args.host, args.token)  # before the model loads: a refused bind costs nothing
    except ValueError as exc:
        raise console.UsageError(str(exc)) from None
    from .engine import Engine, keep_heap
    from .server import serve

    keep_heap()
    dlm = _model(args)
    policy = _policy(dlm, args) if args.mode in ("bicache", "bicache+block") else None
    engine = Engine(dlm, mode=args.mode, policy=policy, max_batch=args.max_batch)
    print(f"bicache serving on http://{args.host}:{args.port} (mode {args.mode}); POST /v1/generate, /v1/completions")
    serve(engine, args.host, args.port, token=args.token)
    return 0


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    c = console.command(sub, name, help)
    c.add_argument(
        "--checkpoint", type=_checkpoint, help="a bicache checkpoint directory (default: train or load the cached one)"
    )
    return c


def _bound_arg(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--bound",
        type=console.number("--bound", 0.0, MAX_BOUND),
        help="drift bound (default: chosen from calibration requests)",
    )


def build_parser() -> argparse.ArgumentParser:
    p, sub = console.parser("bicache", "Shared-prefix KV caching for diffusion LMs (BiCache).", __version__)
    _command(sub, "train", "train (or load) the tiny DLM checkpoint")
    c = _command(sub, "calibrate", "measure drift and print the fraction -> depth policy")
    _bound_arg(c)
    c.add_argument("--json", help="write calibration + policy JSON here")
    d = _command(sub, "demo", "train/load, serve shared-prefix bursts, table + drift plot")
    d.add_argument("--out", default="demo-output/bicache", help="output directory (its parent must exist)")
    b = _command(sub, "bench", "all cache modes side by side")
    b.add_argument(
        "--quick", action="store_true", help="small workload (about 4-5 minutes on 2 cores with --suite all)"
    )
    b.add_argument("--json", help="write the JSON report here")
    b.add_argument(
        "--suite",
        choices=("all", "text", "table"),
        default="all",
        help="text: the all-global stdlib-text models over their seeds (the headline); table: the "
        "table-lookup model with local layers; all: both, headline from text",
    )
    _bound_arg(b)
    s = _command(sub, "serve", "HTTP JSON completion server (aiohttp)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=console.positive_int("--port", 65535), default=8000, help="TCP port")
    s.add_argument(
        "--token",
        help="bearer token every request must carry (default: $BICACHE_TOKEN, else none); "
        "required when --host is beyond loopback",
    )
    s.add_argument("--mode", default="bicache", choices=SERVE_MODES, help="prefix cache mode")
    s.add_argument(
        "--max-batch", type=console.positive_int("--max-batch", MAX_BATCH), default=16, help="requests per step"
    )
    _bound_arg(s)
    return p


HANDLERS = {"train": cmd_train, "calibrate": cmd_calibrate, "demo": cmd_demo, "bench": cmd_bench, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    return console.run(build_parser(), HANDLERS, argv)


if __name__ == "__main__":
    sys.exit(main())
