"""The emulation modes: dilation installed per rank and paid at every synchronisation point."""

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
    assert d["tp_backward_syncs"] == 1  # the column-parallel input-gradient all-reduce, in backward


def _helper():
    from dist_helpers import dilation_at_syncs

    return dilation_at_syncs


def test_cli_rejects_an_unknown_emulation(capsys):
    assert main(["bench", "--quick", "--emulate", "slow"]) == 2
    assert "--emulate" in capsys.readouterr().err
