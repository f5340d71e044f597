"""The `cona` console script: bench, demo, strategies, simulate."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hwtopo
from hwtopo import console

from . import __version__
from .space import StrategyError

UsageError = console.UsageError


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers, e.g. 8,16,32")
    return vals


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(text)
    return v


# what a --set value of each type must be, and how it is read
_KINDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "bool": ("true or false", lambda x: {"true": True, "false": False}[x.lower()]),
    "int": ("an integer", int),
    "float": ("a number", _finite),
    "str": ("a name", str),
}


def _config_value(name: str, text: str, annotation: str):
    """``text`` as a value of the BenchConfig field ``name`` annotated ``annotation`` (``X``, ``X | None``,
    ``tuple[X, ...]`` or ``tuple[X, X]``); a ``UsageError`` naming the field and what would be valid otherwise."""
    base, optional = annotation.removesuffix(" | None"), annotation.endswith(" | None")
    if optional and text.strip().lower() == "none":
        return None
    tup = re.fullmatch(r"tuple\[(\w+), (\.\.\.|\w+)\]", base)
    want, parse = _KINDS[tup.group(1) if tup else base]
    if tup:
        want = f"a comma-separated list of {want.split(' ', 1)[1]}s"
    try:
        vals = [parse(x.strip()) for x in text.split(",")]
    except (KeyError, ValueError):
        vals = []
    if not vals or (not tup and len(vals) != 1):
        raise UsageError(f"--set {name}: {text!r} is not {want}{' or none' if optional else ''}")
    if tup and tup.group(2) != "..." and len(vals) != 2:
        raise UsageError(f"--set {name}: {text!r} must list 2 values")
    return tuple(vals) if tup else vals[0]


def _config_sets(items: list[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` (repeatable): any BenchConfig field by its Python name."""
    from .config import BenchConfig

    fields = BenchConfig.__dataclass_fields__
    out: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq:
            raise UsageError(f"--set takes FIELD=VALUE, got {item!r}")
        if name not in fields:
            raise UsageError(f"--set {name}: not a bench setting; valid: {', '.join(sorted(fields))}")
        if name in out:
            raise UsageError(f"--set {name}: given twice")
        annotation = fields[name].type
        assert isinstance(annotation, str)  # config.py postpones its annotations: field types are strings
        out[name] = _config_value(name, text, annotation)
    return out


def _load_spec(text: str) -> hwtopo.Cluster:
    """The hwtopo spec named by --spec; a missing name or file is a usage error (exit 2)."""
    try:
        return hwtopo.load(text)
    except (OSError, hwtopo.SpecError) as e:
        raise UsageError(f"--spec: {e}") from None


_FLAGS = ("world", "target_ppl", "budget_s", "global_batches", "micro_batches", "seeds", "seed")


def _run_config(args, quick: bool):
    from .config import FULL, QUICK, BenchConfig
    from .model import tiny_llama_config
    from .space import ModelDims, enumerate_strategies

    kw: dict[str, Any] = dict(QUICK if quick else FULL) | {
        k: getattr(args, k) for k in _FLAGS if getattr(args, k) is not None
    }
    kw |= {"oracle": False} if args.no_oracle else {}
    kw |= {"probe_cache": False} if args.no_probe_cache else {}
    sets = _config_sets(args.set)
    kw |= sets  # last: it wins over the flags above
    try:
        cfg = BenchConfig(**kw)
    except ValueError as e:
        msg = str(e)
        if msg.split(" ", 1)[0] in sets:  # named as the user wrote it
            raise UsageError(f"--set {msg}") from None
        raise UsageError(f"--{msg.replace('_', '-')}") from None
    model = tiny_llama_config(cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.intermediate)
    dims = ModelDims.from_config(model, cfg.seq_len)
    enumerate_strategies(dims, cfg.world, list(cfg.global_batches), list(cfg.micro_batches), float("inf"))
    return cfg


def _execute(args, quick: bool) -> dict:
    from .bench import bench_worker
    from .dist import launch
    from .report import bench_json

    cfg = _run_config(args, quick)
    if not args.quiet:
        what = f"target perplexity {cfg.target_ppl:g}, budget {cfg.budget_s:g}s per variant"
        print(f"cona: {cfg.world} ranks, tiny Llama on stdlib text, {what} ...", file=sys.stderr, flush=True)
    t0 = time.time()
    # no wall-clock limit for the whole run, whose length follows the machine's load: every training step is held
    # to a limit from its probed step time (harness.check_step names the run, strategy and rank) and every
    # collective to the process group's timeout, so a stuck or slowed rank still ends the run with its name
    out = launch(bench_worker, cfg.world, asdict(cfg), not args.quiet, timeout_s=math.inf)[0]
    return bench_json(out, cfg, quick, time.time() - t0)


