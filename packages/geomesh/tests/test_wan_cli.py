import json
from unittest.mock import Mock

import pytest

import hwtopo
from geomesh import WanEmulator, ring_wire_bytes
from geomesh.cli import main
from hwtopo.testing import assert_fails, run_cli


def test_ring_wire_bytes():
    assert ring_wire_bytes("all_gather", 100, 3) == 200
    assert ring_wire_bytes("all_reduce", 300, 3) == pytest.approx(400)
    assert ring_wire_bytes("all_reduce", 300, 1) == 0
    with pytest.raises(ValueError, match="kind"):
        ring_wire_bytes("scatter", 1, 2)


def test_every_collective_pays_the_same_latency_per_hop():
    from geomesh import collective_hops

    assert [collective_hops(k, 3) for k in ("all_gather", "all_reduce", "all_reduce_gather")] == [2, 4, 2]
    assert ring_wire_bytes("all_reduce_gather", 100, 3) == 200
    c = hwtopo.load("geo-3region")
    lat = WanEmulator(c, c.names, latency_only=True)
    slow = c.link("use-a100", "aps-t4").latency_s
    assert lat.collective_time_s("all_reduce", 10**6) == pytest.approx(4 * slow)
    assert lat.collective_time_s("all_reduce_gather", 10**6) == pytest.approx(2 * slow)
    assert lat.collective_time_s("all_gather", 10**6) == pytest.approx(2 * slow)


def test_best_all_reduce_trades_hops_against_bytes():
    c = hwtopo.load("geo-3region")
    wan = WanEmulator(c, c.names, latency_only=True)  # the choice still counts bandwidth (shaped by tbf)
    slow = c.link("use-a100", "aps-t4")
    # ring: 4 (lat + n/3/bw); gather: 2 (lat + n/bw); equal where n = 3 lat bw
    cross = 3 * slow.latency_s * slow.bandwidth_bytes_per_s
    assert wan.best_all_reduce(int(cross / 2)) == "all_reduce_gather"
    assert wan.best_all_reduce(int(cross * 2)) == "all_reduce"
    assert wan.model_time_s("all_reduce", 1000) == pytest.approx(4 * (slow.latency_s + 1000 / 3 / 3e6))
    # the model reserves nothing: asking twice gives the same answer
    assert wan.model_time_s("all_gather", 10**6) == wan.model_time_s("all_gather", 10**6)


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


# (argv with {tmp} for the test's directory, text the message must contain): each exits 2 before
# any work starts and creates nothing
BAD_INPUT = [
    ("bench --quick --outer-steps 0", "--outer-steps"),
    ("bench --quick --seeds 0", "--seeds"),
    ("bench --quick --methods geomesh,sgd", "methods"),
    ("bench --quick --cluster {tmp}/negative-speed.json", "speed"),
    ("bench --quick --cluster no-such-spec", "--cluster"),
    ("bench --nope", "unrecognized arguments"),
    ("bench --quick --json {tmp}/no/r.json", "--json"),
    ("demo --out {tmp}/a/b", "--out"),
    ("plan --cluster geo-3region --memory-per-sample 20GiB", "batch 1"),
    ("plan --batch 0", "--batch"),
    # numbers beyond any real run are usage errors, not absurd plans
    ("plan --target-tokens 1e30", "--target-tokens"),
    (f"plan --target-tokens {10**13}", "--target-tokens"),
    ("plan --tokens-per-s inf", "--tokens-per-s"),
    ("plan --seq-len 0", "--seq-len"),
    ("plan --fixed-memory 1e400GiB", "--fixed-memory"),
    ("plan --memory-per-sample -1MiB", "--memory-per-sample"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """The test's directory with a bad cluster spec in it; a command that starts the bench fails."""
    import geomesh.cli as cli

    monkeypatch.setattr(cli, "_bench", Mock(side_effect=AssertionError("the bench started before the checks")))
    spec = {"machines": [{"name": "a", "speed": -1}]}
    (tmp_path / "negative-speed.json").write_text(json.dumps(spec))
    return tmp_path


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_exits_2_before_any_work(argv, needle, tmp):
    assert_fails(main, argv, 2, needle, tmp=tmp, prog="geomesh")


def test_cli_plan_table(capsys):
    assert main(["plan", "--cluster", "geo-3region", "--tokens-per-s", "10000", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    for name in ("use-a100", "euw-v100", "aps-t4"):
        assert name in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert f"geomesh {__import__('geomesh').__version__}" in capsys.readouterr().out


def test_init_from_env_without_torchrun_is_a_clear_error(monkeypatch):
    from geomesh import GeoMeshError, init_from_env

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(GeoMeshError, match="MASTER_ADDR"):
        init_from_env()


def test_unexpected_error_is_one_line_exit_1(monkeypatch):
    import geomesh.cli as cli

    monkeypatch.setattr(cli, "cmd_plan", Mock(side_effect=KeyError("use-a100")))
    res = run_cli(cli.main, "plan")
    assert (res.code, res.err.strip()) == (1, "geomesh: error: KeyError: 'use-a100'")
