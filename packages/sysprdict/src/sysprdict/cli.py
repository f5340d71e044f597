"""`sysprdict` command line: profile, predict, calibrate, fit, demo, bench, blockchain-demo, blockchain-bench.

Every argument is checked, and every output path found writable, before torch is imported or any
work starts; the exit codes and common options are hwtopo.console's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hwtopo
from hwtopo import console

from . import __version__
from .names import model_names, parse_model_name

PRECISIONS = ("fp32", "bf16", "fp16", "mixed")  # layers.PRECISIONS, named here without torch
OPTIMIZERS = ("adamw", "sgd")
MAX_BATCH = 1 << 16  # fit's search bound; the tiny zoo models are traced, never run, beyond it
MAX_TOKENS = 1 << 16
MAX_IMAGE = 1024
MAX_WORLD = 1 << 16
MAX_PROFILE_WORLD = 8  # gloo ranks on this one machine
MAX_MEMORY = 2**50  # 1 PiB
DESCRIPTION = "Predict training time and memory (and permissioned-blockchain performance) before running."


# ------------------------------------------------------------------------------- argument types ---


def _model(text: str) -> str:
    try:
        parse_model_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _model_or_dir(text: str) -> str:
    """argparse type of --model: a local transformers model directory or a zoo model name."""
    p = Path(text)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"--model {text!r}: the directory has no config.json")
        return text
    try:
        parse_model_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--model {text!r} is neither a local model directory (with config.json) nor a zoo model FAMILY-SIZE"
        ) from None
    return text


def _list(field: str, item: Callable[[str], object]) -> Callable[[str], list]:
    """argparse type: a comma-separated list, each item checked by ``item``."""

    def parse(text: str) -> list:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{field} needs at least one value, e.g. {field} 1,2")
        return [item(t) for t in parts]

    return parse


def _one_of(field: str, allowed: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{field}: {text!r} is not one of {', '.join(allowed)}")
        return text

    return parse


def _bandwidth(text: str) -> float:
    try:
        return hwtopo.parse_bandwidth(text, "--bandwidth")
    except hwtopo.SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _existing(field: str, file: bool = True) -> Callable[[str], Path]:
    """argparse type: a path that exists, a file when ``file`` (a missing input is bad input)."""

    def parse(text: str) -> Path:
        p = Path(text)
        if not p.exists():
            raise argparse.ArgumentTypeError(f"{field} {text!r} does not exist")
        if file and not p.is_file():
            raise argparse.ArgumentTypeError(f"{field} {text!r} is not a file")
        return p

    return parse


# -------------------------------------------------------------------------------------- helpers ---


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _headline_rows(h: dict) -> list[list]:
    return [[k, v] for k, v in h.items()]


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


def _write_json(path: Path, obj: dict) -> None:
    hwtopo.atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------ commands ---


def _grid(a) -> list:
    from .profile import GridPoint, default_grid

    if not a.models:
        grid_fields = ("batches", "precisions", "optimizers", "world_sizes", "seq_len", "image_size")
        ignored = ["--" + k.replace("_", "-") for k in grid_fields if getattr(a, k) is not None]
        ignored += ["--checkpointing"] if a.checkpointing else []
        if ignored:
            raise console.UsageError(f"{', '.join(ignored)}: only apply with --models; the built-in --grid fixes them")
        return default_grid(quick=a.grid == "quick")
    seq, image = a.seq_len or 32, a.image_size or 32
    return [
        GridPoint(m, b, seq, image, p, o, a.checkpointing, w)
        for m in a.models
        for b in a.batches or [2]
        for p in a.precisions or ["fp32", "bf16", "fp16"]
        for o in a.optimizers or ["adamw"]
        for w in a.world_sizes or [1]
    ]


def cmd_profile(a) -> int:
    out = console.output_file(a.out, "--out")
    pts = _grid(a)
    _one_thread()
    from .dataset import save_rows
    from .profile import profile_grid

    rows = profile_grid(pts, steps=a.steps, progress=not a.quiet, rounds=a.rounds)
    save_rows(out, rows, {"machine": hwtopo.to_dict(hwtopo.probe_cluster()), "sysprdict": __version__})
    headers = ["model", "batch", "precision", "opt", "ranks", "cpu ms", "wall ms", "peak"]
    table = [
        [
            *(r[k] for k in ("model", "batch", "precision", "optimizer", "world_size")),
            1e3 * r["step_cpu_s"],
            1e3 * r["step_time_s"],
            hwtopo.format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-",
        ]
        for r in rows
    ]
    print(console.table(table, headers))
    print(f"wrote {len(rows)} rows to {out}")
    return 0


def _step_time(a, d) -> float:
    from .dataset import load_rows
    from .timepred import TimePredictor, decomposition_for

    _, rows = load_rows(a.dataset)
    rows = [r for r in rows if r["world_size"] == 1 and r.get("step_cpu_s")]
    tp = TimePredictor(kind="calibrated").fit(  # the predictor bench reports
        [decomposition_for(r) for r in rows], [r["step_cpu_s"] for r in rows], [r["optimizer"] for r in rows]
    )
    return tp.predict_step(d, a.world_size, bandwidth_bytes_per_s=a.bandwidth, optimizer=a.optimizer)


def _predict_out(a, model: str) -> tuple[dict, Any, Any]:
    """The decomposition, memory prediction (real peak with --calibration) and JSON of `predict`."""
    from .api import _decompose, predict_memory
    from .memory import TrainSetup, accelerate_style

    d = _decompose(model, a.batch, a.seq_len, a.image_size, a.precision)
    setup = TrainSetup(a.optimizer, a.checkpointing, a.zero_stage, a.world_size)
    pred = predict_memory(d, setup, overhead=a.calibration)
    out = {
        "model": model,
        "decomposition": d.summary(),
        "memory": pred.as_dict(),
        "accelerate_style_bytes": accelerate_style(d, setup),
    }
    if a.dataset:
        out["step_time_s"] = _step_time(a, d)
    return out, d, pred


def cmd_predict(a) -> int:
    model = _chosen_model(a)
    _one_thread()
    out, d, pred = _predict_out(a, model)
    if a.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    rows = [[k, hwtopo.format_bytes(v)] for k, v in pred.factors.items()]
    rows += [[f"runtime: {k}", hwtopo.format_bytes(v)] for k, v in (pred.runtime or {}).items() if k != "total"]
    print(console.table(rows, ["factor", "bytes"]))
    what = "real peak (tensors + runtime)" if pred.runtime else "tensor peak (no --calibration: runtime not included)"
    print(
        f"predicted {what} {hwtopo.format_bytes(pred.peak_bytes)} at {pred.peak_event}; "
        f"accelerate-style estimate {hwtopo.format_bytes(out['accelerate_style_bytes'])}"
    )
    if "step_time_s" in out:
        print(f"predicted step time {out['step_time_s'] * 1e3:.1f} ms")
    return 0


def cmd_calibrate(a) -> int:
    out = console.output_file(a.out, "--out")
    _one_thread()
    from .evaluate import fit_runtime_overhead

    ov = fit_runtime_overhead(quick=a.quick, progress=not a.quiet, device=a.device)
    ov.save(out)
    print(
        f"{ov.allocator} runtime overhead from {ov.n_fit} configurations: baseline "
        + ", ".join(f"{k} {hwtopo.format_bytes(v)}" for k, v in ov.baseline.items())
        + f"; allocator x{ov.tensor_factor:.3f} of the tensors; margin {ov.margin:.0%}"
    )
    print(f"wrote {out}")
    return 0


def _chosen_model(a) -> str:
    """The model of `predict`/`fit`: the positional zoo name or --model (a directory or zoo name)."""
    if a.model_path and a.model:
        raise console.UsageError(f"{a.cmd}: give the model once, not both {a.model!r} and --model {a.model_path!r}")
    if not (a.model_path or a.model):
        raise console.UsageError(f"{a.cmd}: give a model, as --model DIR (a local transformers model) or a zoo name")
    return a.model_path or a.model


def cmd_fit(a) -> int:
    model = _chosen_model(a)
    _one_thread()
    from .api import load_model
    from .fit import largest_batch
    from .overhead import RuntimeOverhead

    overhead = RuntimeOverhead.load(a.calibration) if a.calibration else None
    # with a calibration its own margin (its largest under-prediction in training) unless one is given
    margin = a.margin if a.margin is not None else (None if overhead else 0.1)
    zm = load_model(model, a.image_size)
    res = largest_batch(
        zm,
        a.memory,
        a.seq_len,
        zm.image_size or 32,
        a.precision,
        a.optimizer,
        True if a.checkpointing else None,
        a.zero_stage,
        a.world_size,
        margin,
        overhead=overhead,
    )
    print(json.dumps(res.as_dict(), indent=2) if a.json else res.describe())
    return 0 if res.fits else 1


def _log_axes(ax) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set(xscale="log", yscale="log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())


def _scatter(plt, path: Path, series: list[tuple[list, list, dict]], lim: list[float], labels: dict) -> None:
    """One log-log predicted-vs-measured scatter with its y = x line."""
    fig, ax = plt.subplots(figsize=(5, 5))
    for xs, ys, style in series:
        ax.scatter(xs, ys, **style)
    ax.plot(lim, lim, "k--", lw=1)
    _log_axes(ax)
    ax.set(**labels)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plots(out: Path, ev: dict) -> list[str]:
    plt = console.pyplot("sysprdict")
    if plt is None:
        return ["(plots skipped: install sysprdict[plot] for matplotlib)"]
    pts = ev["timing"]["points"]
    series = [
        ([1e3 * p["true"] for p in sel], [1e3 * p["pred"] for p in sel], {"label": prec, "s": 18})
        for prec in sorted({p["precision"] for p in pts})
        for sel in [[p for p in pts if p["precision"] == prec]]
    ]
    lim = [min(1e3 * p["true"] for p in pts) * 0.8, max(1e3 * p["true"] for p in pts) * 1.2]
    labels = {"xlabel": "measured step CPU time (ms)", "ylabel": "predicted (ms)"}
    _scatter(plt, out / "time_scatter.png", series, lim, labels | {"title": "time: held-out architectures"})
    mp, mib = ev["memory"]["points"], 2.0**20
    series = [
        ([p["true"] / mib for p in sel], [p["pred"] / mib for p in sel], {"label": f"{mod} (factorized)", "s": 18})
        for mod in sorted({p["modality"] for p in mp})
        for sel in [[p for p in mp if p["modality"] == mod]]
    ]
    style = {"marker": "x", "s": 14, "c": "grey", "label": "accelerate-style"}
    series.append(([p["true"] / mib for p in mp], [p["accelerate_style"] / mib for p in mp], style))
    lim = [min(p["true"] for p in mp) / mib * 0.5, max(p["true"] for p in mp) / mib * 1.2]
    labels = {"xlabel": "measured peak RSS (MiB)", "ylabel": "predicted (MiB)"}
    _scatter(plt, out / "memory_scatter.png", series, lim, labels | {"title": "memory: predicted vs measured peak"})
    return [
        "time_scatter.png: predicted vs measured step time, each family held out",
        "memory_scatter.png: real-peak and accelerate-style predictions vs measured peak RSS",
    ]


def cmd_bench(a) -> int:
    json_path = console.output_file(a.json, "--json") if a.json else None
    save_path = console.output_file(a.save_dataset, "--save-dataset") if a.save_dataset else None
    _one_thread()
    from .evaluate import run_evaluation

    rows = None
    if a.dataset:
        from .dataset import load_rows

        _, rows = load_rows(a.dataset)
    ev = run_evaluation(quick=a.quick, rows=rows, progress=not a.quiet)
    if save_path:
        from .dataset import save_rows

        save_rows(save_path, ev["rows"], {"sysprdict": __version__})
    results = {
        "time_strict_precision_aware": dict(ev["timing"]["aware"]),
        "time_strict_precision_blind": ev["timing"]["blind"],
        "time_strict_analytical_flops": ev["timing"]["analytical"],
        "time_size_extrapolation": {k: ev["timing_size_extrapolation"][k] for k in ("aware", "blind", "analytical")},
        "time_family_holdout_shared_components": {
            k: ev["timing_family_holdout_shared_components"][k] for k in ("aware", "blind", "analytical")
        },
        "memory_rss": {k: v for k, v in ev["memory"].items() if k != "points"},
        "memory_rss_points": ev["memory"]["points"],
        "oom_guard_rss": ev["oom_guard"],
    }
    config = {
        **ev["config"],
        "note": "measured on this machine (a shared 2-core CPU), one process per configuration; memory ground "
        "truth is the process's peak RSS (VmHWM) above its RSS before the model was built; time target is "
        "the median single-thread step CPU time; held-out architectures share no component with training",
    }
    print(console.table(_headline_rows(ev["headline"]), ["headline", "value"]))
    if "data_parallel" in ev["timing"]:
        dp = ev["timing"]["data_parallel"]
        print(f"(not headline) data-parallel step time MAPE: {dp['mape']:.4g} over {dp['n_rows']} gloo runs")
    if json_path:
        _write_json(json_path, _bench_json(config, results, ev["headline"]))
    return 0


def _demo_tables(ev: dict) -> list[tuple[list[str], list[list]]]:
    """(headers, rows) of the demo's tables: headline, per family, per precision, memory, OoM guard."""
    tm, fmt = ev["timing"], hwtopo.format_bytes
    methods = ("aware", "blind", "analytical")
    trows = [[f, *(tm[m]["per_family"][f] for m in methods)] for f in tm["families"]]
    prows = [[q, *(tm[m]["per_precision"].get(q) for m in methods)] for q in tm["aware"]["per_precision"]]
    mrows = [
        [p["model"], p["precision"], p["batch"], fmt(p["true"]), fmt(p["pred"])]
        + [p["pred"] / p["true"] - 1, p["accelerate_style"] / p["true"] - 1]
        for p in ev["memory"]["points"]
    ]
    grows = [
        [c["model"], fmt(c["limit_bytes"]), c["batch"], fmt(c["predicted_peak_bytes"])]
        + [fmt(c["measured_peak_bytes"]), "VIOLATION" if c["violation"] else "ok"]
        for c in ev["oom_guard"]["cases"]
    ]
    mapes = ["aware MAPE", "blind MAPE", "FLOPs-only MAPE"]
    return [
        (["headline", "value"], _headline_rows(ev["headline"])),
        (["held-out family", *mapes], trows),
        (["precision", *mapes], prows),
        (["held-out model", "precision", "batch", "peak RSS", "predicted", "error", "accelerate-style error"], mrows),
        (["model", "limit", "fitted batch", "predicted peak", "measured peak", "guard"], grows),
    ]