def _plot(res: dict, path: Path) -> bool:
    plt = console.pyplot("cona")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, r in res["results"].items():
        ax.plot([t for t, _ in r["trace"]], [math.exp(v) for _, v in r["trace"]], marker=".", label=k)
    ax.axhline(res["config"]["target_ppl"], color="grey", ls="--", lw=1, label="target")
    ax.set(yscale="log", xlabel="training time (s)", ylabel="validation perplexity")
    ax.set_title("cona vs baselines (tiny Llama, 2 ranks, CPU)")
    ax.legend()
    console.save_figure(fig, path, dpi=100)
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
        console.write_json(args.json, res)
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
    when = f"{res['config']['world']} ranks on CPU, {time.strftime('%Y-%m-%d')}; measured on a shared, loaded machine"
    notes = "".join(f"\nNote: {n}\n" for n in res["notes"])
    plot = "\n- `perplexity_vs_time.png`: validation perplexity against training time, every variant\n"
    head = f"# cona demo\n\nTime to a target validation perplexity on a tiny Llama (Python stdlib text), {when}.\n\n"
    report = f"{head}{shown}\n## The chain cona chose\n\n{chain}\n{notes}{plot if plotted else ''}"
    hwtopo.atomic_write_text(out / "report.md", report)
    console.write_json(out / "result.json", res)
    if not args.quiet:
        print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0


def cmd_strategies(args) -> int:
    from .model import tiny_llama_config
    from .space import ModelDims, enumerate_strategies, memory_per_rank_bytes

    cluster = _load_spec(args.spec) if args.spec else None
    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads}
    try:
        cfg = tiny_llama_config(**sizes, intermediate=args.intermediate or 3 * args.hidden)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise several types
        raise UsageError(
            f"--hidden/--heads/--kv-heads do not make a valid Llama config ({str(e).splitlines()[0]}); "
            "use an even head size hidden/heads, e.g. --hidden 64 --heads 4"
        ) from None
    dims = ModelDims.from_config(cfg, args.seq_len)
    world = args.world or (_ranks(cluster) if cluster is not None else 2)
    found = enumerate_strategies(dims, world, list(args.global_batches), list(args.micro_batches), cluster=cluster)
    for s in found:
        print(f"{s.name}\taccum={s.accum}\tmemory/rank={hwtopo.format_bytes(memory_per_rank_bytes(s, dims))}")
    return 0


def _ranks(cluster: hwtopo.Cluster) -> int:
    """One rank per accelerator, else per machine."""
    return sum(len(m.accelerators) for m in cluster.machines) or len(cluster.machines)


def cmd_simulate(args) -> int:
    from .chain import goodput
    from .simulate import PAPER_MODELS, simulate_step
    from .space import enumerate_strategies, rank_memory_budget

    if args.model not in PAPER_MODELS:
        raise UsageError(f"--model {args.model!r} is not one of {sorted(PAPER_MODELS)}")
    dims, cluster = PAPER_MODELS[args.model], _load_spec(args.spec)
    world = _ranks(cluster)
    found = enumerate_strategies(dims, world, list(args.global_batches), list(args.micro_batches), cluster=cluster)

    def gp(x) -> float:
        return goodput(x.throughput, x.strategy.global_batch, args.noise_scale, args.reference_batch, args.lr_scaling)

    sims = sorted((simulate_step(s, dims, cluster, mfu=args.mfu) for s in found), key=lambda x: -gp(x))
    budget = hwtopo.format_bytes(rank_memory_budget(cluster, world))
    print(
        f"# simulated (not measured): {args.model} on {cluster.name}, {world} ranks, {budget}/rank, "
        f"mfu {args.mfu:g}, noise scale {args.noise_scale:g}"
    )
    for x in sims[: args.top]:
        print(f"{x.strategy.name}\tstep={x.step_s * 1e3:.1f}ms\tsamples/s={x.throughput:.1f}\tgoodput={gp(x):.1f}")
    return 0


