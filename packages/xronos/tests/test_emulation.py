"""The emulation modes: dilation installed per rank and paid at every synchronisation point."""

import pytest
import torch

import hwtopo
from xronos.cli import main
from xronos.launch import emulate_speed, emulation_label, spawn
from xronos.profile import time_call


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


def test_profile_timing_pays_the_dilation_inside_the_timed_region():
    asked = []
    with hwtopo.dilate(0.5, sleep=asked.append):
        x = torch.randn(64, 64)
        time_call(lambda: torch.tanh(x @ x), min_time_s=0.001, repeats=2)
    calls = len(asked)
    assert calls >= 3  # one per timed call (debts under 0.1 ms may be carried to the next)


def test_every_rank_pays_its_dilation_at_collectives_and_transfers():
    res = spawn(_helper(), 2, speeds=[1.0, 0.5], timeout_s=120, emulate="dilate")
    assert res[0] is None  # speed 1.0: nothing installed
    d = res[1]
    assert d["method"] == "dilation" and d["speed"] == 0.5
    assert d["sync_points"] >= 4  # three all-reduces and a receive
    assert d["slept_s"] > 0 and d["cpu_s"] > 0


def _helper():
    from dist_helpers import dilation_at_syncs

    return dilation_at_syncs


def test_cli_rejects_an_unknown_emulation(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--emulate", "slow"])
    assert e.value.code == 2 and "--emulate" in capsys.readouterr().err
