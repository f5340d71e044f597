"""agentdyn's CPU groups on hwtopo's cgroup layer: placement, fallbacks, accounting, nothing left behind."""

import os
import subprocess
import sys
import time

import pytest

import hwtopo
from agentdyn.cgroups import CpuGroup, cleanup_stale, cpu_writable, cpuset_writable
from hwtopo import cgroups as hw_cgroups

SLEEPER = "import time; time.sleep(120)"


def _groups(creator: int) -> set[str]:
    prefix = f"{hw_cgroups.PREFIX}{creator}-"
    return {str(p) for h in hw_cgroups._hierarchies() for p in h.root.glob(f"{prefix}*")}


def _wait(condition, what: str, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {deadline_s:g} s"
        time.sleep(0.01)


@pytest.mark.skipif(not (cpuset_writable() and cpu_writable()), reason="needs writable cgroup cpuset and cpu")
def test_group_places_a_process_and_accounts_its_cpu():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    g = CpuGroup("coding", cpus=[cpu], quota_cores=1.0, shares=2048, threads=1)
    try:
        assert [m.rsplit("-", 1)[1] for m in g.methods] == ["cpuset", "cpu"] and g.methods[0].startswith("cgroup-v")
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint(time.process_time())"
        out = subprocess.run(
            [sys.executable, "-c", burn],
            preexec_fn=lambda: g.add(os.getpid()),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert g.usage().cpu_s >= float(out.stdout) * 0.9
        p = subprocess.Popen([sys.executable, "-c", SLEEPER])
        try:
            g.add(p.pid)
            assert os.sched_getaffinity(p.pid) == {cpu}
            assert "agentdyn-coding" in open(f"/proc/{p.pid}/cgroup").read()
        finally:
            p.kill()
            p.wait()
    finally:
        g.close()
    assert not any(path.exists() for path in g.cgroup.paths.values())


def test_without_cgroups_cores_use_affinity_and_quota_a_throttle(monkeypatch):
    monkeypatch.setattr(hw_cgroups, "_hierarchies", lambda mounts=None: [])
    cpu = sorted(os.sched_getaffinity(0))[0]
    g = CpuGroup("io", cpus=[cpu], quota_cores=0.5, shares=1024)
    assert g.methods == ["affinity", "hwtopo-throttle"]
    p = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        g.add(p.pid)
        assert os.sched_getaffinity(p.pid) == {cpu}
        assert [t.method for t in g._throttles] == ["duty-cycle"]
    finally:
        g.close()
        p.kill()
        p.wait()
    assert all(t.closed for t in g._throttles)


@pytest.mark.skipif(not cpuset_writable(), reason="needs a writable cgroup cpuset")
def test_groups_of_a_killed_run_are_removed():
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = (
        "import sys, time\n"
        "from agentdyn.cgroups import CpuGroup\n"
        f"g = CpuGroup('web', cpus=[{cpu}], quota_cores=0.5)\n"
        "print(g.cgroup.name, flush=True)\n"
        "time.sleep(120)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = run.stdout.readline().strip()
        assert name.endswith("-agentdyn-web") and _groups(run.pid)
        run.kill()
        run.wait()
        _wait(lambda: not _groups(run.pid), "free of the killed run's groups")  # hwtopo's guardian
    finally:
        run.kill()
        run.wait()
        run.stdout.close()


@pytest.mark.skipif(not cpuset_writable(), reason="needs a writable cgroup cpuset")
def test_stale_groups_of_dead_creators_are_removed():
    p = subprocess.Popen(["true"])
    p.wait()  # a pid that is now dead
    root = hw_cgroups._serving(hw_cgroups._hierarchies())["cpuset"].root
    stale = root / f"{hw_cgroups.PREFIX}{p.pid}-1-agentdyn-test"
    stale.mkdir()
    try:
        assert stale.name in cleanup_stale()
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


def test_labels_are_made_safe_for_cgroup_names(monkeypatch):
    monkeypatch.setattr(hw_cgroups, "_hierarchies", lambda mounts=None: [])
    g = CpuGroup("own cores/2", cpus=[0])
    assert g.cgroup.name.endswith("-agentdyn-own_cores_2")
    assert hwtopo.CGroupUsage(None, None, None) == g.usage()
    g.close()


def _cgroup_of(pid: int, controller: str) -> str:
    for line in open(f"/proc/{pid}/cgroup").read().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    return ""


@pytest.mark.skipif(not cpu_writable(), reason="needs a writable cgroup cpu controller")
def test_process_weight_moves_only_the_cpu_membership_and_back():
    from agentdyn.cgroups import ProcessWeight

    p = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        before = {c: _cgroup_of(p.pid, c) for c in ("cpu", "memory", "pids")}
        w = ProcessWeight(65536, pid=p.pid)
        if not w.apply():  # cgroup v2, or cpu co-mounted with more: nothing may move
            assert w.reason and {c: _cgroup_of(p.pid, c) for c in before} == before
            return
        try:
            assert _cgroup_of(p.pid, "cpu").endswith(f"agentdyn-runtime-{p.pid}")
            assert (w.group.paths["cpu"] / "cpu.shares").read_text().strip() == "65536"
            assert {c: _cgroup_of(p.pid, c) for c in ("memory", "pids")} == {c: before[c] for c in ("memory", "pids")}
        finally:
            w.restore()
        assert {c: _cgroup_of(p.pid, c) for c in before} == before
        assert not w.group and not w.apply()  # once restored, never applied again
    finally:
        p.kill()
        p.wait()


def test_process_weight_stands_down_without_a_v1_cpu_hierarchy(monkeypatch):
    from agentdyn import cgroups

    monkeypatch.setattr(cgroups, "_cpu_membership", lambda pid: None)
    w = cgroups.ProcessWeight(4096)
    assert not w.apply() and "v2" in w.reason and w.group is None
    assert w.describe() == {"shares": 4096, "applied": False, "reason": w.reason}