def _bench_options(sp: argparse.ArgumentParser) -> None:
    """The options ``bench`` and ``demo`` share; unset ones take the workload's defaults (``config.QUICK``/``FULL``)."""
    pos_int, pos_float = console.positive_int, console.positive_float
    sp.add_argument("--world", type=pos_int("--world", 256), help="number of ranks (quick: 2, full: 4)")
    sp.add_argument("--target-ppl", type=pos_float("--target-ppl"), help="target validation perplexity (5.9)")
    sp.add_argument("--budget-s", type=pos_float("--budget-s", 86400.0), help="training clock per variant, s (60)")
    sp.add_argument("--global-batches", type=_ints, help="candidate global batches (quick: 16..256; full: 8..256)")
    sp.add_argument("--micro-batches", type=_ints, help="candidate micro-batch sizes (8,16,32)")
    sp.add_argument("--seeds", type=pos_int("--seeds", 1000), help="repeats with other init and data order (1)")
    sp.add_argument(
        "--seed",
        type=console.integer("--seed", 0, 2**32 - 1),
        help="first seed (100; held out: settings were chosen on seeds 0-9)",
    )
    sp.add_argument("--no-oracle", action="store_true", help="skip the oracle sequence (faster)")
    sp.add_argument("--no-probe-cache", action="store_true", help="measure every probe afresh, write no probe cache")
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any BenchConfig field, e.g. range_z=1 (its default is 0.5; repeatable; tuples comma separated, none for an optional one; "
        "wins over the flags above), recorded in the JSON's config",
    )


def _strategies_parser(s: argparse.ArgumentParser) -> None:
    size = console.positive_int
    s.add_argument("--spec", help="hwtopo spec (bundled name or file); default: this machine")
    s.add_argument("--world", type=size("--world", 1 << 16), help="ranks (the spec's accelerators or machines, else 2)")
    s.add_argument("--layers", type=size("--layers", 1024), default=4, help="decoder layers")
    s.add_argument("--hidden", type=size("--hidden", 1 << 16), default=64, help="hidden size")
    s.add_argument("--heads", type=size("--heads", 1024), default=4, help="attention heads")
    s.add_argument("--kv-heads", type=size("--kv-heads", 1024), default=2, help="key/value heads")
    s.add_argument("--intermediate", type=size("--intermediate", 1 << 20), help="MLP width (default 3 x hidden)")
    s.add_argument("--seq-len", type=size("--seq-len", 1 << 20), default=64, help="sequence length")
    s.add_argument("--global-batches", type=_ints, default=(8, 16, 32, 64), help="candidate global batches")
    s.add_argument("--micro-batches", type=_ints, default=(4, 8, 16), help="candidate micro-batch sizes")


def _simulate_parser(m: argparse.ArgumentParser) -> None:
    m.add_argument("--spec", default="gpu-node-8", help="hwtopo spec, bundled name or file")
    m.add_argument("--model", default="gpt3-1.3b", help="gpt3-1.3b, bert-large or llama-3.2-1b")
    mfu = console.number("--mfu", 0.0, 1.0, inclusive=False)
    m.add_argument("--mfu", type=mfu, default=0.4, help="model FLOPs utilisation")
    phi = console.positive_float("--noise-scale")
    m.add_argument("--noise-scale", type=phi, default=1000.0, help="gradient noise scale for the ranking")
    ref = console.positive_int("--reference-batch", 1 << 24)
    m.add_argument("--reference-batch", type=ref, default=32, help="batch the LR was tuned at")
    how = "how the LR follows the batch: sqrt (Adam, square root) or tuned (Pollux/AdaScale)"
    m.add_argument("--lr-scaling", choices=("sqrt", "tuned"), default="sqrt", help=how)
    m.add_argument("--global-batches", type=_ints, default=(32, 64, 128, 256, 512), help="candidate global batches")
    m.add_argument("--micro-batches", type=_ints, default=(1, 2, 4, 8), help="candidate micro-batch sizes")
    m.add_argument("--top", type=console.positive_int("--top", 10_000), default=10, help="strategies listed")


def _parser() -> argparse.ArgumentParser:
    p, sub = console.parser("cona", "Online parallelism-strategy chaining (CONA).", __version__)
    b = console.command(
        sub, "bench", "cona vs every static strategy, the step-0 surrogate static, goodput scaling and the oracle"
    )
    quick = "2 ranks, 1 seed, perplexity 5.9: <= 3 minutes with cached probes (full: 4 ranks, 1 seed)"
    b.add_argument("--quick", action="store_true", help=quick)
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
