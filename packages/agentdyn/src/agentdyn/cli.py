"""``agentdyn`` command line: serve, run, llm-emulator, bench, characterize, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hwtopo import console

from . import __version__

MAX_SECONDS = 86_400.0  # a day: any timeout or latency beyond it is a typo
MAX_COUNT = 10_000  # requests per type, repeats, pages, concurrency
MAX_WORK = 10**9  # CPU work units of the coding task


DESCRIPTION = "Run AI agents with CPU-aware tool admission and task-aware CPU allocation, and measure them."


def _list(field: str, item: Callable[[str], float], example: str) -> Callable[[str], tuple]:
    """argparse type: a comma-separated list, each item checked by ``item``."""

    def parse(text: str) -> tuple:
        try:
            return tuple(item(x) for x in text.split(","))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{field}: {text!r} is not a list like {example} ({e})") from None

    return parse


def _tool_threads(text: str) -> int | str | None:
    if text in ("default", "inherit"):
        return None if text == "inherit" else text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 4096:
        raise argparse.ArgumentTypeError(
            f"--tool-threads must be 'default', 'inherit' or an integer 1-4096, not {text!r}"
        )
    return v


def _progress(args):
    if args.quiet:
        return None
    return lambda msg: print(f"[agentdyn] {msg}", file=sys.stderr, flush=True)


def _emulator(args):
    from .emulator import EmulatorConfig

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
        raise console.UsageError(str(e).replace("llm ", "--llm-", 1).replace("base_url", "base-url")) from None


def _harness(args):
    from .monitor import SystemSampler
    from .runtime import Harness

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
    g.add_argument(
        "--llm-timeout",
        type=console.positive_float("--llm-timeout", MAX_SECONDS),
        default=60.0,
        help="seconds per LLM attempt",
    )
    g.add_argument(
        "--llm-retries",
        type=console.integer("--llm-retries", 0, 100),
        default=2,
        help="retries after the first attempt",
    )
    _emulator_options(g, 0.4, 60.0)
    # 0 pages would leave web_search nothing to crawl
    p.add_argument(
        "--site-pages",
        type=console.positive_int("--site-pages", MAX_COUNT),
        default=300,
        help="pages of the fixture web site",
    )
    p.add_argument(
        "--tool-timeout",
        type=console.positive_float("--tool-timeout", MAX_SECONDS),
        default=120.0,
        help="seconds before a tool's process group is killed",
    )
    p.add_argument("--policy", choices=["native", "static", "optimized"], default="optimized", help="CPU policy")
    p.add_argument("--profiles", help="JSON of learned tool profiles (read if present, else calibrated and written)")


def _emulator_options(g, ttft: float, tokens_per_s: float) -> None:
    g.add_argument(
        "--ttft",
        type=console.number("--ttft", 0, MAX_SECONDS),
        default=ttft,
        help="emulated LLM median time to first token, s",
    )
    g.add_argument(
        "--tokens-per-s",
        type=console.positive_float("--tokens-per-s", 1e6),
        default=tokens_per_s,
        help="emulated LLM median tokens/s",
    )
    g.add_argument(
        "--seed", type=console.integer("--seed", 0, 2**32 - 1), default=0, help="seed of the emulator and workload"
    )


def _check_profiles(args) -> None:
    """--profiles is read when it exists, else written after calibration: either way, checked now."""
    if args.policy != "optimized" or not args.profiles:
        return
    p = Path(args.profiles)
    if p.exists() and not p.is_file():
        raise console.UsageError(f"--profiles {args.profiles!r} is not a file")
    if not p.exists():
        console.output_file(p, "--profiles")
        return
    from .profiles import ProfileStore

    try:
        ProfileStore.load(p)
    except ValueError as e:
        raise console.UsageError(f"--profiles: {e}") from None


# ---------------------------------------------------------------- commands


def _token(args) -> str | None:
    """``--token`` or $AGENTDYN_TOKEN, refused (exit 2) when missing for a host beyond loopback."""
    from hwtopo.httpguard import check_bind, token_from_env

    token = args.token or token_from_env("AGENTDYN_TOKEN")
    try:
        check_bind(args.host, token)
    except ValueError as e:
        raise console.UsageError(str(e)) from None
    return token


def cmd_serve(args) -> int:
    from .service import sandbox_isolation, serve

    token = _token(args)  # before the harness starts its emulator, site and sampler
    _check_profiles(args)
    if not args.unsafe_no_sandbox:
        sandbox_isolation()  # a host without the tool sandbox: refused (exit 1) before anything starts
    h = _harness(args)
    progress = _progress(args)

    async def setup(h):
        await _install_policy(h, args, progress)

    def ready(url):
        print(f"agentdyn serving on {url} (policy {args.policy})", flush=True)

    unsafe = args.unsafe_no_sandbox
    return asyncio.run(
        serve(
            h, args.host, args.port, args.drain_timeout, ready=ready, setup=setup, token=token, unsafe_no_sandbox=unsafe
        )
    )


def cmd_run(args) -> int:
    from hwtopo.httpguard import BadRequest, parse_json

    from .runtime import validate_request

    try:
        inp = parse_json(args.input.encode("utf-8", "surrogateescape"), max_bytes=1 << 20)
    except BadRequest as e:
        raise console.UsageError(f"--input: {e}") from None
    from .runtime import RequestError

    try:
        req = validate_request({"task_type": args.task_type, "input": inp})
    except RequestError as e:
        raise console.UsageError(str(e)) from None
    _check_profiles(args)
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

    emu = LLMEmulator(_emulator(args), host=args.host, port=args.port, token=_token(args))

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


def _workload(args, one_seed: bool = False):
    from .bench import HELDOUT_SEEDS, WorkloadConfig
    from .emulator import EmulatorConfig

    seeds = getattr(args, "seeds", None) or (HELDOUT_SEEDS[:1] if args.quick or one_seed else HELDOUT_SEEDS)
    try:
        return WorkloadConfig(
            per_type=args.per_type,
            coding_work=args.coding_work,
            seed=args.seed,
            seeds=tuple(seeds),
            tool_threads=args.tool_threads,
            emulator=EmulatorConfig(ttft_s=args.ttft, tokens_per_s=args.tokens_per_s, seed=args.seed),
        )
    except ValueError as e:
        raise console.UsageError(str(e)) from None


def _bench_json(out: dict, cfg, quick: bool) -> dict:
    extra = {k: out.get(k) for k in ("profiles", "classes", "order", "loads", "host", "service", "sandbox", "wall_s")}
    return console.bench_doc(
        "agentdyn",
        __version__,
        {**cfg.to_dict(), "quick": quick},
        out["results"],
        out["headline"],
        emulated={"llm": cfg.emulator.describe(), "web_link": {"emulated": True, "latency_s": cfg.site_latency_s}},
        **extra,
        sampler_overhead=out.get("sampler_overhead"),
        group_watcher_overhead=out.get("watcher_overhead"),
        note="measured side by side in one process, one variant after another; the host may be shared",
    )


def cmd_bench(args) -> int:
    from .bench import bench
    from .report import bench_table

    cfg = _workload(args)
    json_path = console.output_file(args.json, "--json") if args.json else None
    repeats = args.repeats or 1
    t0 = time.monotonic()
    out = asyncio.run(bench(cfg, progress=_progress(args), repeats=repeats, service=True))
    out["wall_s"] = time.monotonic() - t0
    doc = _bench_json(out, cfg, args.quick)
    doc["config"]["repeats"] = repeats
    print(bench_table(out))
    print(json.dumps(out["headline"], indent=2))
    if json_path:
        console.write_json(json_path, doc)
    return 0


def cmd_characterize(args) -> int:
    from .characterize import CharacterizeConfig, characterize
    from .report import characterize_markdown, plot_characterize, write_report

    try:
        cfg = CharacterizeConfig(
            concurrency=args.concurrency, llm_ttft_s=args.llm_ttft, cores=args.cores, coding_work=args.coding_work
        )
    except ValueError as e:
        raise console.UsageError(str(e)) from None
    args.out = str(console.output_dir(args.out, "--out"))
    out = asyncio.run(characterize(cfg, progress=_progress(args)))
    console.write_json(os.path.join(args.out, "characterize.json"), out)  # saved before anything else can fail
    plots = plot_characterize(out, args.out)
    md = characterize_markdown(out)
    body = (
        "Latency per request, broken down (seconds). Cores and LLM speed are emulated (tools pinned to "
        f"the first N CPUs; LLM emulator). Pressure source: {out['pressure_source']}.\n\n" + md
    )
    write_report(os.path.join(args.out, "report.md"), "agentdyn characterization", body, plots)
    print(md)
    print(f"wrote {os.path.join(args.out, 'report.md')} and {len(plots)} plot(s)")
    return 0


def cmd_demo(args) -> int:
    from .bench import bench
    from .report import bench_table, plot_bench, write_report

    cfg = _workload(args, one_seed=True)
    args.out = str(console.output_dir(args.out, "--out"))
    out = asyncio.run(bench(cfg, progress=_progress(args)))
    console.write_json(os.path.join(args.out, "bench.json"), _bench_json(out, cfg, True))  # saved before plotting
    table = bench_table(out)
    plot = plot_bench(out, os.path.join(args.out, "latency.png"))
    head = out["headline"]
    body = (
        f"Mixed workloads at each offered CPU load ({', '.join(f'{k} {v:g}' for k, v in cfg.loads)}), requests "
        f"arriving within {cfg.arrival_window_s}s (seed {list(cfg.seeds)}), fair baselines with the same tool "
        "thread caps, "
        f"emulated LLM (TTFT {cfg.emulator.ttft_s}s, {cfg.emulator.tokens_per_s} tok/s), emulated web link; "
        "policies run one after another in one process on this (possibly shared) machine.\n\n"
        + table
        + "\n\n```json\n"
        + json.dumps(head, indent=2)
        + "\n```\n"
        + ("\nplot: latency.png (mean latency per task type and policy)" if plot else "")
    )
    write_report(os.path.join(args.out, "report.md"), "agentdyn demo", body, [plot] if plot else [])
    print(table)
    print(json.dumps(head, indent=2))
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    return 0


def _bench_parsers(sub) -> None:
    for name, helptext in (
        ("bench", "fair baselines and the CPU-aware policy side by side, at a fitting and an oversubscribed load"),
        ("demo", "a small bench with report.md and a plot"),
    ):
        b = console.command(sub, name, helptext)
        b.add_argument(
            "--quick", action="store_true", help="one held-out seed instead of three (about 3 minutes on 2 idle cores)"
        )
        b.add_argument(
            "--per-type",
            type=console.positive_int("--per-type", MAX_COUNT),
            help="requests per task type at every load (default: sized from calibration to each load's offered "
            "CPU load)",
        )
        b.add_argument(
            "--coding-work",
            type=console.positive_int("--coding-work", MAX_WORK),
            default=40_000,
            help="CPU work of the coding task's test suite",
        )
        _emulator_options(b, 0.3, 80.0)
        b.add_argument(
            "--tool-threads",
            type=_tool_threads,
            default="default",
            help="threads numerical libraries in tools start: 'default' (their own default, one per core the "
            "tool may use, as in an unconstrained container), 'inherit' (this environment; 1 if unset), or N",
        )
        if name == "bench":
            b.add_argument("--json", help="write the results JSON here")
            b.add_argument(
                "--repeats",
                type=console.positive_int("--repeats", MAX_COUNT),
                help="rounds of every variant per seed and load, in rotated order (default 1)",
            )
            b.add_argument(
                "--seeds",
                type=_list("--seeds", console.integer("--seeds", 0, 2**32 - 1), "101,102"),
                help="workload seeds to report (default: the held-out 101,102,103; --quick 101); "
                "settings are chosen on 0,1,2, so those are not held out (the JSON says so)",
            )
        else:
            b.add_argument("--out", default="demo-output/agentdyn", help="output directory (its parent must exist)")


def _characterize_parser(sub) -> None:
    c = console.command(
        sub, "characterize", "latency breakdowns per task type at rising concurrency, LLM speeds, cores"
    )
    c.add_argument("--out", default="characterize-output/agentdyn", help="output directory (its parent must exist)")
    count = console.positive_int("--concurrency", MAX_COUNT)
    c.add_argument(
        "--concurrency", type=_list("--concurrency", count, "1,2,4"), default="1,2,4", help="requests at once"
    )
    ttft = console.number("--llm-ttft", 0, MAX_SECONDS)
    c.add_argument("--llm-ttft", type=_list("--llm-ttft", ttft, "0.3,0.05"), default="0.3,0.05", help="LLM TTFTs, s")
    cores = console.positive_int("--cores", 4096)
    c.add_argument("--cores", type=_list("--cores", cores, "1,2"), default="1,2", help="CPUs the tools may use")
    c.add_argument(
        "--coding-work", type=console.positive_int("--coding-work", MAX_WORK), default=40_000, help="CPU work units"
    )


def build_parser() -> argparse.ArgumentParser:
    p, sub = console.parser("agentdyn", DESCRIPTION, __version__)
    s = console.command(sub, "serve", "the agent runtime as an HTTP service")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=console.integer("--port", 0, 65535), default=8080, help="TCP port (0: any free port)")
    s.add_argument(
        "--drain-timeout",
        type=console.number("--drain-timeout", 0, MAX_SECONDS),
        default=120.0,
        help="seconds to finish in-flight requests on SIGTERM",
    )
    s.add_argument(
        "--token",
        help="bearer token every request must carry (default: $AGENTDYN_TOKEN, else none); "
        "required when --host is beyond loopback",
    )
    s.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="run tools without their sandbox: as this service's user, with its filesystem and "
        "network (only an allow-listed environment and rlimits remain); without it, serve refuses to "
        "start on a host that lacks a sandbox layer (user, namespaces, cgroup memory/pids/kill) and names it",
    )
    _llm_options(s)

    r = console.command(sub, "run", "run one agent request in-process and print its result")
    r.add_argument("task_type", help="rag_qa, web_search or coding")
    r.add_argument("--input", default="{}", help="the request input as JSON")
    _llm_options(r)

    e = console.command(sub, "llm-emulator", "the OpenAI-compatible LLM emulator")
    e.add_argument("--host", default="127.0.0.1", help="address to bind")
    e.add_argument("--port", type=console.integer("--port", 0, 65535), default=8000, help="TCP port (0: any free port)")
    e.add_argument(
        "--token",
        help="bearer token (an OpenAI client's API key) every request must carry (default: "
        "$AGENTDYN_TOKEN, else none); required when --host is beyond loopback",
    )
    _emulator_options(e, 0.4, 60.0)
    _bench_parsers(sub)
    _characterize_parser(sub)
    return p


HANDLERS = {
    "serve": cmd_serve,
    "run": cmd_run,
    "llm-emulator": cmd_llm_emulator,
    "bench": cmd_bench,
    "demo": cmd_demo,
    "characterize": cmd_characterize,
}


def main(argv: list[str] | None = None) -> int:
    return console.run(build_parser(), HANDLERS, argv)


if __name__ == "__main__":
    sys.exit(main())
