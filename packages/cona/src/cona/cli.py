"""The `cona` console script: demo, bench, strategies."""

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

from . import __version__
from .space import StrategyError

log = logging.getLogger(__name__)

HEADLINE_KEYS = (
    "ttp_ratio_vs_best_static",
    "gap_to_oracle",
    "switches",
    "switch_overhead_frac",
    "gns_overhead_frac",
    "decision_eval_frac",
)


class UsageError(ValueError):
    """Bad command-line input (exit 2)."""


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


def _run_config(args, quick: bool):
    from .config import BenchConfig

    kw = dict(QUICK if quick else FULL)
    for name in ("world", "target_ppl", "budget_s", "global_batches", "micro_batches", "oracle_branches", "seeds",
                 "seed", "initial_models", "range_z", "slice_s"):  # fmt: skip
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


# The workloads (one place, so README, demo and bench agree). The preconditioned gradient noise scale
# of the tiny model grows from ~20-40 samples at step 0 to ~250 by the target perplexity, while
# throughput keeps growing with the global batch up to the largest candidate (256): the batch that uses
# samples best grows during training and stays below the throughput-optimal one.
# The quick bench is one seed to perplexity 5.9 on 2 ranks (6.5 on 128 measuring windows until 2026-12-07),
# within the house limit of 3 minutes once the probes are cached (a first run probes for ~1.5-2.5 minutes more
# on the development VM). Until 2026-12-01 it ran 3 seeds to 5.8 on 128 windows (~12 minutes). At 6.5 on 2
# ranks a switch was worth making with some probe tables and not with others (12:28 UTC: gb128 only 1.11x
# gb64, no switch, the oracle kept gb64 to 9 s; 11:02-11:25 UTC: one or two per seed); the 4-rank bench with
# --seeds 10 or more is the headline (README). ``--seeds N`` for medians.
# The quick bench's space starts at gb16: on 2 ranks gb8 runs only as pp2 or tp2 (dp2 needs micro-batch 4), at a
# quarter of gb64's samples/s, and it ended every recorded oracle phase last (phase 0, 2026-12-01 21:00-21:45 UTC:
# held-out loss 2.36-2.40 against gb64's 2.11-2.16); its oracle branch and probes took ~13 s of the 3 minutes.
QUICK = {"world": 2, "target_ppl": 5.9, "budget_s": 60.0, "seeds": 1, "global_batches": (16, 32, 64, 128, 256)}
FULL = {"world": 4, "target_ppl": 5.9, "budget_s": 60.0, "seeds": 1}


