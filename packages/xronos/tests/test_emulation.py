"""The emulation modes: dilation installed per rank and paid at every synchronisation point."""

import time

import pytest

import hwtopo
from xronos.cli import main
from xronos.launch import emulate_speed, emulation_label, spawn


def test_emulate_speed_modes_and_labels():
    assert emulate_speed(1.0, "dilate") is None and emulate_speed(1.0, "cgroup") is None
    d = emulate_speed(0.5, "dilate")
    try:
        assert hwtopo.current_dilation() is d and d.speed == 0.5
    finally:
        d.close()
    assert hwtopo.current_dilation() is None
    assert emulation_label("dilate") == "dilation" and emulation_label("cgroup") == "cgroup"
    with pytest.raises(ValueError, match="emulate"):
        emulate_speed(0.5, "slow")
    with pytest.raises(ValueError, match="emulate"):
        spawn(print, 1, emulate="slow")


def test_profile_timing_pays_the_dilation_inside_the_timed_region(monkeypatch):
    import types

    import xronos.profile as prof

    events, clock = [], [0.0]

    def perf_counter():
        events.append("clock")
        clock[0] += 0.01
        return clock[0]

    monkeypatch.setattr(prof, "sync_point", lambda: events.append("sync"))
    monkeypatch.setattr(prof, "time", types.SimpleNamespace(perf_counter=perf_counter))
    prof.time_call(lambda: events.append("fn"), min_time_s=0.001, repeats=2)
    timed = 0
    last_clock = -1
    for i, e in enumerate(events):
        if e != "clock":
            continue
        if "fn" in events[last_clock + 1 : i]:  # this read closes a region that ran fn
            assert events[i - 1] == "sync", events  # the dilation is paid before the clock stops
            timed += 1
        last_clock = i
    assert timed >= 2


def test_every_rank_pays_its_dilation_at_collectives_and_transfers():
    res = spawn(_helper(), 2, speeds=[1.0, 0.5], timeout_s=120, emulate="dilate")
    assert res[0] is None  # speed 1.0: nothing installed
    d = res[1]
    assert d["method"] == "dilation" and d["speed"] == 0.5
    assert d["sync_points"] >= 4  # three all-reduces and a receive
    assert d["cpu_s"] > 0
    # every second of compute owes (1/speed - 1) s, paid by sleeping or by waiting for a core: under load
    # the waits alone can pay a small debt, so what holds is the sum (less than one unpaid minimum sleep)
    owed = d["cpu_s"] * (1 / d["speed"] - 1)
    assert d["slept_s"] + (d["runqueue_wait_s"] or 0.0) > owed - 1e-4, d
    assert d["tp_forward_syncs"] == 1  # the row-parallel output all-reduce
    # the column-parallel input-gradient all-reduce in backward: paid before it starts, and again before
    # its wait for the weight-gradient GEMM that overlapped it
    assert d["tp_backward_syncs"] == 2


def _helper():
    from dist_helpers import dilation_at_syncs

    return dilation_at_syncs


def test_cli_rejects_an_unknown_emulation(capsys):
    assert main(["bench", "--quick", "--emulate", "slow"]) == 2
    assert "--emulate" in capsys.readouterr().err


def test_check_speeds_compares_each_rank_with_the_fastest_requested():
    from xronos.emulation import check_speeds

    # rank 1 asked 0.5 of rank 0 and got it (kernel twice as long); rank 2 asked 0.25, got 0.5
    res = check_speeds([1.0, 0.5, 0.25], [[1.0, 2.0, 2.0], [2.0, 4.1, 4.0], [1.0, 1.95, 2.0]])
    assert res["requested_relative_speeds"] == [1.0, 0.5, 0.25]
    assert res["achieved_relative_speeds"][1] == pytest.approx(0.5, rel=0.03)
    assert res["achieved_relative_speeds"][2] == pytest.approx(0.5)
    assert res["invalid_ranks"] == [2] and not res["valid"]
    assert check_speeds([1.0, 0.5], [[1.0, 2.1]])["valid"]  # 0.476: 4.8 % off, inside 10 %
    assert not check_speeds([1.0, 0.5], [[1.0, 2.3]])["valid"]  # 0.435: 13 % off
    with pytest.raises(ValueError, match="seconds"):
        check_speeds([1.0, 0.5], [[1.0]])
    with pytest.raises(ValueError, match="requested"):
        check_speeds([1.0, 0.0], [[1.0, 1.0]])


