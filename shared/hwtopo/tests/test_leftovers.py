"""Emulation leaves nothing behind: kill -9 a creator or a watchdog and list what is left.

Every test lists, before and after, the helper processes of its target (watchdogs and their
guardians) and the cgroups of its creator, and asserts that the lists match and that no process is
left stopped. A throttle in the stop phase is caught by polling the target's state; the waits are
polls with a generous deadline, not sleeps that assume a speed.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import hwtopo
from hwtopo import cgroups, emulate

DEADLINE_S = 30.0
SLEEPER = "import time; time.sleep(120)"


def _state(pid: int) -> str | None:
    return cgroups._proc_state(pid)


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {DEADLINE_S:g} s")
        time.sleep(0.01)


def _cmdlines():
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    yield int(d), fh.read().decode(errors="replace").split("\0")
            except OSError:
                continue


def _watchdogs(target: int) -> set[int]:
    """Duty-cycle watchdogs of ``target`` and their guardians (forks sharing the command line)."""
    out = set()
    for pid, args in _cmdlines():
        if emulate.WATCHDOG_MARKER in args:
            i = args.index(emulate.WATCHDOG_MARKER)
            if args[i + 1 : i + 2] == [str(target)] and _state(pid) not in ("Z", None):
                out.add(pid)
    return out


def _guardians(creator: int) -> set[int]:
    return {
        pid
        for pid, args in _cmdlines()
        if len(args) > 3 and args[2] == cgroups._GUARDIAN and args[3] == str(creator) and _state(pid) != "Z"
    }


def _groups(creator: int) -> set[str]:
    prefix = f"{cgroups.PREFIX}{creator}-"
    return {str(p) for h in cgroups._hierarchies() for p in h.root.glob(f"{prefix}*")}


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end(creator: subprocess.Popen, *others: int) -> None:
    """Kill what a test started (the creator last, so its children are not left to it)."""
    _kill(*others, creator.pid)
    creator.wait()
    creator.stdout.close()


def _creator(body: str) -> tuple[subprocess.Popen, list[str]]:
    """A Python process that runs ``body``, prints a line of ids, then sleeps until killed."""
    code = f"import os, subprocess, sys, time, hwtopo\n{body}\ntime.sleep(120)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    assert line, "the creator printed nothing"
    return p, line


# speed 0.001 of a 1 s period: 1 ms running, 999 ms stopped, so a kill lands in the stop phase
STOPPING = "hwtopo.throttle({pid}, 0.001, method='duty-cycle', period_s=1.0)"


def test_watchdog_killed_while_target_stopped_resumes_it():
    target = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        assert _watchdogs(target.pid) == set()
        t = hwtopo.throttle(target.pid, 0.001, method="duty-cycle", period_s=1.0)
        _wait(lambda: _state(target.pid) == "T", "stopped by the watchdog")
        assert len(_watchdogs(target.pid)) == 2  # the watchdog and its guardian
        _kill(t._watchdog.pid)
        _wait(lambda: not _watchdogs(target.pid), "free of watchdog processes")
        assert _state(target.pid) in ("S", "R")
        t.close()  # closing after the watchdog died is harmless
        assert _state(target.pid) in ("S", "R")
    finally:
        target.kill()
        target.wait()


@pytest.mark.parametrize("watchdog_too", [False, True], ids=["creator", "creator-and-watchdog"])
def test_killed_creator_leaves_no_stopped_target(watchdog_too):
    creator, (target, watchdog) = _creator(
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        f"t = {STOPPING.format(pid='p.pid')}\n"
        "print(p.pid, t._watchdog.pid, flush=True)"
    )
    target, watchdog = int(target), int(watchdog)
    try:
        _wait(lambda: _state(target) == "T", "stopped by the watchdog")
        # with the watchdog killed as well, only its guardian is left to resume the target
        _kill(*([watchdog] if watchdog_too else []), creator.pid)
        creator.wait()
        _wait(lambda: not _watchdogs(target), "free of watchdog processes")
        assert _state(target) in ("S", "R")
    finally:
        _end(creator, target, watchdog)


def test_self_throttled_process_resumes_when_its_watchdog_is_killed():
    creator, (watchdog,) = _creator(f"t = {STOPPING.format(pid='None')}\nprint(t._watchdog.pid, flush=True)")
    watchdog = int(watchdog)
    try:
        _wait(lambda: _state(creator.pid) == "T", "stopped by its own watchdog")
        _kill(watchdog)
        _wait(lambda: not _watchdogs(creator.pid), "free of watchdog processes")
        assert _state(creator.pid) in ("S", "R")
    finally:
        _end(creator, watchdog)


needs_cgroup = pytest.mark.skipif(not hwtopo.cgroup_controllers(), reason="no writable cgroup controller here")


@needs_cgroup
def test_cgroups_of_a_killed_creator_are_removed_by_its_guardian():
    ctrl = hwtopo.cgroup_controllers()
    limits = {"quota_cores": 0.5} if "cpu" in ctrl else {}
    if "cpuset" in ctrl:
        limits["cpus"] = sorted(os.sched_getaffinity(0))[:1]
    if "memory" in ctrl:
        limits["memory_bytes"] = 256 << 20
    creator, (target,) = _creator(
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        f"g = hwtopo.CGroup('killed', account=True, **{limits!r})\n"
        "g.add(p.pid)\n"
        "t = hwtopo.throttle(None, 0.5) if hwtopo.cgroup_available() else None\n"
        "print(p.pid, flush=True)"
    )
    target = int(target)
    try:
        made = _groups(creator.pid)
        assert made and len(_guardians(creator.pid)) == 1
        creator.kill()
        creator.wait()
        _wait(lambda: not _groups(creator.pid), "free of the creator's cgroups")  # nobody else swept them
        _wait(lambda: not _guardians(creator.pid), "free of the guardian")
        assert _state(target) in ("S", "R")  # its process runs on, unconstrained
    finally:
        _end(creator, target)


@needs_cgroup
def test_groups_left_when_the_guardian_died_too_are_swept_at_the_next_creation():
    creator, (target,) = _creator(
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        "g = hwtopo.CGroup('orphan', account=True)\n"
        "g.add(p.pid)\n"
        "print(p.pid, flush=True)"
    )
    target = int(target)
    try:
        made = _groups(creator.pid)
        assert made
        _kill(*_guardians(creator.pid))
        _wait(lambda: not _guardians(creator.pid), "free of the guardian")
        creator.kill()
        creator.wait()
        assert _groups(creator.pid) == made  # nothing removed them yet
        removed = hwtopo.cleanup_stale()
        assert {os.path.basename(g) for g in made} <= set(removed)
        assert not _groups(creator.pid)
        assert _state(target) in ("S", "R")
    finally:
        _end(creator, target)
