"""Compute dilation: behaviour through an injected clock and sleep (no timing thresholds)."""

import threading
import time

import pytest

import hwtopo


class FakeClocks:
    """Thread CPU clock and wall clock under test control; sleep advances only the wall clock."""

    def __init__(self, overshoot_s: float = 0.0):
        self.cpu = 0.0
        self.wall_t = 0.0
        self.overshoot_s = overshoot_s
        self.sleeps: list[float] = []

    def clock(self):
        return self.cpu

    def wall(self):
        return self.wall_t

    def sleep(self, s):
        self.sleeps.append(s)
        self.wall_t += s + self.overshoot_s

    def compute(self, s):
        self.cpu += s
        self.wall_t += s


def _dilation(speed, fake, **kw):
    kw.setdefault("runqueue", None)
    return hwtopo.Dilation(speed, clock=fake.clock, sleep=fake.sleep, wall=fake.wall, **kw)


@pytest.mark.parametrize("speed", [0.5, 0.25, 0.8])
def test_sleep_is_dilation_of_cpu_time(speed):
    fake = FakeClocks()
    d = _dilation(speed, fake)
    fake.compute(0.010)
    slept = d.sync_point()
    assert fake.sleeps == [pytest.approx(0.010 * (1 / speed - 1))]
    assert slept == pytest.approx(0.010 * (1 / speed - 1))
    fake.compute(0.004)
    d.sync_point()
    assert fake.sleeps[-1] == pytest.approx(0.004 * (1 / speed - 1))
    assert d.describe()["cpu_s"] == pytest.approx(0.014)
    assert d.describe()["method"] == "dilation" and d.describe()["emulated"] is True


def test_speed_one_never_sleeps():
    fake = FakeClocks()
    d = _dilation(1.0, fake)
    for _ in range(5):
        fake.compute(0.01)
        assert d.sync_point() == 0.0
    assert fake.sleeps == []


def test_blocked_time_is_not_dilated():
    fake = FakeClocks()
    d = _dilation(0.5, fake)
    fake.compute(0.002)
    fake.wall_t += 1.0  # waiting for a peer: wall time passes, no thread CPU
    d.sync_point()
    assert fake.sleeps == [pytest.approx(0.002)]


def test_small_debts_accumulate_until_worth_a_sleep():
    fake = FakeClocks()
    d = _dilation(0.5, fake, min_sleep_s=1e-4)
    for _ in range(4):
        fake.compute(2e-5)
        assert d.sync_point() == 0.0
    assert fake.sleeps == []
    fake.compute(5e-5)
    d.sync_point()
    assert fake.sleeps == [pytest.approx(1.3e-4)]


def test_overshoot_is_credited_but_capped():
    fake = FakeClocks(overshoot_s=2e-4)
    d = _dilation(0.5, fake, max_credit_s=1e-3)
    fake.compute(0.001)
    d.sync_point()  # owes 1 ms, sleeps 1.2 ms
    fake.compute(0.001)
    d.sync_point()
    assert fake.sleeps[1] == pytest.approx(0.001 - 2e-4)
    fake.overshoot_s = 0.5  # descheduled for half a second during the sleep
    fake.compute(0.001)
    d.sync_point()
    assert d.debt_s == pytest.approx(-1e-3)
    fake.overshoot_s = 0.0
    fake.compute(0.004)
    d.sync_point()  # the credit is at most 1 ms, not 0.5 s
    assert fake.sleeps[-1] == pytest.approx(0.004 - 0.001)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), "fast", None])
def test_bad_speed_names_the_field(bad):
    with pytest.raises(ValueError, match="speed"):
        hwtopo.Dilation(bad)
    with pytest.raises(ValueError, match="speed"):
        hwtopo.dilate(bad)
    assert hwtopo.current_dilation() is None


def test_process_wide_install_and_noop_without_one():
    assert hwtopo.current_dilation() is None
    assert hwtopo.sync_point() == 0.0
    fake = FakeClocks()
    with hwtopo.dilate(0.5, clock=fake.clock, sleep=fake.sleep, wall=fake.wall, runqueue=None) as d:
        assert hwtopo.current_dilation() is d
        fake.compute(0.01)
        assert hwtopo.sync_point() == pytest.approx(0.01)
    assert hwtopo.current_dilation() is None
    fake.compute(0.01)
    assert hwtopo.sync_point() == 0.0
    assert len(fake.sleeps) == 1


def test_replacing_and_undilate():
    a = hwtopo.dilate(0.5)
    b = hwtopo.dilate(0.25)
    assert hwtopo.current_dilation() is b and a.closed
    assert hwtopo.undilate() is b
    assert hwtopo.current_dilation() is None and hwtopo.undilate() is None


