"""parser-moe command line: demo, bench, compress.

Arguments and output paths are checked before torch is imported or a model is loaded; exit codes
and common options are hwtopo.console's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hwtopo import console

from . import __version__

METHOD_CHOICES = ("parser", "reference", "output_wanda", "magnitude", "reconstruction", "wanda", "wanda_routed")
MAX_THREADS = 1024
MAX_SEED = 2**32 - 1  # numpy and torch generators take 32-bit seeds


def _ratios(text: str) -> tuple[float, ...]:
    keep = console.positive_float("--ratios", 1.0)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--ratios needs at least one keep ratio in (0, 1], e.g. 0.1,0.2,0.3")
    return tuple(keep(p) for p in parts)


def _seed_list(text: str) -> tuple[int, ...]:
    seed = console.integer("--seeds", 0, MAX_SEED)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--seeds needs at least one integer seed, e.g. 0,1,2")
    return tuple(seed(p) for p in parts)


def _checkpoint(text: str) -> Path:
    """argparse type: a transformers checkpoint directory (one with config.json)."""
    p = Path(text)
    if not (p / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"--model {text!r}: no config.json there; pass a transformers checkpoint directory"
        )
    return p


def _new_dir(path: str, field: str) -> Path:
    """A directory that will be written whole (renamed into place): an existing writable directory,
    or a name whose parent exists and is writable. Creates nothing."""
    p = Path(path)
    return console.output_dir(p, field) if p.exists() else console.output_file(p, field)


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--model", type=_checkpoint, help="local transformers MoE checkpoint dir (default: the shipped tiny MoEs)"
    )
    sp.add_argument("--base", choices=("aligned", "mean"), default="aligned", help="shared base of the experts")
    sp.add_argument(
        "--seed", type=console.integer("--seed", 0, MAX_SEED), default=0, help="seed of calibration/eval windows"
    )
    sp.add_argument(
        "--threads", type=console.positive_int("--threads", MAX_THREADS), help="torch threads (default: torch's choice)"
    )


def build_parser() -> argparse.ArgumentParser:
    p, sub = console.parser(
        "parser-moe", "Compress MoE experts by output-importance residual sparsification.", __version__
    )
    sd = console.command(sub, "demo", "compress the tiny MoE with every method; table, report.md and plot")
    sd.add_argument("--out", default="demo-output/parser-moe", help="output directory (its parent must exist)")
    sd.add_argument("--ratios", type=_ratios, default=(0.1, 0.2), help="keep ratios, comma separated")
    _common(sd)

    sb = console.command(sub, "bench", "PARSER vs baselines at equal expert memory, side by side")
    sb.add_argument("--quick", action="store_true", help="fewer calibration/eval tokens and task items (< 3 min)")
    sb.add_argument("--json", help="write the results JSON here")
    sb.add_argument("--ratios", type=_ratios, default=(0.1, 0.2), help="keep ratios, comma separated")
    _common(sb)

    sc = console.command(sub, "compress", "compress one model and save it (safetensors + config)")
    sc.add_argument("--out", required=True, help="directory to write the compressed model to (replaced whole)")
    sc.add_argument("--method", choices=METHOD_CHOICES, default="parser", help="what decides the kept units")
    sc.add_argument(
        "--keep",
        type=console.positive_float("--keep", 1.0),
        default=0.2,
        help="fraction of residual units kept, in (0, 1]",
    )
    sc.add_argument("--unstructured", action="store_true", help="keep residual entries at the same bytes")
    _common(sc)

    st = console.command(sub, "train", "retrain the shipped tiny MoEs (one per seed) into --out")
    st.add_argument("--out", help="checkpoint folder (default: the package's own, replacing what ships)")
    st.add_argument("--seeds", type=_seed_list, default=(0, 1, 2), help="training seeds, comma separated")
    st.add_argument("--steps", type=console.positive_int("--steps", 10**6), help="training steps (default 500)")
    st.add_argument("--threads", type=console.positive_int("--threads", MAX_THREADS), help="torch threads")
    return p


def _prepare(args) -> None:
    """Thread count and progress output, once the arguments have passed."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _table(results: dict) -> str:
    rows = [
        [name.split("@")[0], r.get("keep_ratio", 1.0), r["ppl"], r["gap"], r["expert_bytes"] / 2**20]
        + [r["memory_reduction"]]
        for name, r in results.items()
    ]
    return console.table(rows, ["variant", "keep", "ppl", "gap to full", "expert MiB", "memory reduction"])


def _headline_table(h: dict) -> str:
    return console.table([[f"`{k}`", v] for k, v in h.items()], ["headline key", "value"])