def cmd_demo(a) -> int:
    out = console.output_dir(a.out, "--out")
    _one_thread()
    from .dataset import save_rows
    from .evaluate import run_evaluation

    ev = run_evaluation(quick=True, progress=not a.quiet)
    save_rows(out / "profile.jsonl", ev["rows"], {"sysprdict": __version__})
    tables = [console.table(rows, headers) for headers, rows in _demo_tables(ev)]
    print("\n\n".join(tables))
    plots = _plots(out, ev)
    report = [
        "# sysprdict demo (measured on this machine, not emulated)",
        "",
        f"Measured {len(ev['rows'])} training configurations, one process each; time = median single-thread "
        "step CPU time; memory ground truth = the process's peak RSS above its RSS before the model was built. "
        "Predictors are trained on families that share no component with the held-out architectures.",
        "",
        *(t + "\n" for t in tables),
        *[f"- {p}" for p in plots],
        "",
    ]
    hwtopo.atomic_write_text(out / "report.md", "\n".join(report))
    print(f"\nwrote {out / 'report.md'}")
    return 0


def cmd_blockchain_bench(a) -> int:
    json_path = console.output_file(a.json, "--json") if a.json else None
    from .blockchain.evaluate import run_blockchain_bench

    res = run_blockchain_bench(quick=a.quick, data=str(a.data or ""), seed=a.seed, progress=not a.quiet)
    print(console.table(_headline_rows(res["headline"]), ["headline", "value"]))
    if json_path:
        _write_json(
            json_path, _bench_json(res["config"], res["results"], res["headline"]) | {"emulated": res["emulated"]}
        )
    return 0


