"""`hwtopo` console script: probe, show, check, measure."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

from . import __version__, console
from .emulate import LinkShaper, ShapedWriter, cgroup_available, throttle
from .measure import disk_bandwidth, matmul_flops, memcpy_bandwidth
from .model import Cluster, Machine
from .probe import probe
from .spec import atomic_write_text, load, to_dict
from .units import SpecError, format_bandwidth, format_bytes, format_duration, format_flops

_SPIN = (
    "import time,sys\nn=0\nt=time.perf_counter()+float(sys.argv[1])\nwhile time.perf_counter()<t:\n    n+=1\nprint(n)"
)


def _machine_lines(m: Machine) -> list[str]:
    head = f"{m.name}: {m.cores} cores / {m.hardware_threads} threads, {format_bytes(m.total_memory_bytes)} memory, speed {m.speed:g}"
    if m.flops:
        head += f", {format_flops(m.flops)} measured"
    if m.region:
        head += f", region {m.region}"
    out = [head]
    if m.isa:
        out.append(f"  isa: {' '.join(m.isa)}")
    for n in m.numa_nodes:
        bw = f", {format_bandwidth(n.bandwidth_bytes_per_s)}" if n.bandwidth_bytes_per_s else ""
        out.append(f"  numa{n.id}: cpus {len(n.cpus)}, {format_bytes(n.memory_bytes)}{bw}")
    for d in m.disks:
        extra = []
        if d.capacity_bytes:
            extra.append(format_bytes(d.capacity_bytes))
        if d.read_bandwidth_bytes_per_s:
            extra.append(f"read {format_bandwidth(d.read_bandwidth_bytes_per_s)}")
        if d.write_bandwidth_bytes_per_s:
            extra.append(f"write {format_bandwidth(d.write_bandwidth_bytes_per_s)}")
        kind = "HDD" if d.rotational else "SSD"
        out.append(f"  disk {d.name} ({kind}){' at ' + d.path if d.path else ''}: {', '.join(extra) or 'unmeasured'}")
    for a in m.accelerators:
        peak = f", {format_flops(a.peak_flops)} peak" if a.peak_flops else ""
        out.append(f"  {a.kind} {a.name}: {format_bytes(a.memory_bytes)}{peak}")
    for note in m.notes:
        out.append(f"  note: {note}")
    return out


def _show(c: Cluster) -> str:
    lines = [
        f"cluster {c.name}: {len(c.machines)} machine(s), {c.total_cores} cores, {format_bytes(c.total_memory_bytes)} memory"
    ]
    if c.regions:
        lines.append(f"regions: {', '.join(c.regions)}")
    for m in c.machines:
        lines.extend(_machine_lines(m))
    for link in c.links:
        lines.append(
            f"link {link.a} <-> {link.b}: {format_bandwidth(link.bandwidth_bytes_per_s)}, {format_duration(link.latency_s)}"
        )
    return "\n".join(lines)


def _spin_rate(seconds: float, speed: float | None, method: str = "auto") -> tuple[float, str]:
    """Iterations/s of a 1-CPU busy loop in a child process, optionally throttled."""
    p = subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)], stdout=subprocess.PIPE, text=True)
    used = "none"
    t = None
    if speed is not None:
        t = throttle(p.pid, speed, method=method)
        used = t.method
    try:
        out, _ = p.communicate(timeout=seconds * 10 + 30)
    finally:
        if t is not None:
            t.close()
    return int(out.strip()) / seconds, used


def measure_emulation(quick: bool = True) -> dict:
    """Ask for speed 0.5 and a 10MB/s, 20ms link; report what was achieved next to what was asked."""
    secs = 1.5 if quick else 4.0
    base, _ = _spin_rate(secs, None)
    cpu = []
    for method in ["cgroup", "duty-cycle"] if cgroup_available() else ["duty-cycle"]:
        slow, used = _spin_rate(secs, 0.5, method)
        ratio = slow / base
        cpu.append({"asked_speed": 0.5, "achieved_speed": ratio, "rel_error": abs(ratio - 0.5) / 0.5, "method": used})
    shaper = LinkShaper(bandwidth_bytes_per_s=10e6, latency_s=0.020)
    nbytes = 2_000_000 if quick else 8_000_000
    w = ShapedWriter(io.BytesIO(), shaper)
    t0 = time.perf_counter()
    w.write(os.urandom(nbytes))
    took = time.perf_counter() - t0
    achieved_bw = nbytes / max(1e-9, took - 0.020)
    return {
        "emulated": True,
        "cpu": cpu,
        "link": {
            "asked_bandwidth_bytes_per_s": 10e6,
            "achieved_bandwidth_bytes_per_s": achieved_bw,
            "asked_latency_s": 0.020,
            "rel_error": abs(achieved_bw - 10e6) / 10e6,
            "bytes": nbytes,
        },
    }


def _measure(args) -> dict:
    res: dict = {"machine": to_dict(Cluster(machines=(probe(gpus=False),)))["machines"][0]}
    secs = 0.2 if args.quick else 1.0
    threads = sorted({1, os.cpu_count() or 1})
    res["matmul"] = [vars(matmul_flops(256 if args.quick else 1024, t, secs)) for t in threads]
    res["memcpy_bytes_per_s"] = memcpy_bandwidth((16 if args.quick else 128) << 20, secs)
    path = args.disk or tempfile.gettempdir()
    size = (16 if args.quick else 256) << 20
    res["disk"] = [
        disk_bandwidth(path, size, direct=False).as_dict(),
        disk_bandwidth(path, size, direct=True).as_dict(),
    ]
    if args.emulation:
        res["emulation"] = measure_emulation(args.quick)
    return res


def _print_measure(res: dict) -> None:
    for m in res["matmul"]:
        print(f"matmul {m['size']}^3 fp32, {m['threads']} thread(s) [{m['backend']}]: {format_flops(m['flops'])}")
    print(f"memcpy: {format_bandwidth(res['memcpy_bytes_per_s'])}")
    for d in res["disk"]:
        mode = "O_DIRECT" if d["direct"] else "buffered"
        print(
            f"disk {d['path']} ({mode}): write {format_bandwidth(d['write_bytes_per_s'])}, read {format_bandwidth(d['read_bytes_per_s'])}"
        )
        for n in d["notes"]:
            print(f"  note: {n}")
    e = res.get("emulation")
    if e:
        link = e["link"]
        for c in e["cpu"]:
            print(
                f"[emulated] cpu speed: asked {c['asked_speed']:.2f}, achieved {c['achieved_speed']:.3f} "
                f"via {c['method']} (error {c['rel_error']:.1%})"
            )
        print(
            f"[emulated] link: asked {format_bandwidth(link['asked_bandwidth_bytes_per_s'])}, achieved "
            f"{format_bandwidth(link['achieved_bandwidth_bytes_per_s'])} (error {link['rel_error']:.1%}), latency {format_duration(link['asked_latency_s'])}"
        )


def build_parser() -> argparse.ArgumentParser:
    p, sub = console.parser("hwtopo", "Describe, check, measure and emulate hardware for mlsyskit.", __version__)
    sp = console.command(sub, "probe", "describe this machine")
    sp.add_argument("--json", action="store_true", help="print the machine as a JSON cluster spec")
    sp.add_argument("--name", help="machine name (default: host name)")
    ss = console.command(sub, "show", "print a spec in human units")
    ss.add_argument("spec", help="a .json/.toml spec file or a bundled example name (e.g. edge-home)")
    ss.add_argument("--json", action="store_true", help="print the normalized spec as JSON")
    sc = console.command(sub, "check", "validate a spec; exit 2 with the error on a bad one")
    sc.add_argument("spec", help="a .json/.toml spec file or a bundled example name")
    sm = console.command(sub, "measure", "run the light microbenchmarks on this machine")
    sm.add_argument("--quick", action="store_true", help="smaller sizes, a few seconds in all")
    sm.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
    sm.add_argument("--disk", metavar="DIR", help="directory on the disk to measure (default: the temp dir)")
    sm.add_argument(
        "--emulation", action="store_true", help="also measure achieved emulated CPU speed and link bandwidth"
    )
    return p


def _load(spec: str) -> Cluster:
    """A spec, with a bad or missing file as a usage error (exit 2)."""
    try:
        return load(spec)
    except (SpecError, FileNotFoundError) as e:
        raise console.UsageError(str(e)) from None


def cmd_probe(args) -> int:
    m = probe(args.name)
    c = Cluster(name=m.name, machines=(m,))
    print(json.dumps(to_dict(c), indent=2) if args.json else _show(c))
    return 0


def cmd_show(args) -> int:
    c = _load(args.spec)
    print(json.dumps(to_dict(c), indent=2) if args.json else _show(c))
    return 0


def cmd_check(args) -> int:
    c = _load(args.spec)
    print(f"ok: {c.name}: {len(c.machines)} machine(s), {len(c.links)} link(s)")
    return 0


def cmd_measure(args) -> int:
    if args.json and args.json != "-":
        console.output_file(args.json, "--json")
    if args.disk and not os.path.isdir(args.disk):
        raise console.UsageError(f"--disk {args.disk!r} is not a directory")
    res = _measure(args)
    if args.json == "-":
        print(json.dumps(res, indent=2))
    else:
        _print_measure(res)
        if args.json:
            atomic_write_text(args.json, json.dumps(res, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    handlers = {"probe": cmd_probe, "show": cmd_show, "check": cmd_check, "measure": cmd_measure}
    return console.run(build_parser(), handlers, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
