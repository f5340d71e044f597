"""``kvpool`` command line: demo, bench, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

__all__ = ["main"]


class UsageError(Exception):
    """Bad command-line input: exit 2 with one line."""


def _port(text: str) -> int:
    """argparse type: a TCP port (0 = any free port), checked before devices are built and measured."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be a port number 0-65535, not {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be a port number 0-65535, not {text!r}")
    return v


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, not {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, not {text!r}")
        return v

    return parse


def _bandwidth(text: str) -> float:
    import hwtopo

    try:
        return hwtopo.parse_bandwidth(text)
    except (hwtopo.SpecError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--ssd-cap: {e}") from None


def _bytes(text: str) -> int:
    import hwtopo

    try:
        return int(hwtopo.parse_bytes(text))
    except (hwtopo.SpecError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"size: {e}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="One KV-cache pool across memory modules and SSDs.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--tokens", type=_positive_int("--tokens"), help="request length in tokens")
        sp.add_argument("--layers", type=_positive_int("--layers"), help="decoder layers of the tiny Llama")
        sp.add_argument("--reps", type=_positive_int("--reps"), help="warm repetitions (median reported)")
        sp.add_argument("--ssds", type=_positive_int("--ssds"), help="emulated SSDs kvpool stripes over (default 4)")
        sp.add_argument(
            "--io-backend",
            choices=("preadv", "io_uring", "auto"),
            help="how kvpool reads its SSD slabs (default preadv; auto: io_uring where the kernel allows)",
        )
        sp.add_argument("--ssd-cap", type=_bandwidth, help="emulated per-SSD read bandwidth, e.g. 200MB/s")
        sp.add_argument("--workdir", help="where the SSD slabs and chunk files go (default: a temp dir)")
        sp.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
        sp.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)

    d = sub.add_parser("demo", help="cold and warm request through a tiny Llama; TTFT of the three methods")
    d.add_argument("--out", default="demo-output/kvpool", help="output directory (report.md, bandwidth.png)")
    common(d)
    b = sub.add_parser("bench", help="recompute vs serialized tiers vs kvpool, emulated and raw, side by side")
    b.add_argument("--quick", action="store_true", help="2k-token request (under 3 minutes on 2 cores)")
    b.add_argument("--json", help="write the results JSON here")
    common(b)
    s = sub.add_parser("serve", help="serve one pool over HTTP (put/get/lookup/stats) to several processes")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8470)
    s.add_argument("--ssd", action="append", default=[], help="an SSD directory (repeat for several)")
    s.add_argument("--memory-modules", type=int, default=2)
    s.add_argument("--memory-bytes", type=_bytes, default=_bytes("256MiB"), help="per memory module")
    s.add_argument("--ssd-bytes", type=_bytes, default=_bytes("1GiB"), help="slab size per SSD")
    s.add_argument("--model-id", required=False, default="model", help="model identity hashed into keys")
    s.add_argument(
        "--layout",
        default="L16-H8-D64-float32-N256",
        help="KV layout tag L<layers>-H<kv heads>-D<head dim>-<dtype>-N<chunk>",
    )
    s.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    return p


def _config(args):
    from .bench import BenchConfig

    cfg = BenchConfig.quick() if getattr(args, "quick", True) else BenchConfig.full()
    if args.cmd == "demo":
        cfg.tokens, cfg.layers, cfg.reps = 1024 + 32, 16, 2
    if args.tokens:
        cfg.tokens = args.tokens
    if args.layers:
        cfg.layers = args.layers
    if args.reps:
        cfg.reps = args.reps
    if args.ssd_cap:
        cfg.ssd_read_cap = args.ssd_cap
    if args.ssds:
        cfg.ssds = args.ssds
    if args.io_backend:
        cfg.io_backend = args.io_backend
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def _progress(quiet: bool):
    if quiet:
        return lambda msg: None
    return lambda msg: print(f"[kvpool] {msg}", file=sys.stderr, flush=True)


def _modes(res: dict) -> list[str]:
    """The kvpool-vs-serial runs of a bench result, in order (emulated, emulated_<n>ssd, raw)."""
    return [k for k, v in res["results"].items() if isinstance(v, dict) and "kvpool" in v]


def _label(r: dict) -> str:
    n = r.get("ssds")
    ssd = f"{n} SSDs" if n else "SSDs"
    return f"emulated ({ssd}, per-SSD caps)" if r["emulated"] else f"raw ({ssd} on one disk, no caps)"


def _table(res: dict) -> str:
    rows = [
        "| method | run | TTFT s | retrieval s | retrieval GB/s | blocked on I/O s | page-cache bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    rec = res["results"]["recompute"]["ttft_s"]
    rows.append(f"| recompute | - | {rec:.3f} | - | - | - | - |")
    for mode in _modes(res):
        r = res["results"][mode]
        label = _label(r)
        for name, key in (("serialized tiers (LMCache-style)", "serial"), ("kvpool", "kvpool")):
            x = r[key]
            rows.append(
                f"| {name} | {label} | {x['ttft_s']:.3f} | {x['retrieval_s']:.3f} | "
                f"{x['retrieval_bytes_per_s'] / 1e9:.2f} | {x['blocked_io_s']:.3f} | {x['page_cache_bytes']} |"
            )
    return "\n".join(rows)


def _headline_table(h: dict) -> str:
    rows = ["| headline key | value |", "|---|---|"]
    for k, v in h.items():
        rows.append(f"| `{k}` | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {v} |")
    return "\n".join(rows)


def _plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvpool: matplotlib is not installed (pip install 'kvpool[plot]'); no plot written", file=sys.stderr)
        return False
    modes = _modes(res)
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        r = res["results"][mode]
        per = r["kvpool"]["retrieval"]["per_device"]
        names = list(per)
        vals = [(per[n]["bytes_per_s"] or 0) / 1e6 for n in names]
        names.append("serial (total)")
        vals.append(r["serial"]["retrieval_bytes_per_s"] / 1e6)
        names.append("kvpool (total)")
        vals.append(r["kvpool"]["retrieval_bytes_per_s"] / 1e6)
        colors = ["tab:blue"] * (len(names) - 2) + ["tab:gray", "tab:green"]
        ax.bar(names, vals, color=colors)
        ax.set_ylabel("MB/s")
        ax.set_title(f"retrieval bandwidth per device\n{_label(r)}", fontsize=9)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _run_bench(args) -> dict:
    from .bench import run_bench

    cfg = _config(args)
    if args.workdir:  # checked before the model is built, and named, instead of a bare errno later
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--workdir: cannot create {args.workdir} ({e.strerror or e})") from None
        if not os.access(args.workdir, os.W_OK | os.X_OK):
            raise UsageError(f"--workdir: {args.workdir} is not a writable directory")
    return run_bench(cfg, workdir=args.workdir, progress=_progress(args.quiet))


def cmd_bench(args) -> int:
    res = _run_bench(args)
    print(_table(res))
    print()
    print(_headline_table(res["headline"]))
    if args.json:
        import hwtopo

        hwtopo.atomic_write_text(args.json, json.dumps(res, indent=2, default=str) + "\n")
    return 0


def cmd_demo(args) -> int:
    import datetime as _dt

    import hwtopo

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = _run_bench(args)
    table = _table(res)
    print(table)
    plotted = _plot(res, out / "bandwidth.png")
    cfg = res["config"]
    text = [
        "# kvpool demo",
        "",
        f"One {cfg['tokens']}-token request (Python stdlib source text, byte tokens) through a tiny Llama "
        f"({cfg['layers']} layers, {cfg['kv_heads']} KV heads), cold then warm; "
        f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on this machine.",
        f"Pool: {cfg['memory_modules']} memory modules holding {cfg['memory_share']:.0%} of the "
        f"prefix KV, {cfg['ssds']} SSD slabs on one physical disk (and a {cfg['compare_ssds']}-SSD run). "
        f"Emulated runs: each SSD capped at {cfg['ssd_read_cap'] / 1e6:.0f} MB/s read (token bucket); "
        "raw run: no caps. The serialized tiers have the same memory and one disk tier (same cap).",
        "",
        table,
        "",
        _headline_table(res["headline"]),
        "",
    ]
    if plotted:
        text.append("bandwidth.png: retrieval bandwidth per kvpool device and in total, vs the serialized tiers.")
    hwtopo.atomic_write_text(out / "report.md", "\n".join(text) + "\n")
    hwtopo.atomic_write_text(out / "results.json", json.dumps(res, indent=2, default=str) + "\n")
    return 0


def cmd_serve(args) -> int:
    from .serve import parse_layout, serve_forever

    try:
        layout = parse_layout(args.layout)
    except ValueError as e:
        raise UsageError(f"--layout: {e}") from None
    if not args.ssd and args.memory_modules <= 0:
        raise UsageError("serve needs at least one --ssd PATH or --memory-modules >= 1")
    serve_forever(
        host=args.host,
        port=args.port,
        ssd_paths=args.ssd,
        memory_modules=args.memory_modules,
        memory_bytes=args.memory_bytes,
        ssd_bytes=args.ssd_bytes,
        model_id=args.model_id,
        layout=layout,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else (logging.ERROR if args.quiet else logging.WARNING),
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return {"bench": cmd_bench, "demo": cmd_demo, "serve": cmd_serve}[args.cmd](args)
    except UsageError as e:
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 1