def test_other_threads_do_not_pay():
    fake = FakeClocks()
    d = hwtopo.dilate(0.5, clock=fake.clock, sleep=fake.sleep, wall=fake.wall, runqueue=None)
    try:
        fake.compute(0.01)
        out = []
        t = threading.Thread(target=lambda: out.append(hwtopo.sync_point()))
        t.start()
        t.join()
        assert out == [0.0] and fake.sleeps == []
        assert d.sync_point() == pytest.approx(0.01)
    finally:
        d.close()


def test_real_clock_dilates_a_busy_loop():
    """With the real clocks, the sleep asked for follows the thread's CPU use (no threshold on wall time)."""
    asked = []
    d = hwtopo.Dilation(0.5, sleep=lambda s: asked.append(s), runqueue=None)
    t0 = time.thread_time()
    x = 0
    while time.thread_time() - t0 < 0.02:
        x += 1
    d.sync_point()
    assert asked and asked[0] >= 0.02 * 0.5


def test_waiting_for_a_cpu_is_taken_off_the_debt():
    fake = FakeClocks()
    rq = [0.0]
    d = _dilation(0.5, fake, runqueue=lambda: rq[0], max_credit_s=0.002)
    fake.compute(0.010)
    rq[0] += 0.003  # runnable but another process held the core for 3 ms
    d.sync_point()
    assert fake.sleeps == [pytest.approx(0.007)]
    assert d.describe()["runqueue_wait_s"] == pytest.approx(0.003)
    fake.compute(0.001)
    rq[0] += 0.010  # more contention than the debt: a capped credit, no sleep
    assert d.sync_point() == 0.0 and d.debt_s == pytest.approx(-0.002)


def test_cpu_wait_inside_the_blocking_call_is_not_credited():
    fake = FakeClocks()
    rq = [0.0]
    d = _dilation(0.5, fake, runqueue=lambda: rq[0])
    fake.compute(0.010)
    d.sync_point()  # pays 10 ms
    rq[0] += 0.004  # woken inside the collective, waited 4 ms for the core: part of the wait
    d.resume()
    fake.compute(0.010)
    d.sync_point()
    assert fake.sleeps == [pytest.approx(0.010), pytest.approx(0.010)]
    assert d.describe()["runqueue_wait_s"] == pytest.approx(0.0)


def test_module_resume_point_is_a_no_op_without_a_dilation():
    hwtopo.undilate()
    assert hwtopo.resume_point() is None


def test_schedstat_reader_reads_the_runqueue_field(tmp_path):
    f = tmp_path / "schedstat"
    f.write_text("5000000 2500000000 7\n")
    read = hwtopo.emulate._schedstat_reader(str(f))
    assert read() == pytest.approx(2.5)
    f.write_text("6000000 3000000000 8\n")
    assert read() == pytest.approx(3.0)  # read again, not cached
    read.close()
    read.close()  # closing twice is harmless


def test_schedstat_reader_unavailable_when_missing_or_switched_off(tmp_path):
    assert hwtopo.emulate._schedstat_reader(str(tmp_path / "absent")) is None
    off = tmp_path / "off"
    off.write_text("0 0 0\n")  # scheduler statistics compiled in but disabled
    assert hwtopo.emulate._schedstat_reader(str(off)) is None
    bad = tmp_path / "bad"
    bad.write_text("garbage\n")
    assert hwtopo.emulate._schedstat_reader(str(bad)) is None


def test_default_reader_follows_this_thread_where_available():
    d = hwtopo.Dilation(0.5, sleep=lambda s: None)
    try:
        d.sync_point()
        wait = d.describe()["runqueue_wait_s"]
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        try:
            fields = open(path).read().split()
        except OSError:
            fields = ["0"]
        if int(fields[0]) == 0:
            assert wait is None
        else:
            assert wait is not None and 0.0 <= wait <= int(fields[1]) * 1e-9
    finally:
        d.close()
    d.close()  # idempotent


def test_a_forked_child_is_not_dilated():
    import os

    fake = FakeClocks()
    hwtopo.dilate(0.5, clock=fake.clock, sleep=fake.sleep, wall=fake.wall, runqueue=None)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the parent's dilation must not act here
            try:
                fake.compute(0.010)
                ok = hwtopo.sync_point() == 0.0 and fake.sleeps == []
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == b"1"
        fake.compute(0.010)
        assert hwtopo.sync_point() == pytest.approx(0.010)  # the parent still is
    finally:
        hwtopo.undilate()


@pytest.mark.parametrize("field", ["min_sleep_s", "max_credit_s"])
@pytest.mark.parametrize("value", ["x", -1.0, float("nan"), None])
def test_bad_seconds_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        hwtopo.Dilation(0.5, runqueue=None, **{field: value})
