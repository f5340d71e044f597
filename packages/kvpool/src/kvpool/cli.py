"""``kvpool`` command line: demo, bench, serve."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hwtopo import console

__all__ = ["main"]

MAX_TOKENS = 1 << 20
MAX_LAYERS = 256
MAX_REPS = 1000
MAX_DEVICES = 64  # SSDs or memory modules of one pool
MAX_BYTES = 2**50  # 1 PiB per device


def _bandwidth(text: str) -> float:
    import hwtopo

    try:
        return hwtopo.parse_bandwidth(text)
    except (hwtopo.SpecError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--ssd-cap: {e}") from None


def _parser() -> argparse.ArgumentParser:
    p, sub = console.parser("kvpool", "One KV-cache pool across memory modules and SSDs.", _version())

    def common(sp):
        sp.add_argument("--tokens", type=console.positive_int("--tokens", MAX_TOKENS), help="request length in tokens")
        sp.add_argument(
            "--layers", type=console.positive_int("--layers", MAX_LAYERS), help="decoder layers of the tiny Llama"
        )
        sp.add_argument(
            "--reps", type=console.positive_int("--reps", MAX_REPS), help="warm repetitions (median reported)"
        )
        sp.add_argument(
            "--ssds",
            type=console.positive_int("--ssds", MAX_DEVICES),
            help="emulated SSDs kvpool stripes over (default 4)",
        )
        sp.add_argument(
            "--io-backend",
            choices=("preadv", "io_uring", "auto"),
            help="how kvpool reads its SSD slabs (default preadv; auto: io_uring where the kernel allows)",
        )
        sp.add_argument("--ssd-cap", type=_bandwidth, help="emulated per-SSD read bandwidth, e.g. 200MB/s")
        sp.add_argument(
            "--small-chunks",
            type=console.integer("--small-chunks", 0, MAX_TOKENS),
            help="16-token pages (one file each) of the filesystem-cost run (default 2048; 0 skips it)",
        )
        sp.add_argument(
            "--workdir", help="where the SSD slabs and chunk files go; its parent must exist (default: a temp dir)"
        )

    d = console.command(sub, "demo", "cold and warm request through a tiny Llama; TTFT of the three methods")
    d.add_argument("--out", default="demo-output/kvpool", help="output directory (report.md, bandwidth.png)")
    common(d)
    b = console.command(sub, "bench", "recompute vs file-per-chunk baselines vs kvpool, emulated and raw, side by side")
    b.add_argument("--quick", action="store_true", help="2k-token request (under 3 minutes on 2 cores)")
    b.add_argument("--json", help="write the results JSON here")
    common(b)
    s = console.command(sub, "serve", "serve one pool over HTTP (put/get/lookup/stats) to several processes")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=console.integer("--port", 0, 65535), default=8470, help="TCP port (0: any free port)")
    s.add_argument("--ssd", action="append", default=[], help="an SSD directory (repeat for several)")
    s.add_argument(
        "--memory-modules",
        type=console.integer("--memory-modules", 0, MAX_DEVICES),
        default=2,
        help="memory modules of the pool",
    )
    s.add_argument(
        "--memory-bytes", type=console.size("--memory-bytes", MAX_BYTES), default="256MiB", help="per memory module"
    )
    s.add_argument("--ssd-bytes", type=console.size("--ssd-bytes", MAX_BYTES), default="1GiB", help="slab size per SSD")
    s.add_argument("--model-id", required=False, default="model", help="model identity hashed into keys")
    s.add_argument(
        "--layout",
        default="L16-H8-D64-float32-N256",
        help="KV layout tag L<layers>-H<kv heads>-D<head dim>-<dtype>-N<chunk>",
    )
    s.add_argument(
        "--token",
        help="bearer token every request must carry (default: $KVPOOL_TOKEN, else none); "
        "required when --host is beyond loopback",
    )
    return p


def _version() -> str:
    from . import __version__

    return __version__


def _config(args):
    from .bench import BenchConfig

    cfg = BenchConfig.quick() if getattr(args, "quick", True) else BenchConfig.full()
    if args.cmd == "demo":
        cfg.tokens, cfg.layers, cfg.reps = 1024 + 32, 16, 2
    if getattr(args, "small_chunks", None) is not None:
        cfg.small_chunks = args.small_chunks
    for option in ("tokens", "layers", "reps", "ssd_cap", "ssds", "io_backend"):
        if getattr(args, option):  # an option left out keeps the config's value
            setattr(cfg, "ssd_read_cap" if option == "ssd_cap" else option, getattr(args, option))
    try:
        cfg.validate()
    except ValueError as e:
        raise console.UsageError(str(e)) from None
    return cfg


def _progress(quiet: bool):
    if quiet:
        return lambda msg: None
    return lambda msg: print(f"[kvpool] {msg}", file=sys.stderr, flush=True)


def _modes(res: dict) -> list[str]:
    """The kvpool-vs-serial runs of a bench result, in order (emulated, emulated_<n>ssd, raw)."""
    return [k for k, v in res["results"].items() if isinstance(v, dict) and "kvpool" in v]


def _label(r: dict) -> str:
    if r.get("label"):
        return r["label"] + ("" if r.get("emulation_check", {}).get("valid", True) else " INVALID: caps not achieved")
    n = r.get("ssds")
    ssd = f"{n} SSDs" if n else "SSDs"
    if not r["emulated"]:
        return f"raw ({ssd} on one disk, no caps)"
    valid = r.get("emulation_check", {}).get("valid", True)
    return f"emulated ({ssd}, per-SSD caps){'' if valid else ' INVALID: caps not achieved'}"


def _table(res: dict) -> str:
    headers = ["method", "run", "TTFT s", "retrieval s", "retrieval GB/s", "blocked on I/O s", "page-cache bytes"]
    rows = [["recompute", None, round(res["results"]["recompute"]["ttft_s"], 3), None, None, None, None]]
    for mode in _modes(res):
        r = res["results"][mode]
        methods = [(f"{n} ({b['disks']} disk{'s' if b['disks'] > 1 else ''})", b) for n, b in r["baselines"].items()]
        for name, x in [*methods, ("kvpool", r["kvpool"])]:
            rows.append(
                [name, _label(r), *(round(x[k], 3) for k in ("ttft_s", "retrieval_s"))]
                + [round(x["retrieval_bytes_per_s"] / 1e9, 2), round(x["blocked_io_s"], 3), x["page_cache_bytes"]]
            )
    return console.table(rows, headers)


def _headline_table(h: dict, labels: dict | None = None) -> str:
    labels = labels or {}
    return console.table([[f"`{k}`", v, labels.get(k, "")] for k, v in h.items()], ["headline key", "value", "run"])


def _plot(res: dict, path: Path) -> bool:
    plt = console.pyplot("kvpool")
    if plt is None:
        return False
    modes = _modes(res)
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        r = res["results"][mode]
        per = r["kvpool"]["retrieval"]["per_device"]
        names = list(per)
        vals = [(per[n]["bytes_per_s"] or 0) / 1e6 for n in names]
        best = r["best_equal_bw_baseline"]
        names.append(f"{best} (total)")
        vals.append(r["baselines"][best]["retrieval_bytes_per_s"] / 1e6)
        names.append("kvpool (total)")
        vals.append(r["kvpool"]["retrieval_bytes_per_s"] / 1e6)
        colors = ["tab:blue"] * (len(names) - 2) + ["tab:gray", "tab:green"]
        ax.bar(names, vals, color=colors)
        ax.set_ylabel("MB/s")
        ax.set_title(f"retrieval bandwidth per device\n{_label(r)}", fontsize=9)
        ax.tick_params(axis="x", rotation=30)
    console.save_figure(fig, path, dpi=90)
    return True


def _run_bench(args, cfg) -> dict:
    # checked before the model is built; only the directory named is ever created
    workdir = console.output_dir(args.workdir, "--workdir") if args.workdir else None
    from .bench import run_bench

    return run_bench(cfg, workdir=workdir, progress=_progress(args.quiet))


def cmd_bench(args) -> int:
    cfg = _config(args)
    json_path = console.output_file(args.json, "--json") if args.json else None
    res = _run_bench(args, cfg)
    print(_table(res))
    print()
    print(_headline_table(res["headline"], res.get("headline_labels")))
    if json_path:
        console.write_json(json_path, res)
    return 0


def cmd_demo(args) -> int:
    import datetime as _dt

    import hwtopo

    cfg = _config(args)
    out = console.output_dir(args.out, "--out")
    res = _run_bench(args, cfg)
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
        "raw run: no caps. The baselines have the same memory tier; serial_one_disk one disk tier, the "
        "others one directory per SSD (same cap each).",
        "",
        table,
        "",
        _headline_table(res["headline"], res.get("headline_labels")),
        "",
    ]
    if plotted:
        text.append("bandwidth.png: retrieval bandwidth per kvpool device and in total, vs the best baseline.")
    hwtopo.atomic_write_text(out / "report.md", "\n".join(text) + "\n")
    console.write_json(out / "results.json", res)
    return 0


def cmd_serve(args) -> int:
    from hwtopo.httpguard import check_bind, token_from_env

    from .serve import parse_layout, serve_forever

    token = args.token or token_from_env("KVPOOL_TOKEN")
    try:
        check_bind(args.host, token)  # before any device is built
    except ValueError as e:
        raise console.UsageError(str(e)) from None
    try:
        layout = parse_layout(args.layout)
    except ValueError as e:
        raise console.UsageError(f"--layout: {e}") from None
    if not args.ssd and args.memory_modules <= 0:
        raise console.UsageError("serve needs at least one --ssd PATH or --memory-modules >= 1")
    args.ssd = [str(console.output_dir(p, "--ssd")) for p in args.ssd]
    serve_forever(
        host=args.host,
        port=args.port,
        ssd_paths=args.ssd,
        memory_modules=args.memory_modules,
        memory_bytes=args.memory_bytes,
        ssd_bytes=args.ssd_bytes,
        model_id=args.model_id,
        layout=layout,
        token=token,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return console.run(_parser(), {"bench": cmd_bench, "demo": cmd_demo, "serve": cmd_serve}, argv)
