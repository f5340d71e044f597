"""The `cona` console script: bench, demo, strategies, simulate."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import hwtopo
from hwtopo import console

from . import __version__
from .space import StrategyError

log = logging.getLogger(__name__)


UsageError = console.UsageError


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 8,16,32") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers, e.g. 8,16,32")
    return vals


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (validated where it is used, with the valid ones named)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


_SCALARS = {"int": int, "float": float, "str": str}


def _config_value(name: str, text: str, annotation: str):
    """``text`` as a value of the BenchConfig field ``name`` annotated ``annotation`` (``bool``, ``int``,
    ``float``, ``str``, ``X | None``, ``tuple[X, ...]``, ``tuple[X, X]``); a ``UsageError`` naming the field and
    what would be valid otherwise."""
    base, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    if optional and text.strip().lower() == "none":
        return None
    tup = re.fullmatch(r"tuple\[(\w+), (\.\.\.|\w+)\]", base)
    kind = tup.group(1) if tup else base
    want = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a name"}[kind]
    if tup:
        want = f"a comma-separated list of {want.removeprefix('an ').removeprefix('a ')}s"
    if optional:
        want += " or none"
    try:
        if kind == "bool":
            vals = [{"true": True, "false": False}[x.strip().lower()] for x in text.split(",")]
        else:
            vals = [_SCALARS[kind](x.strip()) for x in text.split(",")]
        if kind == "float" and not all(math.isfinite(v) for v in vals):
            raise ValueError
    except (KeyError, ValueError):
        raise UsageError(f"--set {name}: {text!r} is not {want}") from None
    if not tup:
        if len(vals) != 1:
            raise UsageError(f"--set {name}: {text!r} is not {want}")
        return vals[0]
    if tup.group(2) != "..." and len(vals) != 2:
        raise UsageError(f"--set {name}: {text!r} must list 2 values")
    return tuple(vals)


def _config_sets(items: list[str]) -> dict:
    """``--set FIELD=VALUE`` (repeatable): any BenchConfig field by its Python name, e.g. ``gns_every=16`` for A/B
    runs of a setting that has no flag of its own; the run's JSON records the whole config."""
    from .config import BenchConfig

    fields = BenchConfig.__dataclass_fields__
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq:
            raise UsageError(f"--set takes FIELD=VALUE, got {item!r}")
        if name not in fields:
            raise UsageError(f"--set {name}: not a bench setting; valid: {', '.join(sorted(fields))}")
        if name in out:
            raise UsageError(f"--set {name}: given twice")
        out[name] = _config_value(name, text, fields[name].type)
    return out


def _load_spec(text: str) -> hwtopo.Cluster:
    """The hwtopo spec named by --spec; a missing name or file is a usage error (exit 2)."""
    try:
        return hwtopo.load(text)
    except (OSError, hwtopo.SpecError) as e:
        raise UsageError(f"--spec: {e}") from None


_FLAGS = (
    "world",
    "target_ppl",
    "budget_s",
    "global_batches",
    "micro_batches",
    "oracle_branches",
    "seeds",
    "seed",
    "initial_models",
    "range_z",
    "slice_s",
)


def _run_config(args, quick: bool):
    from .config import FULL, QUICK, BenchConfig

    kw = dict(QUICK if quick else FULL)
    for name in _FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "no_oracle", False):
        kw["oracle"] = False
    if getattr(args, "no_probe_cache", False):
        kw["probe_cache"] = False
    if getattr(args, "no_clip", False):
        kw["clip_norm"] = None
    sets = _config_sets(getattr(args, "set", None) or [])
    kw |= sets  # last: it wins over the flags above
    try:
        cfg = BenchConfig(**kw)
    except ValueError as e:
        msg = str(e)
        if msg.split(" ", 1)[0] in sets:  # named as the user wrote it
            raise UsageError(f"--set {msg}") from None
        raise UsageError(f"--{msg.replace('_', '-')}") from None
    from .model import tiny_llama_config
    from .space import ModelDims, enumerate_strategies

    dims = ModelDims.from_config(
        tiny_llama_config(cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.intermediate), cfg.seq_len
    )
    enumerate_strategies(dims, cfg.world, list(cfg.global_batches), list(cfg.micro_batches), float("inf"))
    return cfg


