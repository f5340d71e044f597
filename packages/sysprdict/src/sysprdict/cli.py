"""`sysprdict` command line: profile, predict, fit, demo, bench, blockchain-demo, blockchain-bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import hwtopo

from . import __version__

log = logging.getLogger("sysprdict")


class UsageError(ValueError):
    """Bad command-line input (exit 2)."""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(t) for t in _csv(text)]
    except ValueError:
        raise UsageError(f"{field}: {text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise UsageError(f"{field}: {text!r} must list positive integers")
    return out


def _fmt_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _write_json(path: str, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    hwtopo.atomic_write_text(p, json.dumps(obj, indent=2, default=str) + "\n")


def _bench_json(config: dict, results: dict, headline: dict) -> dict:
    return {
        "package": "sysprdict",
        "version": __version__,
        "config": config,
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": results,
        "headline": headline,
        "emulated": False,
    }


# ------------------------------------------------------------------------------------ commands ---


def cmd_profile(a) -> int:
    from .dataset import save_rows
    from .profile import GridPoint, default_grid, profile_grid

    if a.steps < 1:
        raise UsageError(f"--steps: {a.steps} must be >= 1 timed step per point")
    if a.rounds < 1:
        raise UsageError(f"--rounds: {a.rounds} must be >= 1 timing pass over the grid")
    grid_opts = {
        "--batches": (a.batches, "2"),
        "--precisions": (a.precisions, "fp32,bf16,fp16"),
        "--optimizers": (a.optimizers, "adamw"),
        "--world-sizes": (a.world_sizes, "1"),
        "--seq-len": (a.seq_len, 32),
        "--image-size": (a.image_size, 32),
        "--checkpointing": (a.checkpointing or None, False),
    }
    if a.models:
        v = {k: default if given is None else given for k, (given, default) in grid_opts.items()}
        pts = [
            GridPoint(m, b, v["--seq-len"], v["--image-size"], p, o, v["--checkpointing"], w)
            for m in _csv(a.models)
            for b in _ints(v["--batches"], "batches")
            for p in _csv(v["--precisions"])
            for o in _csv(v["--optimizers"])
            for w in _ints(v["--world-sizes"], "world-sizes")
        ]
    else:
        ignored = [k for k, (given, _) in grid_opts.items() if given is not None]
        if ignored:
            raise UsageError(f"{', '.join(ignored)}: only apply with --models; the built-in --grid fixes them")
        pts = default_grid(quick=a.grid == "quick")
    rows = profile_grid(pts, steps=a.steps, progress=not a.quiet, rounds=a.rounds)
    save_rows(a.out, rows, {"machine": hwtopo.to_dict(hwtopo.probe_cluster()), "sysprdict": __version__})
    print(
        _fmt_table(
            ["model", "batch", "precision", "opt", "ranks", "cpu ms", "wall ms", "peak"],
            [
                [
                    r["model"],
                    r["batch"],
                    r["precision"],
                    r["optimizer"],
                    r["world_size"],
                    1e3 * r["step_cpu_s"],
                    1e3 * r["step_time_s"],
                    hwtopo.format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-",
                ]
                for r in rows
            ],
        )
    )
    print(f"wrote {len(rows)} rows to {a.out}")
    return 0


def cmd_predict(a) -> int:
    from .layers import decompose
    from .memory import TrainSetup, accelerate_style, predict_memory
    from .zoo import Shape, build

    bw = hwtopo.parse_bandwidth(a.bandwidth, "bandwidth")  # validated even when unused (no --dataset)
    zm = build(a.model, image_size=a.image_size)
    d = decompose(zm, Shape(a.batch, a.seq_len, a.image_size), a.precision)
    setup = TrainSetup(a.optimizer, a.checkpointing, a.zero_stage, a.world_size)
    pred = predict_memory(d, setup)
    out = {
        "model": a.model,
        "decomposition": d.summary(),
        "memory": pred.as_dict(),
        "accelerate_style_bytes": accelerate_style(d, setup),
    }
    if a.dataset:
        from .dataset import load_rows
        from .timepred import TimePredictor, decomposition_for

        _, rows = load_rows(a.dataset)
        rows = [r for r in rows if r["world_size"] == 1 and r.get("step_cpu_s")]
        tp = TimePredictor().fit(
            [decomposition_for(r) for r in rows], [r["step_cpu_s"] for r in rows], [r["optimizer"] for r in rows]
        )
        out["step_time_s"] = tp.predict_step(d, a.world_size, bandwidth_bytes_per_s=bw, optimizer=a.optimizer)
    if a.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        f = pred.factors
        print(_fmt_table(["factor", "bytes"], [[k, hwtopo.format_bytes(v)] for k, v in f.items()]))
        print(
            f"predicted peak {hwtopo.format_bytes(pred.peak_bytes)} at {pred.peak_event}; "
            f"accelerate-style estimate {hwtopo.format_bytes(out['accelerate_style_bytes'])}"
        )
        if d.unknown:
            print(f"unknown layer kinds: {dict(d.unknown)}")
        if "step_time_s" in out:
            print(f"predicted step time {out['step_time_s'] * 1e3:.1f} ms")
    return 0


def cmd_fit(a) -> int:
    from .fit import largest_batch

    res = largest_batch(
        a.model,
        a.memory,
        a.seq_len,
        a.image_size,
        a.precision,
        a.optimizer,
        True if a.checkpointing else None,
        a.zero_stage,
        a.world_size,
        a.margin,
    )
    print(json.dumps(res.as_dict(), indent=2) if a.json else res.describe())
    return 0 if res.fits else 1


def _log_axes(ax) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set(xscale="log", yscale="log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())


def _plots(out: Path, ev: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: install sysprdict[plot] for matplotlib)"]
    made = []
    pts = ev["timing"]["points"]
    fig, ax = plt.subplots(figsize=(5, 5))
    for prec in sorted({p["precision"] for p in pts}):
        sel = [p for p in pts if p["precision"] == prec]
        ax.scatter([1e3 * p["true"] for p in sel], [1e3 * p["pred"] for p in sel], label=prec, s=18)
    lim = [min(1e3 * p["true"] for p in pts) * 0.8, max(1e3 * p["true"] for p in pts) * 1.2]
    ax.plot(lim, lim, "k--", lw=1)
    _log_axes(ax)
    ax.set(
        xlabel="measured step CPU time (ms)",
        ylabel="predicted (ms)",
        title="time: held-out families (measured)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "time_scatter.png", dpi=110)
    plt.close(fig)
    made.append("time_scatter.png: predicted vs measured step time, each family held out")
    mp = ev["memory"]["points"]
    fig, ax = plt.subplots(figsize=(5, 5))
    for mod in sorted({p["modality"] for p in mp}):
        sel = [p for p in mp if p["modality"] == mod]
        ax.scatter(
            [p["true"] / 2**20 for p in sel], [p["pred"] / 2**20 for p in sel], label=f"{mod} (factorized)", s=18
        )
    ax.scatter(
        [p["true"] / 2**20 for p in mp],
        [p["accelerate_style"] / 2**20 for p in mp],
        marker="x",
        s=14,
        c="grey",
        label="accelerate-style",
    )
    lim = [min(p["true"] for p in mp) / 2**20 * 0.5, max(p["true"] for p in mp) / 2**20 * 1.2]
    ax.plot(lim, lim, "k--", lw=1)
    _log_axes(ax)
    ax.set(
        xlabel="MemTracker peak (MiB)",
        ylabel="predicted (MiB)",
        title="memory: predicted vs measured peak",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory_scatter.png", dpi=110)
    plt.close(fig)
    made.append("memory_scatter.png: factorized and accelerate-style predictions vs MemTracker peak")
    return made


def _headline_rows(h: dict) -> list[list]:
    return [[k, v] for k, v in h.items()]


def cmd_bench(a) -> int:
    from .evaluate import run_evaluation

    rows = None
    if a.dataset:
        from .dataset import load_rows

        _, rows = load_rows(a.dataset)
    ev = run_evaluation(quick=a.quick, rows=rows, progress=not a.quiet)
    if a.save_dataset:
        from .dataset import save_rows

        save_rows(a.save_dataset, ev["rows"], {"sysprdict": __version__})
    results = {
        "time_precision_aware": {k: v for k, v in ev["timing"]["aware"].items()},
        "time_precision_blind": ev["timing"]["blind"],
        "time_analytical_flops": ev["timing"]["analytical"],
        "memory_factorized": {k: v for k, v in ev["memory"].items() if k != "points"},
        "oom_guard": ev["oom_guard"],
    }
    if "data_parallel" in ev["timing"]:
        results["time_data_parallel"] = ev["timing"]["data_parallel"]
    config = {
        **ev["config"],
        "note": "measured on this machine (a shared 2-core CPU); time target is the "
        "single-thread step CPU time; memory ground truth is MemTracker's peak",
    }
    print(_fmt_table(["headline", "value"], _headline_rows(ev["headline"])))
    if "data_parallel" in ev["timing"]:
        dp = ev["timing"]["data_parallel"]
        print(f"(not headline) data-parallel step time MAPE: {dp['mape']:.4g} over {dp['n_rows']} gloo runs")
    if a.json:
        _write_json(a.json, _bench_json(config, results, ev["headline"]))
        print(f"wrote {a.json}")
    return 0


def cmd_demo(a) -> int:
    from .evaluate import run_evaluation

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ev = run_evaluation(quick=True, progress=not a.quiet)
    from .dataset import save_rows

    save_rows(out / "profile.jsonl", ev["rows"], {"sysprdict": __version__})
    tm = ev["timing"]
    trows = [
        [f, tm["aware"]["per_family"][f], tm["blind"]["per_family"][f], tm["analytical"]["per_family"][f]]
        for f in tm["families"]
    ]
    prows = [
        [
            q,
            tm["aware"]["per_precision"][q],
            tm["blind"]["per_precision"].get(q),
            tm["analytical"]["per_precision"].get(q),
        ]
        for q in tm["aware"]["per_precision"]
    ]
    mrows = [
        [
            p["model"],
            p["precision"],
            p["batch"],
            hwtopo.format_bytes(p["true"]),
            hwtopo.format_bytes(p["pred"]),
            p["pred"] / p["true"] - 1,
            p["accelerate_style"] / p["true"] - 1,
        ]
        for p in ev["memory"]["points"]
        if p["modality"] == "multimodal"
    ]
    grows = [
        [
            c["model"],
            hwtopo.format_bytes(c["limit_bytes"]),
            c["batch"],
            hwtopo.format_bytes(c["predicted_peak_bytes"]),
            hwtopo.format_bytes(c["measured_peak_bytes"]),
            "VIOLATION" if c["violation"] else "ok",
        ]
        for c in ev["oom_guard"]["cases"]
    ]
    th = ["held-out family", "aware MAPE", "blind MAPE", "FLOPs-only MAPE"]
    ph = ["precision", "aware MAPE", "blind MAPE", "FLOPs-only MAPE"]
    mh = ["multimodal model", "precision", "batch", "measured", "predicted", "error", "accelerate-style error"]
    gh = ["model", "limit", "fitted batch", "predicted peak", "measured peak", "guard"]
    print(_fmt_table(["headline", "value"], _headline_rows(ev["headline"])))
    for h, r in ((th, trows), (ph, prows), (mh, mrows), (gh, grows)):
        print()
        print(_fmt_table(h, r))
    plots = _plots(out, ev)
    report = [
        "# sysprdict demo (measured on this machine, not emulated)",
        "",
        f"Profiled {len(ev['rows'])} real training steps; time = single-thread step CPU time; memory ground "
        "truth = MemTracker peak. Time predictors are evaluated with each model family held out.",
        "",
        _md_table(["headline", "value"], _headline_rows(ev["headline"])),
        "",
        _md_table(th, trows),
        "",
        _md_table(ph, prows),
        "",
        _md_table(mh, mrows),
        "",
        _md_table(gh, grows),
        "",
        *[f"- {p}" for p in plots],
        "",
    ]
    hwtopo.atomic_write_text(out / "report.md", "\n".join(report))
    print(f"\nwrote {out / 'report.md'}")
    return 0


def cmd_blockchain_bench(a) -> int:
    from .blockchain.evaluate import run_blockchain_bench

    res = run_blockchain_bench(quick=a.quick, data=a.data, seed=a.seed, progress=not a.quiet)
    print(_fmt_table(["headline", "value"], _headline_rows(res["headline"])))
    if a.json:
        _write_json(a.json, _bench_json(res["config"], res["results"], res["headline"]) | {"emulated": res["emulated"]})
        print(f"wrote {a.json}")
    return 0


def cmd_blockchain_demo(a) -> int:
    from .blockchain.evaluate import run_blockchain_demo

    text = run_blockchain_demo(out=a.out, data=a.data, seed=a.seed, progress=not a.quiet)
    print(text)
    return 0


# --------------------------------------------------------------------------------------- parser ---


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a zoo model FAMILY-SIZE, e.g. llama-s, llava-clip-m (see --help of profile)")
    p.add_argument("--seq-len", type=int, default=64, help="text tokens per sample (default 64)")
    p.add_argument("--image-size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "mixed"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every block")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")


def build_parser() -> argparse.ArgumentParser:
    from .zoo import model_names

    ap = argparse.ArgumentParser(prog="sysprdict", description=__doc__)
    ap.add_argument("--version", action="version", version=f"sysprdict {__version__}")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser(
        "profile",
        help="measure real training steps over a grid into a dataset file",
        epilog="models: " + ", ".join(model_names()),
    )
    p.add_argument("--out", default="sysprdict-profile.jsonl", help="dataset file (JSON lines, written atomically)")
    p.add_argument("--grid", choices=["quick", "full"], default="quick", help="the built-in grid (when no --models)")
    p.add_argument("--models", default="", help="comma-separated zoo models (overrides --grid)")
    p.add_argument("--batches", help="with --models: comma-separated batch sizes (default 2)")
    p.add_argument("--precisions", help="with --models: comma-separated fp32,bf16,fp16,mixed (default fp32,bf16,fp16)")
    p.add_argument("--optimizers", help="with --models: comma-separated adamw,sgd (default adamw)")
    p.add_argument("--world-sizes", help="with --models: comma-separated gloo data-parallel world sizes (default 1)")
    p.add_argument("--seq-len", type=int, help="with --models: text tokens per sample (default 32)")
    p.add_argument("--image-size", type=int, help="with --models: image side in pixels (default 32)")
    p.add_argument("--checkpointing", action="store_true", help="with --models: gradient checkpointing")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point and round (default 3)")
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing passes over the grid; min CPU time kept (default 3)"
    )
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("predict", help="decompose a model and predict its training memory (and time)")
    _model_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dataset", default="", help="a profile dataset to train the time predictor on")
    p.add_argument("--bandwidth", default="1GB/s", help="all-reduce bandwidth for world-size > 1")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_predict)

    p = sub.add_parser("fit", help="OoM guard: the largest batch predicted to fit a memory limit")
    p.add_argument("--memory", required=True, help="the memory limit, e.g. 24GiB")
    p.add_argument("--margin", type=float, default=0.1, help="safety margin as a fraction (default 0.1)")
    p.add_argument("--json", action="store_true")
    _model_args(p)
    p.set_defaults(fn=cmd_fit)

    p = sub.add_parser("demo", help="profile a small grid, train, print predicted vs measured, plot")
    p.add_argument("--out", default="demo-output/sysprdict")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("bench", help="time/memory predictors and baselines side by side; headline JSON")
    p.add_argument("--quick", action="store_true", help="the small grid (under 3 minutes on 2 idle cores)")
    p.add_argument("--json", default="", help="write the results JSON here")
    p.add_argument("--dataset", default="", help="evaluate on this profile dataset instead of profiling")
    p.add_argument("--save-dataset", default="", help="also write the profiled rows to this dataset file")
    p.set_defaults(fn=cmd_bench)

    for name, fn, helptext in (
        ("blockchain-bench", cmd_blockchain_bench, "Fabric throughput/success-rate predictors, grouped CV"),
        ("blockchain-demo", cmd_blockchain_demo, "train, print the error table and a recommended configuration"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--data", default="", help="Caliper reports (dir/HTML/JSON) or a CSV; default: simulated")
        p.add_argument("--seed", type=int, default=0)
        if name == "blockchain-bench":
            p.add_argument("--quick", action="store_true")
            p.add_argument("--json", default="")
        else:
            p.add_argument("--out", default="demo-output/sysprdict-blockchain")
        p.set_defaults(fn=fn)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if a.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from .blockchain.schema import SchemaError
    from .dataset import DatasetError

    try:
        return int(a.fn(a) or 0)
    except (UsageError, ValueError, hwtopo.SpecError) as e:
        if a.debug:
            raise
        print(f"sysprdict: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, (DatasetError, SchemaError)) else 2  # a bad data file is a runtime failure
    except Exception as e:  # noqa: BLE001 - one line, traceback only with --debug
        if a.debug:
            raise
        print(f"sysprdict: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