def cmd_blockchain_demo(a) -> int:
    out = console.output_dir(a.out, "--out")
    from .blockchain.evaluate import run_blockchain_demo

    print(run_blockchain_demo(out=str(out), data=str(a.data or ""), seed=a.seed, progress=not a.quiet))
    return 0


# --------------------------------------------------------------------------------------- parser ---


def _shape_args(p: argparse.ArgumentParser, default: int | None, note: str = "") -> None:
    """--seq-len (or --seq) and --image-size; ``default`` None marks them as given only with --models."""
    tokens, side = console.positive_int("--seq-len", MAX_TOKENS), console.positive_int("--image-size", MAX_IMAGE)
    p.add_argument("--seq-len", "--seq", type=tokens, default=default, help=f"{note}text tokens per sample")
    p.add_argument("--image-size", type=side, default=default and 32, help=f"{note}image side in pixels")


def _model_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument(
        "model",
        type=_model,
        nargs="?" if optional else None,
        help="a zoo model FAMILY-SIZE, e.g. llama-s, llava-clip-m" + (" (or --model)" if optional else ""),
    )
    _shape_args(p, 64)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="training precision")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer whose states count")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every block")
    p.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO sharding stage")
    p.add_argument(
        "--world-size", type=console.positive_int("--world-size", MAX_WORLD), default=1, help="data-parallel ranks"
    )


