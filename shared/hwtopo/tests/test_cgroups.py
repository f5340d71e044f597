"""The one cgroup layer: settings per controller and version, processes in, usage out, removal."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hwtopo
from hwtopo import cgroups

needs = {
    c: pytest.mark.skipif(c not in hwtopo.cgroup_controllers(), reason=f"no writable cgroup {c} controller here")
    for c in ("cpu", "cpuacct", "cpuset", "memory", "pids", "freezer")
}


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _mine() -> set[str]:
    """This process's group directories in every hierarchy."""
    prefix = f"{cgroups.PREFIX}{os.getpid()}-"
    return {str(p) for h in cgroups._hierarchies() for p in h.root.glob(f"{prefix}*")}


@needs["cpu"]
def test_cpu_quota_and_shares_written_for_the_hierarchy_version():
    with hwtopo.CGroup("q", quota_cores=0.25, period_s=0.01, shares=2048) as g:
        path = g.paths["cpu"]
        assert path.name == g.name and g.name.endswith("-q") and not g.missing
        if g.version("cpu") == 1:
            assert int((path / "cpu.cfs_period_us").read_text()) == 10_000
            assert int((path / "cpu.cfs_quota_us").read_text()) == 2_500
            assert int((path / "cpu.shares").read_text()) == 2048
        else:
            assert (path / "cpu.max").read_text().split() == ["2500", "10000"]
            assert int((path / "cpu.weight").read_text()) == 200
    assert not path.exists()


@needs["cpuset"]
def test_cpuset_holds_a_process_on_its_cpus():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    p = _sleeper()
    try:
        with hwtopo.CGroup("pin", cpus=[cpu]) as g:
            g.add(p.pid)
            assert g.pids() == [p.pid]
            assert os.sched_getaffinity(p.pid) == {cpu}
            assert f":{'/' + g.name}" in open(f"/proc/{p.pid}/cgroup").read()
        # removal moves the process back to the root: it keeps running on every CPU
        assert p.poll() is None and os.sched_getaffinity(p.pid) == os.sched_getaffinity(0)
    finally:
        p.kill()
        p.wait()


