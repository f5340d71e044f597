import json

import pytest

import hwtopo
from geomesh import WanEmulator, ring_wire_bytes
from geomesh.cli import main


def test_ring_wire_bytes():
    assert ring_wire_bytes("all_gather", 100, 3) == 200
    assert ring_wire_bytes("all_reduce", 300, 3) == pytest.approx(400)
    assert ring_wire_bytes("all_reduce", 300, 1) == 0
    with pytest.raises(ValueError, match="kind"):
        ring_wire_bytes("scatter", 1, 2)


def test_wan_emulator_times_follow_the_slowest_ring_link():
    c = hwtopo.load("geo-3region")
    wan = WanEmulator(c, c.names)
    assert wan.describe()["emulated"] is True
    nbytes = 3_000_000
    t = wan.collective_time_s("all_gather", nbytes)
    # 2 ring steps; the slowest link is us-east<->ap-south (24 Mbps = 3 MB/s, 90 ms)
    slow = c.link("use-a100", "aps-t4")
    expected = 2 * nbytes / slow.bandwidth_bytes_per_s + 2 * slow.latency_s
    assert t == pytest.approx(expected, rel=0.05)
    # back to back on the same links, a second transfer queues behind the first (token bucket debt)
    assert wan.collective_time_s("all_gather", nbytes) > 1.5 * t
    ar = WanEmulator(c, c.names).collective_time_s("all_reduce", nbytes)
    assert ar == pytest.approx(4 * (nbytes / 3) / slow.bandwidth_bytes_per_s + 4 * slow.latency_s, rel=0.05)
    with pytest.raises(ValueError, match=r"machines\[1\]"):
        WanEmulator(c, ["use-a100", "nowhere"])


def test_cli_usage_errors_exit_2(capsys, tmp_path):
    assert main(["bench", "--quick", "--outer-steps", "0"]) == 2
    assert "--outer-steps" in capsys.readouterr().err
    assert main(["bench", "--quick", "--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["bench", "--quick", "--methods", "geomesh,sgd"]) == 2
    assert "methods" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"machines": [{"name": "a", "speed": -1}]}))
    assert main(["bench", "--quick", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "speed" in err and "Traceback" not in err
    assert main(["bench", "--quick", "--cluster", "no-such-spec"]) == 2
    assert "--cluster" in capsys.readouterr().err
    assert main(["bench", "--nope"]) == 2


def test_cli_plan_table(capsys):
    assert main(["plan", "--cluster", "geo-3region", "--tokens-per-s", "10000", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    for name in ("use-a100", "euw-v100", "aps-t4"):
        assert name in out
    assert main(["plan", "--cluster", "geo-3region", "--memory-per-sample", "20GiB"]) == 2
    assert "batch 1" in capsys.readouterr().err
    assert main(["plan", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    # numbers beyond any real run are usage errors, not absurd plans
    for flag, value in [
        ("--target-tokens", "1e30"),
        ("--target-tokens", str(10**13)),
        ("--tokens-per-s", "inf"),
        ("--seq-len", "0"),
        ("--fixed-memory", "1e400GiB"),
        ("--memory-per-sample", "-1MiB"),
    ]:
        assert main(["plan", flag, value]) == 2, (flag, value)
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err


def test_output_paths_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    import geomesh.cli as cli

    def started(*args, **kwargs):
        raise AssertionError("the bench started before the output path was checked")

    monkeypatch.setattr(cli, "_bench", started)
    assert main(["bench", "--quick", "--json", str(tmp_path / "no" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "a" / "b")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main(["--version"]) == 0
    assert f"geomesh {__import__('geomesh').__version__}" in capsys.readouterr().out


def test_init_from_env_without_torchrun_is_a_clear_error(monkeypatch):
    from geomesh import GeoMeshError, init_from_env

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(GeoMeshError, match="MASTER_ADDR"):
        init_from_env()


def test_unexpected_error_is_one_line_exit_1(monkeypatch, capsys):
    import geomesh.cli as cli

    def boom(args):
        raise KeyError("use-a100")

    monkeypatch.setattr(cli, "cmd_plan", boom)
    assert cli.main(["plan"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "geomesh: error: KeyError: 'use-a100'"
