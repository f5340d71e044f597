import os
import signal
import subprocess
import sys
import time
import types

import pytest

import hwtopo
from hwtopo import cgroups, emulate


def _groups():
    return sorted({p.name for h in cgroups._hierarchies() for p in h.root.glob(f"{cgroups.PREFIX}*")})


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


needs_cgroup = pytest.mark.skipif(not hwtopo.cgroup_available(), reason="no writable cgroup cpu controller")


@needs_cgroup
def test_cgroup_throttle_sets_quota_and_cleans_up():
    before = _groups()
    p = _sleeper()
    try:
        with hwtopo.throttle(p.pid, speed=0.25, cpus=2) as t:
            assert t.method.startswith("cgroup")
            assert t.describe()["emulated"] is True
            assert str(p.pid) in (t.group / "cgroup.procs").read_text().split()
            if t.method == "cgroup-v1":
                assert int((t.group / "cpu.cfs_quota_us").read_text()) == 50_000
        assert not t.group.exists()
        assert _groups() == before
    finally:
        p.kill()
        p.wait()


@needs_cgroup
def test_cgroup_period_option():
    p = _sleeper()
    try:
        with hwtopo.throttle(p.pid, speed=0.5, period_s=0.01) as t:
            if t.method == "cgroup-v1":
                assert int((t.group / "cpu.cfs_period_us").read_text()) == 10_000
                assert int((t.group / "cpu.cfs_quota_us").read_text()) == 5_000
    finally:
        p.kill()
        p.wait()
    with pytest.raises(ValueError, match="period_s"):
        hwtopo.throttle(os.getpid(), speed=0.5, period_s=5)


@needs_cgroup
def test_cgroup_removed_after_killed_worker():
    before = _groups()
    p = _sleeper()
    t = hwtopo.throttle(p.pid, speed=0.5)
    p.kill()
    p.wait()
    t.close()
    assert _groups() == before


@needs_cgroup
def test_stale_cgroup_of_crashed_creator_is_cleaned():
    # a creator process that throttles a sleeper and is then SIGKILLed leaves its group behind
    code = (
        "import subprocess, sys, time, hwtopo\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "t = hwtopo.throttle(p.pid, 0.5)\n"
        "print(t.group.name, p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name, sleeper = creator.stdout.readline().split()
    try:
        assert name in _groups()
        creator.send_signal(signal.SIGKILL)
        creator.wait()
        # its guardian removes the group; cleanup_stale() is the sweep for when the guardian died too
        deadline = time.monotonic() + 30
        while name in _groups() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert name not in _groups()
    finally:
        os.kill(int(sleeper), signal.SIGKILL)
        creator.stdout.close()


def test_duty_cycle_throttle_stops_and_resumes():
    p = _sleeper()
    try:
        t = hwtopo.throttle(p.pid, speed=0.5, method="duty-cycle", period_s=0.02)
        assert t.method == "duty-cycle"
        t.close()
        assert t._watchdog.poll() is not None  # watchdog gone
        # the process is left running (not stopped)
        state = open(f"/proc/{p.pid}/stat").read().split(")")[1].split()[0]
        assert state in ("S", "R")
    finally:
        p.kill()
        p.wait()


def test_throttle_bad_arguments():
    with pytest.raises(ValueError, match="speed"):
        hwtopo.throttle(os.getpid(), speed=0)
    with pytest.raises(ValueError, match="method"):
        hwtopo.throttle(os.getpid(), speed=0.5, method="magic")
    assert hwtopo.throttle(os.getpid(), speed=1.0).method == "none"


class _Clock:
    """A monotonic clock that moves only when told (the bucket's refill then follows exactly)."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_token_bucket_accounting(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(emulate, "time", types.SimpleNamespace(monotonic=clock))  # emulate's clock only
    b = hwtopo.TokenBucket(1000.0, burst_bytes=100)
    assert b.reserve(100) == 0.0
    assert b.reserve(500) == pytest.approx(0.5)  # 500 bytes of debt at 1000 B/s
    clock.t += 0.2  # 200 bytes refilled
    assert b.reserve(0) == pytest.approx(0.3)
    clock.t += 10.0  # refill stops at the burst
    assert b.reserve(150) == pytest.approx(0.05)


def test_link_shaper_delay_and_label(monkeypatch):
    monkeypatch.setattr(emulate, "time", types.SimpleNamespace(monotonic=_Clock()))
    link = hwtopo.Link("a", "b", bandwidth_bytes_per_s=1e6, latency_s=0.03)
    s = hwtopo.LinkShaper(link)
    d1 = s.delay_s(s.bucket.burst)  # within the burst: latency only
    assert d1 == pytest.approx(0.03)
    d2 = s.delay_s(2e6)
    assert d2 == pytest.approx(0.03 + 2.0)
    assert s.bytes_sent == int(s.bucket.burst) + 2_000_000
    assert s.describe()["emulated"] is True


def test_shaped_writer_passes_bytes_through():
    import io

    sink = io.BytesIO()
    s = hwtopo.LinkShaper(bandwidth_bytes_per_s=1e9, latency_s=0.0)
    w = hwtopo.ShapedWriter(sink, s, chunk=7)
    data = os.urandom(100)
    assert w.write(data) == 100 and sink.getvalue() == data
    assert s.bytes_sent == 100


def test_throttle_self_then_exit_cleans_group():
    # a process that throttles itself and exits normally removes its group at exit
    code = "import hwtopo, os; t = hwtopo.throttle(None, 0.5); print(t.method, t.group and t.group.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    method, name = out.stdout.split()
    assert method.startswith("cgroup") == hwtopo.cgroup_available()
    assert name not in _groups()