def _run_in(g, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new process that joins ``g`` before it starts."""
    return subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: g.add(os.getpid()),
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs["memory"]
def test_memory_limit_and_peak_usage():
    with hwtopo.CGroup("mem", memory_bytes=256 << 20, account=True) as g:
        v1 = g.version("memory") == 1
        limit = (g.paths["memory"] / ("memory.limit_in_bytes" if v1 else "memory.max")).read_text()
        assert int(limit) == 256 << 20
        out = _run_in(g, "b = bytearray(48 << 20); print(len(b))")
        assert out.returncode == 0 and out.stdout.strip() == str(48 << 20), out.stderr
        peak = g.usage().memory_peak_bytes
        if peak is None:
            pytest.skip("this kernel's cgroup v2 has no memory.peak")
        assert peak >= 48 << 20


@needs["cpuacct"]
def test_usage_counts_the_cpu_time_of_the_groups_processes():
    with hwtopo.CGroup("acct", account=True) as g:
        assert g.usage().cpu_s == pytest.approx(0.0, abs=0.01)
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(time.process_time())"
        used = float(_run_in(g, burn).stdout)
        assert g.usage().cpu_s >= used * 0.9  # the interpreter's start-up is charged too


def test_missing_controllers_are_listed_or_raise(monkeypatch):
    monkeypatch.setattr(cgroups, "_hierarchies", lambda mounts=None: [])
    g = hwtopo.CGroup("none", cpus=[0], quota_cores=0.5, memory_bytes=1 << 30)
    assert g.missing == {"cpu", "cpuset", "memory"} and g.paths == {}
    g.add(os.getpid())  # nothing to join: a no-op
    assert g.usage() == hwtopo.CGroupUsage(None, None, None)
    g.close()
    with pytest.raises(RuntimeError, match="no writable cgroup cpu, cpuset controller"):
        hwtopo.CGroup(cpus=[0], quota_cores=0.5, strict=True)
    assert not hwtopo.cgroup_available()


@needs["cpuset"]
def test_a_refused_setting_is_missing_not_fatal():
    before = _mine()
    g = hwtopo.CGroup("bad", cpus=[60000])  # no such CPU: the kernel refuses it
    assert g.missing == {"cpuset"} and "cpuset" not in g.paths
    g.close()
    with pytest.raises(OSError):
        hwtopo.CGroup("bad", cpus=[60000], strict=True)
    assert _mine() == before


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"quota_cores": 0}, "quota_cores"),
        ({"quota_cores": float("nan")}, "quota_cores"),
        ({"shares": 1}, "shares"),
        ({"cpus": []}, "cpus"),
        ({"cpus": [-1]}, "cpus"),
        ({"mems": [True]}, "mems"),
        ({"memory_bytes": 100}, "memory_bytes"),
        ({"pids_max": 0}, "pids_max"),
        ({"pids_max": True}, "pids_max"),
        ({"parent": "hwtopo-1-2"}, "parent"),
        ({"period_s": 5.0}, "period_s"),
        ({"label": "a/b"}, "label"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        hwtopo.CGroup(**kwargs)


def test_mounts_are_read_for_v1_and_v2(tmp_path):
    for d in ("cpu,cpuacct", "cpuset", "unified", "my dir"):
        (tmp_path / d).mkdir()
    (tmp_path / "unified" / "cgroup.subtree_control").write_text("cpu memory io pids\n")
    (tmp_path / "my dir" / "cgroup.subtree_control").write_text("")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        f"cgroup {tmp_path}/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"
        f"cgroup {tmp_path}/cpuset cgroup rw,cpuset 0 0\n"
        f"cgroup {tmp_path}/nope cgroup rw,freezer 0 0\n"
        f"cgroup2 {tmp_path}/unified cgroup2 rw 0 0\n"
        f"cgroup2 {tmp_path}/my\\040dir cgroup2 rw 0 0\n"
        "proc /proc proc rw 0 0\n"
    )
    found = cgroups._hierarchies(mounts)
    assert [(h.root.name, h.version, sorted(h.controllers)) for h in found] == [
        ("cpu,cpuacct", 1, ["cpu", "cpuacct"]),
        ("cpuset", 1, ["cpuset"]),
        ("unified", 2, ["cpu", "cpuacct", "freezer", "memory", "pids"]),
        ("my dir", 2, ["cpuacct", "freezer"]),
    ]
    serving = cgroups._serving(found)
    assert serving["cpu"].version == 1 and serving["memory"].version == 2


def test_pid_alive_treats_a_zombie_as_dead():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while cgroups._proc_state(p.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cgroups._proc_state(p.pid) == "Z"  # exited, not yet reaped
    assert not hwtopo.pid_alive(p.pid)
    p.wait()
    assert hwtopo.pid_alive(os.getpid())


@needs["cpu"]
def test_a_forked_child_leaves_its_parents_groups_alone():
    code = (
        "import os, sys, hwtopo\n"
        "g = hwtopo.CGroup('parent', quota_cores=0.5)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # a normal exit: the child runs its atexit handlers\n"
        "os.waitpid(pid, 0)\n"
        "print(g.paths['cpu'].exists(), flush=True)\n"
        "g.close()\n"
        "print(g.paths['cpu'].exists())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stderr


@needs["cpu"]
def test_a_group_named_for_this_pid_but_not_held_is_stale():
    # left by an earlier process that had this pid; the live group of this process stays
    with hwtopo.CGroup("live", quota_cores=0.5) as g:
        root = g.paths["cpu"].parent
        old = root / f"{cgroups.PREFIX}{os.getpid()}-999999-earlier"
        old.mkdir()
        try:
            assert old.name in hwtopo.cleanup_stale()
            assert not old.exists() and g.paths["cpu"].exists()
        finally:
            if old.exists():
                old.rmdir()


# a process that forks a child which leaves the session (``setsid``), then forks until refused
_SCATTER = r"""
import os, sys, time
leader = os.fork()
if leader == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
os.waitpid(leader, 0)  # reaped: only its orphaned child stays, so the group's count is exact
kids = 0
for _ in range(int(sys.argv[1])):
    try:
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        kids += 1
    except OSError:
        break
print(kids, flush=True)
time.sleep(300)
"""


def _scatter(g, forks: int) -> subprocess.Popen:
    """_SCATTER in group ``g`` (joined before it starts); it prints how many children it forked."""
    return subprocess.Popen(
        [sys.executable, "-c", _SCATTER, str(forks)],
        preexec_fn=lambda: g.add(os.getpid()),
        stdout=subprocess.PIPE,
        text=True,
    )


def _killable_hierarchies() -> list:
    """Each writable hierarchy that can kill a group (v1 freezer, v2 cgroup.kill or cgroup.freeze)."""
    return [h for h in cgroups._hierarchies() if "freezer" in h.controllers]


@pytest.mark.parametrize("version", [1, 2])
def test_kill_ends_every_process_of_the_group_even_those_that_left_the_session(version, monkeypatch):
    found = [h for h in _killable_hierarchies() if h.version == version]
    if not found:
        pytest.skip(f"no writable cgroup v{version} hierarchy that can kill a group here")
    monkeypatch.setattr(cgroups, "_hierarchies", lambda mounts=None: found[:1])
    g = hwtopo.CGroup("kill", killable=True, strict=True)
    p = _scatter(g, 6)
    try:
        assert p.stdout.readline().strip() == "6"
        members = g.pids()
        assert p.pid in members and len(members) == 1 + 1 + 6  # the setsid grandchild too
        assert g.kill() is True
        assert not g.alive()
        assert not [m for m in members if hwtopo.pid_alive(m)]
    finally:
        p.kill()
        p.wait()
        g.close()
    assert not g.paths["freezer"].exists()


@needs["pids"]
def test_pids_max_stops_a_fork_bomb():
    with hwtopo.CGroup("bomb", pids_max=8, killable=True) as g:
        assert int((g.paths["pids"] / "pids.max").read_text()) == 8
        p = _scatter(g, 1000)
        try:
            kids = int(p.stdout.readline())
            # the group holds at most 8: the parent, the setsid pair (one may have exited), the rest
            assert kids <= 8 - 2
            assert len(g.pids()) <= 8
            if "freezer" in g.paths:
                assert g.kill() and not g.alive()
        finally:
            p.kill()
            p.wait()


@needs["memory"]
def test_a_nested_group_sits_inside_its_parent_and_goes_with_it():
    outer = hwtopo.CGroup("class", memory_bytes=512 << 20, account=True)
    inner = hwtopo.CGroup("tool", memory_bytes=128 << 20, pids_max=16, parent=outer)
    try:
        m = inner.paths["memory"]
        assert m.parent == outer.paths["memory"] and not inner.missing
        v1 = inner.version("memory") == 1
        assert int((m / ("memory.limit_in_bytes" if v1 else "memory.max")).read_text()) == 128 << 20
        p = _sleeper()
        try:
            inner.add(p.pid)
            cg = open(f"/proc/{p.pid}/cgroup").read()
            assert f"/{outer.name}/{inner.name}\n" in cg
            if "cpuacct" in outer.paths and "cpuacct" not in inner.paths:  # joins the parent where it has no dir
                assert p.pid in outer.pids()
        finally:
            p.kill()
            p.wait()
    finally:
        outer.close()  # takes the nested group with it
    assert not m.exists() and not outer.paths["memory"].exists()
    inner.close()


def test_a_v2_group_is_killed_with_the_groups_nested_in_it(monkeypatch):
    found = [h for h in _killable_hierarchies() if h.version == 2]
    if not found:
        pytest.skip("no writable cgroup v2 hierarchy here")
    monkeypatch.setattr(cgroups, "_hierarchies", lambda mounts=None: found[:1])
    outer = hwtopo.CGroup("outer", killable=True, strict=True)
    inner = hwtopo.CGroup("inner", killable=True, parent=outer, strict=True)
    p = _scatter(inner, 3)
    try:
        assert inner.paths["freezer"].parent == outer.paths["freezer"]
        assert p.stdout.readline().strip() == "3"
        assert p.pid in inner.pids() and p.pid in outer.pids()  # held by both
        assert outer.kill() is True  # cgroup.kill reaches the groups inside
        assert not inner.alive()
    finally:
        p.kill()
        p.wait()
        outer.close()
    assert not inner.paths["freezer"].exists() and not outer.paths["freezer"].exists()


def test_cpu_group_of_reads_the_v1_cpu_line_of_proc_cgroup():
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [ln.split(":", 2) for ln in lines if "cpu" in ln.split(":", 2)[1].split(",")]
    got = hwtopo.cgroups.cpu_group_of(os.getpid())
    assert got == ((frozenset(v1[0][1].split(",")), v1[0][2]) if v1 else None)
    assert hwtopo.cgroups.cpu_group_of(2**22 + 1) is None  # above pid_max: no such process
