"""``agentdyn`` command line: serve, run, llm-emulator, bench, characterize, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from . import __version__

log = logging.getLogger("agentdyn")


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _progress(args):
    if args.quiet:
        return None
    return lambda msg: print(f"[agentdyn] {msg}", file=sys.stderr, flush=True)


def _write_json(path: str, obj: dict) -> None:
    import hwtopo

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    hwtopo.atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _port(text: str) -> int:
    """argparse type: a TCP port (0 = any free port), so a bad one fails before any work starts."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


def _positive(name: str, value: float) -> None:
    if value is not None and not value > 0:
        raise UsageError(f"--{name} must be > 0, not {value!r}")


def _emulator(args):
    from .emulator import EmulatorConfig

    if args.ttft < 0:
        raise UsageError(f"--ttft must be >= 0 seconds, not {args.ttft!r}")
    _positive("tokens-per-s", args.tokens_per_s)
    return EmulatorConfig(ttft_s=args.ttft, tokens_per_s=args.tokens_per_s, seed=args.seed)


def _llm(args):
    if not args.llm_base_url:
        return None
    from .llm import LLMConfig

    try:
        return LLMConfig(
            base_url=args.llm_base_url,
            model=args.llm_model,
            api_key=args.llm_key or os.environ.get("OPENAI_API_KEY", "none"),
            timeout_s=args.llm_timeout,
            retries=args.llm_retries,
        )
    except ValueError as e:
        raise UsageError(str(e).replace("llm ", "--llm-", 1).replace("base_url", "base-url")) from None


def _harness(args):
    from .monitor import SystemSampler
    from .runtime import Harness

    _positive("tool-timeout", args.tool_timeout)
    _positive("site-pages", args.site_pages)  # 0 pages would leave web_search nothing to crawl
    return Harness(
        emulator=_emulator(args),
        llm=_llm(args),
        site_pages=args.site_pages,
        tool_timeout_s=args.tool_timeout,
        sampler=SystemSampler(0.1).start(),
    )


async def _install_policy(h, args, progress=None) -> None:
    from hwtopo import usable_cpus

    from .bench import WorkloadConfig, calibrate
    from .profiles import ProfileStore
    from .scheduler import make_policy

    store = None
    if args.policy == "optimized":
        if args.profiles and Path(args.profiles).exists():
            store = ProfileStore.load(args.profiles)
        else:
            if progress:
                progress("calibrating tool profiles (one request per task type, alone)")
            store = await calibrate(h, WorkloadConfig(), h.sampler)
            if args.profiles:
                store.save(args.profiles)
    h.set_policy(make_policy(args.policy, usable_cpus(), store, h.sampler))


