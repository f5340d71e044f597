"""Diagnostic tools: a pure wait, a CPU burner, and a placement report (calibration, tests)."""

from __future__ import annotations

import os
import subprocess
import time


def sleep(args: dict, workdir: str) -> dict:
    """Block for ``seconds`` without using CPU (a stand-in for a tool hung on I/O); ``children``
    extra ``sleep`` processes are started in the same process group (they must die with it)."""
    s = float(args.get("seconds", 1.0))
    kids = [subprocess.Popen(["sleep", str(s)]) for _ in range(int(args.get("children", 0)))]
    with open(os.path.join(workdir, "children.pids"), "w") as f:
        f.write(" ".join(str(k.pid) for k in kids))
    time.sleep(s)
    for k in kids:
        k.wait()
    return {"slept_s": s, "children": [k.pid for k in kids]}


def burn(args: dict, workdir: str) -> dict:
    """Spin one core for ``cpu_s`` seconds of CPU time, holding ``alloc_mb`` MiB of touched memory."""
    target = float(args.get("cpu_s", 0.5))
    block = bytearray(int(float(args.get("alloc_mb", 0)) * (1 << 20)))
    for i in range(0, len(block), 4096):
        block[i] = 1
    t0 = time.process_time()
    n = 0
    while time.process_time() - t0 < target:
        for i in range(10_000):
            n += i * i % 7
    return {"cpu_s": time.process_time() - t0, "checksum": n % 1000003, "held_bytes": len(block)}


def whereami(args: dict, workdir: str) -> dict:
    """The CPUs and cgroups this tool process runs in, its process group and session, its user,
    group and host name, and the thread counts its numerical libraries are told."""
    with open("/proc/self/cgroup") as f:
        cgroups = f.read().strip().splitlines()
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "hostname": os.uname().nodename,
        "cpus": sorted(os.sched_getaffinity(0)),
        "cgroups": cgroups,
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
    }