def _execute(args, quick: bool) -> dict:
    from .bench import bench_worker
    from .dist import launch
    from .report import bench_json

    cfg = _run_config(args, quick)
    if not args.quiet:
        print(
            f"cona: {cfg.world} ranks, tiny Llama on stdlib text, target perplexity {cfg.target_ppl:g}, "
            f"budget {cfg.budget_s:g}s per variant ...",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.time()
    timeout = max(900.0, 12 * cfg.budget_s * cfg.seeds)
    out = launch(bench_worker, cfg.world, asdict(cfg), not args.quiet, timeout_s=timeout)[0]
    return bench_json(out, cfg, quick, time.time() - t0)


def _plot(res: dict, path: Path) -> bool:
    plt = console.pyplot("cona")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, r in res["results"].items():
        tr = r["trace"]
        ax.plot([t for t, _ in tr], [math.exp(v) for _, v in tr], marker=".", label=k)
    ax.axhline(res["config"]["target_ppl"], color="grey", ls="--", lw=1, label="target")
    ax.set_yscale("log")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation perplexity")
    ax.set_title("cona vs baselines (tiny Llama, 2 ranks, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cmd_bench(args) -> int:
    from .report import table

    if args.json:
        console.output_file(args.json, "--json")
    res = _execute(args, quick=args.quick)
    for n in res["notes"][:-1]:
        print(f"note: {n}", file=sys.stderr)
    print(table(res))
    if args.json:
        hwtopo.atomic_write_text(args.json, json.dumps(res, indent=2, default=str) + "\n")
        if not args.quiet:
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .report import chain_text, table

    if args.seeds is None:  # the demo shows one chain; `bench` repeats over seeds
        args.seeds = 1
    out = console.output_dir(args.out, "--out")
    res = _execute(args, quick=True)
    shown, chain = table(res), chain_text(res)
    print(shown)
    print("cona chain:\n" + chain)
    for n in res["notes"][:-1]:
        print(f"note: {n}")
    plotted = _plot(res, out / "perplexity_vs_time.png")
    report = (
        "# cona demo\n\nTime to a target validation perplexity on a tiny Llama (Python stdlib text), "
        f"{res['config']['world']} ranks on CPU, {time.strftime('%Y-%m-%d')}; measured on a shared, loaded machine.\n\n"
        + shown
        + "\n## The chain cona chose\n\n"
        + chain
        + "\n"
        + "".join(f"\nNote: {n}\n" for n in res["notes"])
        + (
            "\n- `perplexity_vs_time.png`: validation perplexity against training time, every variant\n"
            if plotted
            else ""
        )
    )
    hwtopo.atomic_write_text(out / "report.md", report)
    hwtopo.atomic_write_text(out / "result.json", json.dumps(res, indent=2, default=str) + "\n")
    if not args.quiet:
        print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0


def cmd_strategies(args) -> int:
    from .model import tiny_llama_config
    from .space import ModelDims, enumerate_strategies, memory_per_rank_bytes

    cluster = _load_spec(args.spec) if args.spec else None
    try:
        cfg = tiny_llama_config(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate or 3 * args.hidden,
        )
    except Exception as e:  # noqa: BLE001 - transformers' validators raise several types
        raise UsageError(
            f"--hidden/--heads/--kv-heads do not make a valid Llama config ({str(e).splitlines()[0]}); "
            "use an even head size hidden/heads, e.g. --hidden 64 --heads 4"
        ) from None
    dims = ModelDims.from_config(cfg, args.seq_len)
    if args.world is not None:
        world = args.world
    elif cluster is not None:  # one rank per accelerator, else per machine
        world = sum(len(m.accelerators) for m in cluster.machines) or len(cluster.machines)
    else:
        world = 2
    found = enumerate_strategies(dims, world, list(args.global_batches), list(args.micro_batches), cluster=cluster)
    for s in found:
        print(f"{s.name}\taccum={s.accum}\tmemory/rank={hwtopo.format_bytes(memory_per_rank_bytes(s, dims))}")
    return 0


def cmd_simulate(args) -> int:
    from .chain import goodput
    from .simulate import PAPER_MODELS, simulate_step
    from .space import enumerate_strategies, rank_memory_budget

    if args.model not in PAPER_MODELS:
        raise UsageError(f"--model {args.model!r} is not one of {sorted(PAPER_MODELS)}")
    dims = PAPER_MODELS[args.model]
    cluster = _load_spec(args.spec)
    world = sum(len(m.accelerators) for m in cluster.machines) or len(cluster.machines)
    found = enumerate_strategies(dims, world, list(args.global_batches), list(args.micro_batches), cluster=cluster)
    budget = rank_memory_budget(cluster, world)
    sims = [simulate_step(s, dims, cluster, mfu=args.mfu) for s in found]
    sims.sort(
        key=lambda x: (
            -goodput(x.throughput, x.strategy.global_batch, args.noise_scale, args.reference_batch, args.lr_scaling)
        )
    )
    print(
        f"# simulated (not measured): {args.model} on {cluster.name}, {world} ranks, "
        f"{hwtopo.format_bytes(budget)}/rank, mfu {args.mfu:g}, noise scale {args.noise_scale:g}"
    )
    for x in sims[: args.top]:
        g = goodput(x.throughput, x.strategy.global_batch, args.noise_scale, args.reference_batch, args.lr_scaling)
        print(f"{x.strategy.name}\tstep={x.step_s * 1e3:.1f}ms\tsamples/s={x.throughput:.1f}\tgoodput={g:.1f}")
    return 0


def _bench_options(sp: argparse.ArgumentParser) -> None:
    """The options ``bench`` and ``demo`` share; unset ones take the workload's defaults (``config.QUICK``/``FULL``)."""
    sp.add_argument("--world", type=console.positive_int("--world", 256), help="number of ranks (quick: 2, full: 4)")
    sp.add_argument(
        "--target-ppl", type=console.positive_float("--target-ppl"), help="target validation perplexity (5.9)"
    )
    sp.add_argument(
        "--budget-s",
        type=console.positive_float("--budget-s", 86400.0),
        help="training-time budget per variant, s (60)",
    )
    sp.add_argument(
        "--global-batches", type=_ints, help="candidate global batches (quick: 16,...,256; full: 8,...,256)"
    )
    sp.add_argument("--micro-batches", type=_ints, help="candidate micro-batch sizes (8,16,32)")
    sp.add_argument(
        "--oracle-branches",
        type=console.positive_int("--oracle-branches", 64),
        help="strategies branched per oracle phase (one per global batch)",
    )
    sp.add_argument("--no-oracle", action="store_true", help="skip the oracle sequence (faster)")
    sp.add_argument(
        "--seeds", type=console.positive_int("--seeds", 1000), help="repeats with other init and data order (1)"
    )
    sp.add_argument("--seed", type=console.integer("--seed", 0, 2**32 - 1), help="first seed (0)")
    sp.add_argument("--no-probe-cache", action="store_true", help="measure every probe afresh, write no probe cache")
    sp.add_argument("--no-clip", action="store_true", help="no gradient clipping (default: global norm 1.0)")
    sp.add_argument(
        "--initial-models",
        type=_names,
        help="efficiency models cona's step-0 choice must hold under, comma separated (sqrt,tuned: before any step "
        "nothing shows which LR regime training is in)",
    )
    sp.add_argument(
        "--range-z",
        type=console.number("--range-z", 0.0, 10.0),
        help="standard errors the noise-scale range of a running switch decision spans (0.5)",
    )
    sp.add_argument(
        "--slice-s",
        type=console.positive_float("--slice-s", 3600.0),
        help="seconds of training clock each variant runs before the next one's turn (0.5)",
    )
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any bench setting by its BenchConfig name, e.g. gns_every=16 (repeatable; tuples comma separated, "
        "none for an optional one; wins over the flags above), recorded in the JSON's config",
    )


def _model_options(s: argparse.ArgumentParser) -> None:
    size = console.positive_int
    s.add_argument("--layers", type=size("--layers", 1024), default=4, help="decoder layers")
    s.add_argument("--hidden", type=size("--hidden", 1 << 16), default=64, help="hidden size")
    s.add_argument("--heads", type=size("--heads", 1024), default=4, help="attention heads")
    s.add_argument("--kv-heads", type=size("--kv-heads", 1024), default=2, help="key/value heads")
    s.add_argument("--intermediate", type=size("--intermediate", 1 << 20), help="MLP width (default 3 x hidden)")
    s.add_argument("--seq-len", type=size("--seq-len", 1 << 20), default=64, help="sequence length")


def _strategies_parser(s: argparse.ArgumentParser) -> None:
    s.add_argument("--spec", help="hwtopo spec (bundled name or file); default: this machine")
    s.add_argument(
        "--world",
        type=console.positive_int("--world", 1 << 16),
        help="ranks (the spec's accelerators or machines, else 2)",
    )
    _model_options(s)
    s.add_argument("--global-batches", type=_ints, default=(8, 16, 32, 64), help="candidate global batches")
    s.add_argument("--micro-batches", type=_ints, default=(4, 8, 16), help="candidate micro-batch sizes")


def _simulate_parser(m: argparse.ArgumentParser) -> None:
    m.add_argument("--spec", default="gpu-node-8", help="hwtopo spec, bundled name or file")
    m.add_argument("--model", default="gpt3-1.3b", help="gpt3-1.3b, bert-large or llama-3.2-1b")
    m.add_argument(
        "--mfu", type=console.number("--mfu", 0.0, 1.0, inclusive=False), default=0.4, help="model FLOPs utilisation"
    )
    m.add_argument(
        "--noise-scale",
        type=console.positive_float("--noise-scale"),
        default=1000.0,
        help="gradient noise scale for the ranking",
    )
    m.add_argument(
        "--reference-batch",
        type=console.positive_int("--reference-batch", 1 << 24),
        default=32,
        help="batch the LR was tuned at",
    )
    m.add_argument(
        "--lr-scaling",
        choices=("sqrt", "tuned"),
        default="sqrt",
        help="how the LR follows the batch: sqrt (Adam, square root) or tuned (Pollux/AdaScale)",
    )
    m.add_argument("--global-batches", type=_ints, default=(32, 64, 128, 256, 512), help="candidate global batches")
    m.add_argument("--micro-batches", type=_ints, default=(1, 2, 4, 8), help="candidate micro-batch sizes")
    m.add_argument("--top", type=console.positive_int("--top", 10_000), default=10, help="strategies listed")


def _parser() -> argparse.ArgumentParser:
    p, sub = console.parser("cona", "Online parallelism-strategy chaining (CONA).", __version__)
    b = console.command(sub, "bench", "cona vs best static, surrogate-at-step-0 static and oracle, side by side")
    b.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, 1 seed, perplexity 5.9: <= 3 minutes with cached probes (full: 4 ranks, 1 seed)",
    )
    b.add_argument("--json", help="write the results as JSON here")
    _bench_options(b)
    d = console.command(sub, "demo", "print the chain cona picks and plot perplexity vs time")
    d.add_argument("--out", default="demo-output/cona", help="output directory (its parent must exist)")
    _bench_options(d)
    _strategies_parser(console.command(sub, "strategies", "list the feasible strategies for this machine or a spec"))
    help_sim = "rank strategies of a paper-size model on an hwtopo cluster (analytic, not measured)"
    _simulate_parser(console.command(sub, "simulate", help_sim))
    return p


def _usage_errors(fn):
    """A handler whose strategy or spec errors are bad input (exit 2), as the user's to fix."""

    def handler(args) -> int:
        try:
            return fn(args)
        except (StrategyError, hwtopo.SpecError) as e:
            raise console.UsageError(str(e)) from None

    return handler


HANDLERS = {"bench": cmd_bench, "demo": cmd_demo, "strategies": cmd_strategies, "simulate": cmd_simulate}


def main(argv: list[str] | None = None) -> int:
    return console.run(_parser(), {k: _usage_errors(f) for k, f in HANDLERS.items()}, argv)