def _llm_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LLM endpoint (default: the embedded emulator)")
    g.add_argument("--llm-base-url", help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    g.add_argument("--llm-key", help="API key (default: $OPENAI_API_KEY)")
    g.add_argument("--llm-model", default="agentdyn-emulated", help="model name sent to the endpoint")
    g.add_argument("--llm-timeout", type=float, default=60.0, help="seconds per LLM attempt")
    g.add_argument("--llm-retries", type=int, default=2, help="retries after the first attempt")
    g.add_argument("--ttft", type=float, default=0.4, help="emulator: median time to first token, s")
    g.add_argument("--tokens-per-s", type=float, default=60.0, help="emulator: median tokens/s")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--site-pages", type=int, default=300, help="pages of the fixture web site")
    p.add_argument("--tool-timeout", type=float, default=120.0, help="seconds before a tool's process group is killed")
    p.add_argument("--policy", choices=["native", "static", "optimized"], default="optimized")
    p.add_argument("--profiles", help="JSON of learned tool profiles (read if present, else calibrated and written)")


# ---------------------------------------------------------------- commands


def cmd_serve(args) -> int:
    from hwtopo.httpguard import check_bind, token_from_env

    from .service import serve

    token = args.token or token_from_env("AGENTDYN_TOKEN")
    try:
        check_bind(args.host, token)  # before the harness starts its emulator, site and sampler
    except ValueError as e:
        raise UsageError(str(e)) from None
    h = _harness(args)
    progress = _progress(args)

    async def setup(h):
        await _install_policy(h, args, progress)

    def ready(url):
        print(f"agentdyn serving on {url} (policy {args.policy})", flush=True)

    return asyncio.run(serve(h, args.host, args.port, args.drain_timeout, ready=ready, setup=setup, token=token))


def cmd_run(args) -> int:
    from .runtime import validate_request

    try:
        inp = json.loads(args.input)
    except json.JSONDecodeError as e:
        raise UsageError(f"--input: not valid JSON ({e.msg})") from None
    from .runtime import RequestError

    try:
        req = validate_request({"task_type": args.task_type, "input": inp})
    except RequestError as e:
        raise UsageError(str(e)) from None
    h = _harness(args)

    async def go():
        async with h:
            await _install_policy(h, args, _progress(args))
            return await h.runtime.run(req)

    res = asyncio.run(go())
    print(json.dumps(res.to_dict(), indent=2))
    return 0 if res.ok else 1


def cmd_llm_emulator(args) -> int:
    from .emulator import LLMEmulator

    emu = LLMEmulator(_emulator(args), host=args.host, port=args.port)

    async def go():
        url = await emu.start()
        print(f"agentdyn llm-emulator on {url} (emulated: ttft {args.ttft}s, {args.tokens_per_s} tok/s)", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await emu.stop()
        return 0

    return asyncio.run(go())


def _workload(args, default_per_type: int | None = None):
    from .bench import WorkloadConfig
    from .emulator import EmulatorConfig

    per_type = args.per_type or default_per_type or (3 if args.quick else 6)
    if args.ttft < 0:
        raise UsageError(f"--ttft must be >= 0 seconds, not {args.ttft!r}")
    _positive("tokens-per-s", args.tokens_per_s)
    if args.per_type is not None and args.per_type < 1:
        raise UsageError(f"--per-type must be >= 1, not {args.per_type}")
    tt = args.tool_threads
    if tt == "inherit":
        tt = None
    elif tt != "default":
        try:
            tt = int(tt)
        except ValueError:
            tt = 0
        if tt < 1:
            raise UsageError(
                f"--tool-threads must be 'default', 'inherit' or an integer >= 1, not {args.tool_threads!r}"
            )
    try:
        return WorkloadConfig(
            per_type=per_type,
            coding_work=args.coding_work,
            seed=args.seed,
            tool_threads=tt,
            emulator=EmulatorConfig(ttft_s=args.ttft, tokens_per_s=args.tokens_per_s, seed=args.seed),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _bench_json(out: dict, cfg, quick: bool) -> dict:
    import hwtopo

    return {
        "package": "agentdyn",
        "version": __version__,
        "config": {**cfg.to_dict(), "quick": quick},
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": out["results"],
        "headline": out["headline"],
        "emulated": {"llm": cfg.emulator.describe(), "web_link": {"emulated": True, "latency_s": cfg.site_latency_s}},
        "profiles": out.get("profiles"),
        "order": out.get("order"),
        "sampler_overhead": out.get("sampler_overhead"),
        "group_watcher_overhead": out.get("watcher_overhead"),
        "note": "measured side by side in one process, one variant after another; the host may be shared",
    }


def cmd_bench(args) -> int:
    from .bench import bench
    from .report import bench_table

    cfg = _workload(args)
    repeats = args.repeats or (1 if args.quick else 2)
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1, not {repeats}")
    out = asyncio.run(bench(cfg, progress=_progress(args), repeats=repeats))
    doc = _bench_json(out, cfg, args.quick)
    doc["config"]["repeats"] = repeats
    print(bench_table(out))
    print(json.dumps(out["headline"], indent=2))
    if args.json:
        _write_json(args.json, doc)
    return 0


def cmd_characterize(args) -> int:
    from .characterize import CharacterizeConfig, characterize
    from .report import characterize_markdown, plot_characterize, write_report

    def _list(text: str, flag: str, kind, minimum, what: str) -> tuple:
        try:
            vals = tuple(kind(x) for x in text.split(","))
        except ValueError:
            raise UsageError(f"{flag}: {text!r} is not a comma-separated list of {what}") from None
        if min(vals) < minimum:
            raise UsageError(f"{flag}: {text!r} must list {what}")
        return vals

    conc = _list(args.concurrency, "--concurrency", int, 1, "integers >= 1, e.g. 1,2,4")
    ttft = _list(args.llm_ttft, "--llm-ttft", float, 0.0, "seconds >= 0, e.g. 0.3,0.05")
    cores = _list(args.cores, "--cores", int, 1, "integers >= 1, e.g. 1,2")
    try:
        cfg = CharacterizeConfig(concurrency=conc, llm_ttft_s=ttft, cores=cores, coding_work=args.coding_work)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = asyncio.run(characterize(cfg, progress=_progress(args)))
    os.makedirs(args.out, exist_ok=True)
    plots = plot_characterize(out, args.out)
    md = characterize_markdown(out)
    body = (
        "Latency per request, broken down (seconds). Cores and LLM speed are emulated (tools pinned to "
        f"the first N CPUs; LLM emulator). Pressure source: {out['pressure_source']}.\n\n" + md
    )
    write_report(os.path.join(args.out, "report.md"), "agentdyn characterization", body, plots)
    _write_json(os.path.join(args.out, "characterize.json"), out)
    print(md)
    print(f"wrote {os.path.join(args.out, 'report.md')} and {len(plots)} plot(s)")
    return 0


def cmd_demo(args) -> int:
    from .bench import bench
    from .report import bench_table, plot_bench, write_report

    cfg = _workload(args, default_per_type=2)
    out = asyncio.run(bench(cfg, progress=_progress(args)))
    os.makedirs(args.out, exist_ok=True)
    table = bench_table(out)
    plot = plot_bench(out, os.path.join(args.out, "latency.png"))
    head = out["headline"]
    body = (
        f"Mixed workload: {cfg.per_type} request(s) per task type arriving within {cfg.arrival_window_s}s, "
        f"emulated LLM (TTFT {cfg.emulator.ttft_s}s, {cfg.emulator.tokens_per_s} tok/s), emulated web link; "
        "policies run one after another in one process on this (possibly shared) machine.\n\n"
        + table
        + "\n\n```json\n"
        + json.dumps(head, indent=2)
        + "\n```\n\nplot: latency.png (mean latency per task type and policy)"
    )
    write_report(os.path.join(args.out, "report.md"), "agentdyn demo", body, [plot])
    _write_json(os.path.join(args.out, "bench.json"), _bench_json(out, cfg, True))
    print(table)
    print(json.dumps(head, indent=2))
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentdyn", description=__doc__)
    p.add_argument("--version", action="version", version=f"agentdyn {__version__}")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="the agent runtime as an HTTP service")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8080)
    s.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to finish in-flight requests on SIGTERM")
    s.add_argument(
        "--token",
        help="bearer token every request must carry (default: $AGENTDYN_TOKEN, else none); "
        "required when --host is beyond loopback",
    )
    _llm_options(s)
    s.set_defaults(fn=cmd_serve)

    r = sub.add_parser("run", help="run one agent request in-process and print its result")
    r.add_argument("task_type", help="rag_qa, web_search or coding")
    r.add_argument("--input", default="{}", help="the request input as JSON")
    _llm_options(r)
    r.set_defaults(fn=cmd_run)

    e = sub.add_parser("llm-emulator", help="the OpenAI-compatible LLM emulator")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=_port, default=8000)
    e.add_argument("--ttft", type=float, default=0.4, help="median time to first token, s")
    e.add_argument("--tokens-per-s", type=float, default=60.0)
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(fn=cmd_llm_emulator)

    for name, fn, helptext in (
        ("bench", cmd_bench, "native, static limit and CPU-aware policies side by side"),
        ("demo", cmd_demo, "a small bench with report.md and a plot"),
    ):
        b = sub.add_parser(name, help=helptext)
        b.add_argument("--quick", action="store_true", help="small workload (under 3 minutes on 2 idle cores)")
        b.add_argument("--per-type", type=int, default=None, help="requests per task type")
        b.add_argument("--coding-work", type=int, default=40_000, help="CPU work of the coding task's test suite")
        b.add_argument("--ttft", type=float, default=0.3, help="emulated LLM median time to first token, s")
        b.add_argument("--tokens-per-s", type=float, default=80.0)
        b.add_argument("--seed", type=int, default=0)
        b.add_argument(
            "--tool-threads",
            default="default",
            help="threads numerical libraries in tools start: 'default' (their own default, one per core the "
            "tool may use, as in an unconstrained container), 'inherit' (this environment; 1 if unset), or N",
        )
        if name == "bench":
            b.add_argument("--json", help="write the results JSON here")
            b.add_argument(
                "--repeats",
                type=int,
                default=None,
                help="rounds of native/optimized, alternating (default 1 quick, 2 full)",
            )
        else:
            b.add_argument("--out", default="demo-output/agentdyn")
        b.set_defaults(fn=fn)

    c = sub.add_parser("characterize", help="latency breakdowns per task type at rising concurrency, LLM speeds, cores")
    c.add_argument("--out", default="characterize-output/agentdyn")
    c.add_argument("--concurrency", default="1,2,4")
    c.add_argument("--llm-ttft", default="0.3,0.05")
    c.add_argument("--cores", default="1,2")
    c.add_argument("--coding-work", type=int, default=40_000)
    c.set_defaults(fn=cmd_characterize)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"agentdyn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - runtime failures: one line unless --debug
        if args.debug:
            raise
        print(f"agentdyn: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