def _plot(results: dict, path: Path) -> bool:
    plt = console.pyplot("parser-moe")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict = {}
    for name, r in results.items():
        if name == "uncompressed":
            continue
        series.setdefault(name.split("@")[0], []).append((r["expert_bytes"] / 2**20, r["gap"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("expert memory (MiB)")
    ax.set_ylabel("perplexity gap to uncompressed")
    ax.set_yscale("log")
    ax.set_title("parser-moe: gap vs memory (tiny Qwen2-MoE, stdlib text)")
    ax.legend(fontsize=8)
    console.save_figure(fig, path, dpi=120)
    return True


def _run_bench(args, quick: bool) -> dict:
    _prepare(args)
    from .bench import run_bench

    return run_bench(
        quick=quick, model_path=args.model, ratios=args.ratios, base=args.base, seed=args.seed, progress=not args.quiet
    )


def cmd_bench(args) -> int:
    json_path = console.output_file(args.json, "--json") if args.json else None
    res = _run_bench(args, args.quick)
    doc = console.bench_doc(
        "parser-moe", __version__, res["config"], res["results"], res["headline"], spread=res["spread"], emulated=False
    )
    print(_table(res["results"]))
    print()
    print(_headline_table(res["headline"]))
    if json_path:
        console.write_json(json_path, doc, allow_nan=False)
        print(f"wrote {json_path}")
    return 0


def _round_trip(args, out: Path, ratios: tuple[float, ...]) -> str:
    """Compress at keep 0.2, save, reload with transformers, and compare: what a user would ship."""
    import torch

    from .bench import load_model, text_ids
    from .calibrate import calibrate
    from .compressed import load_compressed, save_compressed
    from .evaluate import perplexity
    from .pipeline import compress_model, prepare

    model, info = load_model(args.model, progress=not args.quiet)
    cal, ev = text_ids(info, model.config.vocab_size, 48, 16, 128, args.seed)
    plan = prepare(model, calibrate(model, cal.split(8), seed=args.seed), args.base)
    keep = 0.2 if 0.2 in ratios else ratios[0]
    cm = compress_model(model, plan, "parser", keep)
    saved = save_compressed(cm, out / f"parser-keep{keep:g}")
    loaded = load_compressed(saved)
    with torch.no_grad():
        same = torch.equal(loaded(input_ids=ev[:2]).logits, cm(input_ids=ev[:2]).logits)
    return (
        f"saved to {saved.name}/ and reloaded with transformers: outputs identical = {same}, "
        f"ppl {perplexity(loaded, ev):.4f} on {ev.numel()} held-out tokens"
    )


def cmd_demo(args) -> int:
    out = console.output_dir(args.out, "--out")
    res = _run_bench(args, quick=True)
    import hwtopo

    table, head = _table(res["results"]), _headline_table(res["headline"])
    print(table, head, sep="\n\n")
    plotted = _plot(res["results"], out / "gap_vs_memory.png")
    rt = _round_trip(args, out, args.ratios)
    print(rt)
    cfg = res["config"]
    lines = [
        "# parser-moe demo",
        "",
        f"Tiny Qwen2-MoE ({cfg['moe_layers']} MoE layers, {cfg['experts']} experts, top-{cfg['top_k']}, hidden "
        f"{cfg['hidden']}, expert width {cfg['expert_intermediate']}) trained briefly on Python stdlib sources; "
        f"calibration {cfg['calib_tokens']} tokens, perplexity on {cfg['eval_tokens']} held-out tokens; base "
        f"`{cfg['base']}`. Every method keeps the same number of residual units (same bytes).",
        "",
        table,
        "",
        head,
        "",
        f"Save/load: {rt}.",
        "",
        f"Machine: {hwtopo.probe().cores} cores, shared (measured on a loaded machine); no emulation.",
    ]
    if plotted:
        lines += ["", "Plot: `gap_vs_memory.png` - perplexity gap to the uncompressed model against expert memory."]
    hwtopo.atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'report.md'}" + (f" and {out / 'gap_vs_memory.png'}" if plotted else ""))
    return 0


def cmd_compress(args) -> int:
    out = _new_dir(args.out, "--out")
    _prepare(args)
    from .bench import load_model, text_ids
    from .calibrate import calibrate
    from .compressed import compressed_modules, save_compressed
    from .evaluate import perplexity
    from .pipeline import compress_model, entry_ratio_for, prepare

    model, info = load_model(args.model, progress=not args.quiet)
    cal, ev = text_ids(info, model.config.vocab_size, 48, 16, 128, args.seed)
    plan = prepare(model, calibrate(model, cal.split(8), seed=args.seed), args.base)
    keep = entry_ratio_for(args.keep, plan.layers[0].hidden, 4) if args.unstructured else args.keep
    cm = compress_model(model, plan, args.method, keep, structured=not args.unstructured)
    nbytes = sum(m.nbytes() for m in compressed_modules(cm).values())
    save_compressed(cm, out)
    print(
        f"{args.method} keep {args.keep:g}: expert bytes {plan.original_bytes()} -> {nbytes} "
        f"({1 - nbytes / plan.original_bytes():.3f} reduction); ppl {perplexity(model, ev):.4f} -> "
        f"{perplexity(cm, ev):.4f}; wrote {out}"
    )
    return 0


def cmd_train(args) -> int:
    out = _new_dir(args.out, "--out") if args.out else None
    _prepare(args)
    from .zoo import train_seed

    for seed in args.seeds:
        print(f"wrote {train_seed(seed, out, args.steps, progress=not args.quiet)}")
    return 0


HANDLERS: dict[str, Callable] = {"bench": cmd_bench, "demo": cmd_demo, "compress": cmd_compress, "train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    return console.run(build_parser(), HANDLERS, argv)


if __name__ == "__main__":
    sys.exit(main())