def test_a_mis_emulated_rank_makes_the_run_invalid():
    from dist_helpers import kernel_samples

    from xronos.bench import emulation_check
    from xronos.emulation import check_speeds

    # both ranks really run at full speed, but the run claims rank 1 is a 0.25x device
    samples = spawn(kernel_samples, 2, (3,), timeout_s=120)[0]
    res = check_speeds([1.0, 0.25], samples)
    assert not res["valid"] and res["invalid_ranks"] == [1]
    assert res["achieved_relative_speeds"][1] > 0.275  # measured, not the requested 0.25
    # the bench's verdict reads the same samples from the ranks' results
    results = [{"speed": 1.0, "kernel_s": samples}, {"speed": 0.25, "kernel_s": samples}]
    verdict = emulation_check(results, {})
    assert verdict["valid"] is False and "rank 1" in verdict["invalid_because"][0]


def test_the_bench_headline_carries_the_verdict_and_the_fast_alone_ratio():
    from xronos.bench import headline

    emulation = {"valid": False, "checks": {"kernel": {"achieved_relative_speeds": [1.0, 0.9]}}}
    emulation["checks"]["kernel"]["requested_relative_speeds"] = [1.0, 0.5]
    summary = {
        "reference": {"step_time_s": 2.0, "eval_loss": 4.0},
        "xronos": {"step_time_s": 1.5, "eval_loss": 4.0, "total_time_s": 10.0, "idle_ratio": 0.01},
        "emulation": emulation,
    }
    h = headline(summary)
    assert h["emulation_valid"] is False and h["achieved_relative_speeds"] == [1.0, 0.9]
    assert h["step_time_ratio_vs_fast_alone"] == pytest.approx(0.75)


def test_wall_clock_counts_cpu_waits_and_the_dilation_owes_for_them(tmp_path):
    from xronos.emulation import dilate_wall, wall_clock

    stat = tmp_path / "schedstat"
    stat.write_text("1000000000 500000000 10\n")  # 1 s on a CPU, 0.5 s waiting for one
    clock = wall_clock(str(stat))
    assert clock() == pytest.approx(1.5)
    stat.write_text("0 0 0\n")  # statistics off: the thread's CPU time alone
    assert wall_clock(str(stat)) is time.thread_time
    assert wall_clock(str(tmp_path / "missing")) is time.thread_time

    now = [0.0]
    d = dilate_wall(0.5, clock=lambda: now[0])
    try:
        assert hwtopo.current_dilation() is d
        now[0] += 0.004  # 2 ms of compute and 2 ms waiting for a CPU: all of it owed again at 0.5x
        assert d.sync_point() >= 0.004
        assert d.describe()["runqueue_wait_s"] is None  # no wait is taken off the debt
    finally:
        d.close()


def _quota_writable() -> bool:
    if not hwtopo.cgroup_available():
        return False
    try:
        hwtopo.CGroup(quota_cores=0.5, strict=True).close()
    except (OSError, RuntimeError):
        return False
    return True


@pytest.mark.skipif(not _quota_writable(), reason="no writable cgroup cpu controller (needs root, cgroup v1/v2 cpu)")
def test_cgroup_quota_path_gives_each_slow_rank_its_quota():
    from dist_helpers import own_quota

    from xronos.emulation import PRIORITY_SHARES, resolve_method

    assert resolve_method("auto") == "cgroup"
    groups = spawn(own_quota, 2, speeds=[1.0, 0.5], timeout_s=120, emulate="auto")
    # every rank in its own top-priority group: the fast one uncapped, the slow one at half a core
    assert groups[0] == {"quota_cores": None, "shares": PRIORITY_SHARES}
    assert groups[1] == {"quota_cores": pytest.approx(0.5), "shares": PRIORITY_SHARES}
    assert spawn(own_quota, 1, speeds=[1.0], timeout_s=60, emulate="cgroup") == [None]  # nothing to emulate