def _headline(runs: dict, cfg, seed: int | None = None) -> tuple[dict, list[str]]:
    """Headline numbers of one seed and the notes that qualify them. A variant that did not reach the
    target is censored at the budget (cona, the oracle and best static alike) and named in
    ``head["censored"]``: the seed stays in the headline, flagged, never silently dropped."""
    notes = []
    ttt = {k: r["time_to_target_s"] for k, r in runs.items()}
    for k, t in ttt.items():
        if t is None:
            notes.append(
                f"{'' if seed is None else f'seed {seed}: '}{k} did not reach the target perplexity "
                f"{cfg.target_ppl:g} (by the mean of its last {cfg.target_window} evaluations) within the "
                f"{cfg.budget_s:g}s budget (last evaluation: perplexity {runs[k]['final_val_ppl']:.2f}); its time to "
                f"target is censored at the budget"
            )
    cona = runs["cona"]
    cen = {k: (t if t is not None else cfg.budget_s) for k, t in ttt.items()}
    c, bs, o = cen["cona"], cen["best_static"], cen.get("oracle")
    head = {
        "ttp_ratio_vs_best_static": c / bs,
        "gap_to_oracle": (c - o) / o if o else None,
        "switches": max(len(cona["chain"]) - 1, 0),
        "switch_overhead_frac": cona["switch_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "gns_overhead_frac": cona["gns_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "decision_eval_frac": cona.get("decision_eval_frac", 0.0),
        "censored": sorted(k for k, t in ttt.items() if t is None),
    }
    return head, notes


def _execute(args, quick: bool) -> dict:
    from .bench import bench_worker
    from .dist import launch

    cfg = _run_config(args, quick)
    if not args.quiet:
        print(f"cona: {cfg.world} ranks, tiny Llama on stdlib text, target perplexity {cfg.target_ppl:g}, "
              f"budget {cfg.budget_s:g}s per variant ...", file=sys.stderr, flush=True)  # fmt: skip
    t0 = time.time()
    timeout = max(900.0, 12 * cfg.budget_s * cfg.seeds)
    out = launch(bench_worker, cfg.world, asdict(cfg), not args.quiet, timeout_s=timeout)[0]
    per_seed, notes = {}, []
    for seed, r in out["seeds"].items():
        per_seed[seed], n = _headline(r["runs"], cfg, seed)
        notes += n
    head, spread = _aggregate(per_seed)
    first = next(iter(out["seeds"].values()))
    head["oracle_branches"] = len(first["step0"].get("oracle_branches", []))
    cores = hwtopo.probe().cores
    oversub = cfg.world > cores
    notes.append(
        f"{cfg.world} ranks on {cores} cores"
        + (" (oversubscribed: ranks time-share cores, so step times include waiting for a core)" if oversub else "")
    )
    return {
        "package": "cona",
        "version": __version__,
        "config": asdict(cfg)
        | {
            "quick": quick,
            "wall_s": time.time() - t0,
            "model": "LlamaForCausalLM (tiny, random init)",
            "data": "Python stdlib sources, byte-level",
            "clock": "training wall time on rank 0, validation excluded",
            "oversubscribed": oversub,
            "seed_list": cfg.seed_list,
        },  # fmt: skip
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": _results(out["seeds"], cfg.budget_s),
        "oracle_branches": first["step0"].get("oracle_branches", []),
        "probe": out["probe"] | {"throughput": out["throughput"]},
        "step0": {seed: r["step0"] for seed, r in out["seeds"].items()},
        "headline": head,
        "headline_spread": spread,
        "notes": notes + ["variants of a seed run interleaved in short slices, so they share the machine's load"],
        "emulated": False,
    }


def _aggregate(per_seed: dict) -> tuple[dict, dict]:
    """Median over seeds of each headline number, and its spread (min, max, per seed); ``censored_seeds``:
    ``"seed: variant"`` for every variant of a seed censored at the budget (that seed's values are in the
    median, as censored times, and flagged here)."""
    import statistics

    head, spread = {}, {}
    for k in HEADLINE_KEYS:
        vals = [h.get(k) for h in per_seed.values()]
        ok = [v for v in vals if v is not None]
        head[k] = statistics.median(ok) if ok else None
        if k == "switches" and head[k] is not None:
            head[k] = float(head[k]) if head[k] != int(head[k]) else int(head[k])
        spread[k] = {
            "median": head[k],
            "min": min(ok) if ok else None,
            "max": max(ok) if ok else None,
            "per_seed": vals,
            "seeds_without_value": len(vals) - len(ok),
        }
    head["censored_seeds"] = [f"{seed}: {k}" for seed, h in per_seed.items() for k in h.get("censored", [])]
    return head, spread


def _results(seeds: dict, budget_s: float) -> dict:
    """Per variant: the first seed's run in full (trace, chain, decisions), then every seed's summary. The
    median time to target counts a seed that missed the target at the budget (listed in ``censored_seeds``)."""
    first = next(iter(seeds.values()))["runs"]
    out = {}
    for k, r in first.items():
        ttts = [s["runs"][k]["time_to_target_s"] for s in seeds.values()]
        out[k] = (
            {kk: vv for kk, vv in r.items() if kk != "decisions"}
            | {
                "decisions": r["decisions"][:40],
                "decisions_total": len(r["decisions"]),  # the list above keeps the first 40
                "time_to_target_s_median": _median([budget_s if t is None else t for t in ttts]),
                "censored_seeds": [seed for seed, s in seeds.items() if s["runs"][k]["time_to_target_s"] is None],
                "per_seed": {
                    seed: {
                        kk: s["runs"][k][kk]
                        for kk in (
                            "time_to_target_s",
                            "first_eval_at_target_s",
                            "final_val_ppl",
                            "steps",
                            "samples",
                            "clock_s",
                            "switch_s",
                            "gns_s",
                            "decision_eval_s",
                            "decision_eval_frac",
                            "decision_s",
                        )
                    }
                    | {
                        "strategies": [c["strategy"] for c in s["runs"][k]["chain"]],
                        "chain": [
                            {
                                kk: c[kk]
                                for kk in (
                                    "clock",
                                    "samples",
                                    "strategy",
                                    "switch",
                                    "switch_s",
                                    "branches",
                                    "pick_on_measuring_windows",
                                    "compared_at",
                                )
                                if kk in c
                            }  # fmt: skip
                            for c in s["runs"][k]["chain"]
                        ],
                        "decisions": [_brief(d) for d in s["runs"][k]["decisions"][:40]],
                        "decisions_total": len(s["runs"][k]["decisions"]),
                    }  # fmt: skip
                    for seed, s in seeds.items()
                },  # fmt: skip
            }
        )
    return out


def _brief(d: dict) -> dict:
    """One decision, short (every seed's log in the JSON, not only the first seed's)."""
    keep = ("elapsed_s", "current", "chosen", "switched", "noise_scale", "noise_range", "pairs", "remaining_s",
            "reason")  # fmt: skip
    return {k: d[k] for k in keep if k in d} | {
        "top": [[e["strategy"], round(e["throughput"]), round(e["efficiency"], 3), round(e["goodput"])]
                for e in d.get("ranking", [])[:4]]}  # fmt: skip


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _table(res: dict) -> str:
    seeds = res["config"]["seed_list"]
    rows = [
        f"| variant | time to target (s), median of {len(seeds)} seeds | per seed | final ppl (seed {seeds[0]}) | "
        f"steps | samples | switches | strategies (seed {seeds[0]}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, r in res["results"].items():
        t = r["time_to_target_s_median"]
        cen = f" ({len(r['censored_seeds'])} censored at the budget)" if r["censored_seeds"] else ""
        per = ", ".join("-" if p["time_to_target_s"] is None else f"{p['time_to_target_s']:.1f}"
                        for p in r["per_seed"].values())  # fmt: skip
        strat = " -> ".join(c["strategy"] for c in r["chain"])
        rows.append(
            f"| {k} | {'not reached' if t is None else f'{t:.1f}'}{cen} | {per} | {r['final_val_ppl']:.2f} | {r['steps']} "
            f"| {r['samples']} | {max(len(r['chain']) - 1, 0)} | {strat} |"
        )
    sp = res["headline_spread"]
    head = "\n".join(
        f"| `{k}` | {_fmt(v)} | {_fmt(sp[k]['min'])} .. {_fmt(sp[k]['max'])} | "
        f"{', '.join(_fmt(x) for x in sp[k]['per_seed'])} |"
        for k, v in res["headline"].items()
        if k in sp
    )
    cs = res["headline"].get("censored_seeds")
    head += f"\n\ncensored at the budget (in the medians, flagged): {', '.join(cs) if cs else 'none'}"
    w = res["config"].get("target_window", 1)
    rows.append(f"\ntime to target: the first validation evaluation (every {res['config']['eval_every_s']:g} s of "
                f"training clock) at which the mean of the last {w} is at or below the target")  # fmt: skip
    return (
        "\n".join(rows)
        + "\n\n| headline (median over seeds) | value | min .. max | per seed |\n|---|---|---|---|\n"
        + head
        + "\n"
    )


def _fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _chain_text(res: dict) -> str:
    lines = []
    for c in res["results"]["cona"]["chain"]:
        lines.append(f"- t={c['clock']:.1f}s {c['strategy']}: {c['why']}")
    return "\n".join(lines)


def _plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'cona[plot]'); no plot written")
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
    res = _execute(args, quick=args.quick)
    for n in res["notes"][:-1]:
        print(f"note: {n}", file=sys.stderr)
    print(_table(res))
    if args.json:
        hwtopo.atomic_write_text(args.json, json.dumps(res, indent=2, default=str) + "\n")
        if not args.quiet:
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    if args.seeds is None:  # the demo shows one chain; `bench` repeats over seeds
        args.seeds = 1
    res = _execute(args, quick=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = _table(res)
    chain = _chain_text(res)
    print(table)
    print("cona chain:\n" + chain)
    for n in res["notes"][:-1]:
        print(f"note: {n}")
    plotted = _plot(res, out / "perplexity_vs_time.png")
    report = (
        "# cona demo\n\nTime to a target validation perplexity on a tiny Llama (Python stdlib text), "
        f"{res['config']['world']} ranks on CPU, {time.strftime('%Y-%m-%d')}; measured on a shared, loaded machine.\n\n"
        + table
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
        cfg = tiny_llama_config(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                intermediate=args.intermediate or 3 * args.hidden)  # fmt: skip
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
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], not {args.mfu:g}")
    if args.noise_scale <= 0:
        raise UsageError(f"--noise-scale must be > 0, not {args.noise_scale:g}")
    if args.reference_batch < 1:
        raise UsageError(f"--reference-batch must be >= 1, not {args.reference_batch}")
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, not {args.top}")
    dims = PAPER_MODELS[args.model]
    cluster = _load_spec(args.spec)
    world = sum(len(m.accelerators) for m in cluster.machines) or len(cluster.machines)
    found = enumerate_strategies(dims, world, list(args.global_batches), list(args.micro_batches), cluster=cluster)
    budget = rank_memory_budget(cluster, world)
    sims = [simulate_step(s, dims, cluster, mfu=args.mfu) for s in found]
    sims.sort(key=lambda x: -goodput(x.throughput, x.strategy.global_batch, args.noise_scale, args.reference_batch,
                                     args.lr_scaling))  # fmt: skip
    print(f"# simulated (not measured): {args.model} on {cluster.name}, {world} ranks, "
          f"{hwtopo.format_bytes(budget)}/rank, mfu {args.mfu:g}, noise scale {args.noise_scale:g}")  # fmt: skip
    for x in sims[: args.top]:
        g = goodput(x.throughput, x.strategy.global_batch, args.noise_scale, args.reference_batch, args.lr_scaling)
        print(f"{x.strategy.name}\tstep={x.step_s * 1e3:.1f}ms\tsamples/s={x.throughput:.1f}\tgoodput={g:.1f}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cona", description="Online parallelism-strategy chaining (CONA).")
    p.add_argument("--version", action="version", version=f"cona {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--quiet", action="store_true", help="no progress messages")
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
        sp.add_argument("--world", type=int, help="number of ranks (quick: 2, full: 4)")
        sp.add_argument("--target-ppl", type=float, help="target validation perplexity")
        sp.add_argument("--budget-s", type=float, help="training-time budget per variant, seconds")
        sp.add_argument(
            "--global-batches",
            type=_ints,
            help="candidate global batch sizes (quick: 16,32,64,128,256; full: 8,...,256)",
        )
        sp.add_argument("--micro-batches", type=_ints, help="candidate micro-batch sizes, e.g. 4,8,16")
        sp.add_argument("--oracle-branches", type=int, help="strategies branched per oracle phase")
        sp.add_argument("--no-oracle", action="store_true", help="skip the oracle sequence (faster)")
        sp.add_argument("--seeds", type=int, help="repeats with different init and data order (median reported)")
        sp.add_argument("--seed", type=int, help="first seed (default 0)")
        sp.add_argument("--no-probe-cache", action="store_true",
                        help="measure every probe afresh and do not write the probe cache")  # fmt: skip
        sp.add_argument("--no-clip", action="store_true", help="no gradient clipping (default: global norm 1.0)")
        sp.add_argument("--initial-models", type=_names,
                        help="efficiency models cona's step-0 choice must hold under, comma separated (default "
                             "sqrt,tuned: before any step nothing shows which LR regime training is in)")  # fmt: skip
        sp.add_argument("--range-z", type=float,
                        help="standard errors the noise-scale range of a running switch decision spans, around the "
                             "ratio of its pairs' means and the smoothed estimate (default 0.5)")  # fmt: skip
        sp.add_argument("--slice-s", type=float,
                        help="seconds of training clock each variant runs before the next one's turn (default 0.5): "
                             "the variants share the machine's speed swings at longer time scales than this")  # fmt: skip
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any bench setting by its BenchConfig name, e.g. gns_every=16 or trend_window_s=3 "
                             "(repeatable; tuples comma separated, none for an optional one; wins over the flags "
                             "above): for A/B runs, recorded in the JSON's config")  # fmt: skip
    b = sub.add_parser("bench", help="cona vs best static, surrogate-at-step-0 static and oracle, side by side")
    b.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, 1 seed, perplexity 5.9: <= 3 minutes with cached probes (full: 4 ranks, 1 seed)",
    )
    b.add_argument("--json", help="write the results as JSON here")
    common(b)
    b.set_defaults(fn=cmd_bench)
    d = sub.add_parser("demo", help="print the chain cona picks and plot perplexity vs time")
    d.add_argument("--out", default="demo-output/cona", help="output directory (default demo-output/cona)")
    common(d)
    d.set_defaults(fn=cmd_demo)
    s = sub.add_parser("strategies", help="list the feasible strategies for this machine or an hwtopo spec")
    s.add_argument("--spec", help="hwtopo spec (bundled name or file); default: this machine")
    s.add_argument("--world", type=int, help="ranks (default: the spec's accelerators or machines, else 2)")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--hidden", type=int, default=64)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--kv-heads", type=int, default=2)
    s.add_argument("--intermediate", type=int, help="MLP width (default 3 x hidden)")
    s.add_argument("--seq-len", type=int, default=64)
    s.add_argument("--global-batches", type=_ints, default=(8, 16, 32, 64))
    s.add_argument("--micro-batches", type=_ints, default=(4, 8, 16))
    s.add_argument("--quiet", action="store_true")
    s.add_argument("--debug", action="store_true")
    s.set_defaults(fn=cmd_strategies)
    m = sub.add_parser(
        "simulate", help="rank strategies of a paper-size model on an hwtopo cluster (analytic, not measured)"
    )
    m.add_argument("--spec", default="gpu-node-8", help="hwtopo spec (bundled name or file)")
    m.add_argument("--model", default="gpt3-1.3b", help="gpt3-1.3b, bert-large or llama-3.2-1b")
    m.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the peak")
    m.add_argument("--noise-scale", type=float, default=1000.0, help="gradient noise scale for the goodput ranking")
    m.add_argument("--reference-batch", type=int, default=32)
    m.add_argument("--lr-scaling", choices=("sqrt", "tuned"), default="sqrt",
                   help="how the LR follows the batch: sqrt (Adam, square root) or tuned (Pollux/AdaScale)")  # fmt: skip
    m.add_argument("--global-batches", type=_ints, default=(32, 64, 128, 256, 512))
    m.add_argument("--micro-batches", type=_ints, default=(1, 2, 4, 8))
    m.add_argument("--top", type=int, default=10)
    m.add_argument("--quiet", action="store_true")
    m.add_argument("--debug", action="store_true")
    m.set_defaults(fn=cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.fn(args)
    except (UsageError, StrategyError, hwtopo.SpecError) as e:
        if args.debug:
            raise
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        print(f"cona: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
