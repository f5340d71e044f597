"""parser-moe command line: demo, bench, compress."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

from . import __version__


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


def _keep_ratio(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"keep ratio must be a number in (0, 1], got {text!r}") from None
    if not (0.0 < r <= 1.0) or math.isnan(r):
        raise argparse.ArgumentTypeError(f"keep ratio must be in (0, 1], got {text}")
    return r


def _ratios(text: str) -> tuple[float, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--ratios needs at least one keep ratio in (0, 1], e.g. 0.1,0.2,0.3")
    return tuple(_keep_ratio(p.strip()) for p in parts)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="parser-moe", description="Compress MoE experts by output-importance residual sparsification.")
    p.add_argument("--version", action="version", version=f"parser-moe {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp):
        sp.add_argument("--model", default=None, help="local transformers MoE checkpoint dir (default: the tiny MoE)")
        sp.add_argument("--base", choices=("aligned", "mean"), default="aligned", help="shared base of the experts")
        sp.add_argument("--seed", type=int, default=0, help="seed of calibration/eval windows")
        sp.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")
        sp.add_argument("--debug", action="store_true", help="tracebacks on errors")

    sd = sub.add_parser("demo", help="compress the tiny MoE with every method; table, report.md and plot")
    sd.add_argument("--out", default="demo-output/parser-moe", help="output directory")
    sd.add_argument("--ratios", type=_ratios, default=(0.1, 0.2, 0.3), help="keep ratios, comma separated")
    common(sd)

    sb = sub.add_parser("bench", help="PARSER vs baselines at equal expert memory, side by side")
    sb.add_argument("--quick", action="store_true", help="fewer calibration/eval tokens (< 3 min once cached)")
    sb.add_argument("--json", default=None, help="write the results JSON here")
    sb.add_argument("--ratios", type=_ratios, default=(0.1, 0.2, 0.3), help="keep ratios, comma separated")
    common(sb)

    sc = sub.add_parser("compress", help="compress one model and save it (safetensors + config)")
    sc.add_argument("--out", required=True, help="directory to write the compressed model to")
    sc.add_argument("--method", choices=("parser", "magnitude", "reconstruction", "wanda"), default="parser")
    sc.add_argument("--keep", type=_keep_ratio, default=0.2, help="fraction of residual units kept, in (0, 1]")
    sc.add_argument("--unstructured", action="store_true", help="keep residual entries at the same bytes")
    common(sc)
    return p


def _table(results: dict) -> list[str]:
    rows = ["| variant | keep | ppl | gap to full | expert MiB | memory reduction |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        keep = r.get("keep_ratio", 1.0)
        rows.append(
            f"| {name.split('@')[0]} | {keep:g} | {r['ppl']:.4f} | {r['gap']:+.4f} | "
            f"{r['expert_bytes'] / 2**20:.3f} | {r['memory_reduction']:.3f} |"
        )
    return rows


def _headline_rows(h: dict) -> list[str]:
    out = ["| headline key | value |", "|---|---|"]
    for k, v in h.items():
        out.append(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |")
    return out


def _plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "parser-moe: matplotlib is not installed (pip install 'parser-moe[plot]'); no plot written", file=sys.stderr
        )
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _run_bench(args, quick: bool) -> dict:
    from .bench import run_bench

    return run_bench(
        quick=quick, model_path=args.model, ratios=args.ratios, base=args.base, seed=args.seed, progress=not args.quiet
    )


def cmd_bench(args) -> int:
    import hwtopo

    res = _run_bench(args, args.quick)
    doc = {
        "package": "parser-moe",
        "version": __version__,
        "config": res["config"],
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": res["results"],
        "headline": res["headline"],
        "emulated": False,
    }
    print("\n".join(_table(res["results"])))
    print()
    print("\n".join(_headline_rows(res["headline"])))
    if args.json:
        hwtopo.atomic_write_text(args.json, json.dumps(doc, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args) -> int:
    import torch

    import hwtopo

    from .compressed import load_compressed, save_compressed
    from .evaluate import perplexity

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = _run_bench(args, quick=True)
    table, head = _table(res["results"]), _headline_rows(res["headline"])
    print("\n".join(table))
    print()
    print("\n".join(head))
    plotted = _plot(res["results"], out / "gap_vs_memory.png")
    # the compressed model goes through save/load, as a user would ship it
    from .bench import load_model, text_ids
    from .calibrate import calibrate
    from .pipeline import compress_model, prepare

    model, info = load_model(args.model, progress=not args.quiet)
    cal, ev = text_ids(info, model.config.vocab_size, 48, 16, 128, args.seed)
    plan = prepare(model, calibrate(model, cal.split(8), seed=args.seed), args.base)
    keep = 0.2 if 0.2 in args.ratios else args.ratios[0]
    cm = compress_model(model, plan, "parser", keep)
    saved = save_compressed(cm, out / f"parser-keep{keep:g}")
    loaded = load_compressed(saved)
    with torch.no_grad():
        same = torch.equal(loaded(input_ids=ev[:2]).logits, cm(input_ids=ev[:2]).logits)
    rt = (
        f"saved to {saved.name}/ and reloaded with transformers: outputs identical = {same}, "
        f"ppl {perplexity(loaded, ev):.4f} on {ev.numel()} held-out tokens"
    )
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
        *table,
        "",
        *head,
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
    save_compressed(cm, args.out)
    print(
        f"{args.method} keep {args.keep:g}: expert bytes {plan.original_bytes()} -> {nbytes} "
        f"({1 - nbytes / plan.original_bytes():.3f} reduction); ppl {perplexity(model, ev):.4f} -> "
        f"{perplexity(cm, ev):.4f}; wrote {args.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        if args.quiet:
            import os

            os.environ["TQDM_DISABLE"] = "1"
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        return {"bench": cmd_bench, "demo": cmd_demo, "compress": cmd_compress}[args.cmd](args)
    except UsageError as e:
        if debug:
            raise
        print(str(e), file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        if debug:
            raise
        print(f"parser-moe: {e}", file=sys.stderr)
        return 2 if isinstance(e, FileNotFoundError) else 1
    except Exception as e:  # runtime failure: one line
        if debug:
            raise
        print(f"parser-moe: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