def _model_source_args(p: argparse.ArgumentParser) -> None:
    """The model as a zoo name or --model DIR, its shape and setup, and --calibration."""
    _model_args(p, optional=True)
    p.add_argument(
        "--model",
        dest="model_path",
        type=_model_or_dir,
        help="a local transformers model directory (config.json; built on the meta device, nothing allocated) "
        "or a zoo model",
    )
    p.set_defaults(image_size=None)  # a model directory's own image size unless given
    p.add_argument(
        "--calibration",
        type=_existing("--calibration"),
        help="a runtime-overhead file from `sysprdict calibrate`: the real peak, not only the tensors",
    )


def _profile_parser(sub) -> None:
    p = console.command(
        sub,
        "profile",
        "measure real training steps over a grid into a dataset file",
        epilog="models: " + ", ".join(model_names()),
        formatter_class=argparse.HelpFormatter,  # the --models options have no default of their own
    )
    p.add_argument(
        "--out", default="sysprdict-profile.jsonl", help="dataset file, JSON lines (default sysprdict-profile.jsonl)"
    )
    p.add_argument("--grid", choices=["quick", "full"], default="quick", help="the built-in grid (default quick)")
    p.add_argument("--models", type=_list("--models", _model), help="comma-separated zoo models (overrides --grid)")
    p.add_argument(
        "--batches",
        type=_list("--batches", console.positive_int("--batches", MAX_BATCH)),
        help="with --models: batch sizes (default 2)",
    )
    p.add_argument(
        "--precisions",
        type=_list("--precisions", _one_of("--precisions", PRECISIONS)),
        help="with --models: comma-separated fp32,bf16,fp16,mixed (default fp32,bf16,fp16)",
    )
    p.add_argument(
        "--optimizers",
        type=_list("--optimizers", _one_of("--optimizers", OPTIMIZERS)),
        help="with --models: comma-separated adamw,sgd (default adamw)",
    )
    p.add_argument(
        "--world-sizes",
        type=_list("--world-sizes", console.positive_int("--world-sizes", MAX_PROFILE_WORLD)),
        help="with --models: gloo data-parallel world sizes (default 1)",
    )
    _shape_args(p, None, "with --models (default 32): ")
    p.add_argument("--checkpointing", action="store_true", help="with --models: gradient checkpointing")
    p.add_argument(
        "--steps",
        type=console.positive_int("--steps", 1000),
        default=3,
        help="timed steps per point and round (default 3)",
    )
    p.add_argument(
        "--rounds",
        type=console.positive_int("--rounds", 100),
        default=3,
        help="interleaved timing passes over the grid; min CPU time kept (default 3)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap, sub = console.parser("sysprdict", DESCRIPTION, __version__)
    _profile_parser(sub)
    p = console.command(sub, "predict", "decompose a model and predict its training memory (and time)")
    _model_source_args(p)
    p.add_argument(
        "--batch", type=console.positive_int("--batch", MAX_BATCH), default=4, help="samples per step and rank"
    )
    p.add_argument("--dataset", type=_existing("--dataset"), help="a profile dataset to train the time predictor on")
    p.add_argument("--bandwidth", type=_bandwidth, default="1GB/s", help="all-reduce bandwidth for world-size > 1")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = console.command(sub, "calibrate", "measure training configurations and fit the runtime memory overhead")
    p.add_argument(
        "--out", default="sysprdict-overhead.json", help="where to write it (default sysprdict-overhead.json)"
    )
    p.add_argument("--quick", action="store_true", help="the small set of configurations")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="whose peak: cpu (process RSS) or cuda (caching allocator's reserved bytes); default cpu",
    )

    p = console.command(sub, "fit", "OoM guard: the largest batch predicted to fit a memory limit")
    p.add_argument(
        "--memory", required=True, type=console.size("--memory", MAX_MEMORY), help="the memory limit, e.g. 24GiB"
    )
    p.add_argument(
        "--margin",
        type=console.fraction("--margin"),
        default=None,
        help="safety margin as a fraction (default 0.1, or the calibration's own with --calibration)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a sentence")
    _model_source_args(p)

    p = console.command(sub, "demo", "profile a small grid, train, print predicted vs measured, plot")
    p.add_argument("--out", default="demo-output/sysprdict", help="output directory (its parent must exist)")

    p = console.command(sub, "bench", "time/memory predictors and baselines side by side; headline JSON")
    p.add_argument("--quick", action="store_true", help="the small grid (under 3 minutes on 2 idle cores)")
    p.add_argument("--json", default="", help="write the results JSON here")
    p.add_argument(
        "--dataset", type=_existing("--dataset"), help="evaluate on this profile dataset instead of profiling"
    )
    p.add_argument("--save-dataset", default="", help="also write the profiled rows to this dataset file")

    for name, helptext in (
        ("blockchain-bench", "Fabric throughput/success-rate predictors, grouped CV"),
        ("blockchain-demo", "train, print the error table and a recommended configuration"),
    ):
        p = console.command(sub, name, helptext)
        p.add_argument(
            "--data",
            type=_existing("--data", file=False),
            help="Caliper reports (dir/HTML/JSON) or a CSV; default: simulated",
        )
        p.add_argument(
            "--seed",
            type=console.integer("--seed", 0, 2**32 - 1),
            default=0,
            help="seed of the simulation and the models",
        )
        if name == "blockchain-bench":
            p.add_argument("--quick", action="store_true", help="fewer simulated repetitions")
            p.add_argument("--json", default="", help="write the results JSON here")
        else:
            p.add_argument(
                "--out", default="demo-output/sysprdict-blockchain", help="output directory (its parent must exist)"
            )
    return ap


HANDLERS = {
    "profile": cmd_profile,
    "predict": cmd_predict,
    "calibrate": cmd_calibrate,
    "fit": cmd_fit,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "blockchain-bench": cmd_blockchain_bench,
    "blockchain-demo": cmd_blockchain_demo,
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is first imported
    return console.run(build_parser(), HANDLERS, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
