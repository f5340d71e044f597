"""Throughput probes: the ProbeCache is read back, so a second bench pays no probing."""

import json
import math

import pytest

from cona.dist import launch
from cona.probe import (
    DIGEST_SOURCES,
    CostModel,
    ProbeCache,
    code_digest,
    merge_paired,
    paired_rates,
    round_steps,
    time_steps,
)
from cona.space import Strategy


def test_probe_cache_round_trip(tmp_path):
    path = tmp_path / "p.json"
    c = ProbeCache.open("k", path)
    s = Strategy(2, 1, 1, 4, 8)
    assert c.entry(s) is None
    c.put(s, 0.25, cost_s=1.5)
    c.save()
    again = ProbeCache.open("k", path)
    assert again.entry(s)["step_s"] == 0.25 and again.entry(s)["cost_s"] == 1.5
    assert ProbeCache.open("other key", path).entry(s) is None  # another machine/model/world: probed afresh
    path.write_text(json.dumps({"k": {s.name: 0.5}}))  # not an entry
    assert ProbeCache.open("k", path).entry(s) is None
    path.write_text("not json")
    assert ProbeCache.open("k", path).entry(s) is None
    with pytest.raises(ValueError, match="must be > 0"):
        c.put(s, 0.0)


def test_a_table_probed_under_another_load_is_stale(tmp_path):
    """A table measured at load 14.4 is not read at load 0.5 (it would rank the strategies of a loaded machine)."""
    path = tmp_path / "p.json"
    a, b, c = Strategy(2, 1, 1, 4, 8), Strategy(2, 1, 1, 8, 16), Strategy(1, 2, 1, 8, 16)
    busy = ProbeCache(path, "k", load_1m=14.4)
    busy.put(a, 0.25)
    busy.data["k"][b.name] = {"step_s": 0.5}  # an entry without its load (an older format)
    busy.save()
    quiet = ProbeCache.open("k", path)
    quiet.load_1m = 0.5
    fresh, stale = quiet.fresh([a, b, c], load_tolerance=1.0)
    assert fresh == {} and set(stale) == {a.name, b.name}
    assert "probed at load 14.40, now 0.50 (tolerance 1)" in stale[a.name] and stale[b.name] == "no load recorded"
    quiet.load_1m = 13.9  # as loaded as when it was probed: reused
    fresh, stale = quiet.fresh([a, b, c], load_tolerance=1.0)
    assert list(fresh) == [a.name] and fresh[a.name]["loadavg_1m"] == 14.4 and list(stale) == [b.name]


def test_the_probe_key_names_machine_software_and_code_and_says_why_other_tables_are_not_read(tmp_path):
    import transformers

    from cona.config import BenchConfig
    from cona.probe import bench_probe_key, machine_digest

    key = json.loads(bench_probe_key(BenchConfig()))
    assert key["machine"] == machine_digest() and len(key["machine"]) == 12
    assert key["transformers"] == transformers.__version__ and key["code"] == code_digest() and key["torch"]
    older = json.dumps(key | {"code": "0123456789ab", "torch": "2.0"}, sort_keys=True)
    c = ProbeCache(tmp_path / "p.json", bench_probe_key(BenchConfig()), {older: {}, "junk": {}})
    assert c.other_tables() == [["code", "torch"], sorted([*key, "key"])]
    assert bench_probe_key(BenchConfig(world=4)) != bench_probe_key(BenchConfig())


def test_code_digest_follows_the_source_and_survives_a_bytecode_install(tmp_path, monkeypatch):
    from importlib import resources

    src = resources.files("cona")
    for name in DIGEST_SOURCES:
        (tmp_path / name).write_bytes((src / name).read_bytes())
    monkeypatch.setattr(resources, "files", lambda pkg: tmp_path)
    same = code_digest()
    assert same == code_digest() and len(same) == 12
    (tmp_path / "space.py").write_bytes((tmp_path / "space.py").read_bytes() + b"\n# changed\n")
    assert code_digest() != same  # a probe measured by other code is not reused
    (tmp_path / "dist.py").unlink()  # sources missing (bytecode-only install): a marked stand-in, no crash
    assert code_digest().startswith("no-source-")


def test_cost_model_prefers_measurement_and_fits_the_rest():
    cm = CostModel()
    for s, t in [(Strategy(2, 1, 1, 4, 8), 0.1), (Strategy(2, 1, 1, 8, 16), 0.15), (Strategy(2, 1, 1, 4, 32), 0.3)]:
        cm.add(s, t)
    assert cm.throughput(Strategy(2, 1, 1, 4, 8)) == (80.0, "probe")
    t, src = cm.step_time(Strategy(2, 1, 1, 8, 32))
    assert src == "model" and t > 0


def _probe_twice(rank, world, cfg_dict):
    from cona.bench import Trainer
    from cona.config import BenchConfig

    cfg = BenchConfig(**cfg_dict)
    first = Trainer(cfg).probe()
    second_tr = Trainer(cfg)
    second = second_tr.probe()
    table = {s.name: second_tr.cost.throughput(s) for s in second_tr.candidates}
    # every measured strategy's fastest round is known, from this run's rounds or the cache's (pair_contenders)
    assert set(second_tr.cost.measured) <= set(second_tr.prober.fastest_round_s)
    return (first, second, table) if rank == 0 else None


@pytest.mark.slow
def test_bench_probes_are_cached_and_the_fastest_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # spawned ranks inherit it
    cfg = {
        "global_batches": (8, 16, 32),
        "micro_batches": (4, 8),
        "probe_steps": 1,
        "probe_rounds": 2,
        "probe_paired_cycles": 3,
        "seeds": 1,
        "probe_load_tolerance": 1e9,  # the machine's load moves between the two runs; staleness by load is unit-tested
    }
    first, second, table = launch(_probe_twice, 2, cfg, timeout_s=300)[0]
    assert first["measured_now"] and not first["from_cache"]
    assert first["probe_rounds"] == 2 and isinstance(first["round_spread_median"], float)
    entries = json.loads((tmp_path / "mlsyskit" / "cona" / "probes.json").read_text())
    (entries,) = entries.values()
    for e in entries.values():  # the lower middle round is the one used (for a contender, before its cycles)
        r = e["rounds"]
        assert len(r) == 2, r
        assert (e["paired"]["rounds_step_s"] if "paired" in e else e["step_s"]) == sorted(r)[(len(r) - 1) // 2]
    # the contenders, the fastest of every global batch, were timed again in cycles, and a second run reuses that
    paired = first["paired"]
    assert paired["measured"] and paired["cycles"] == 3 and not second["paired"]["measured"]
    assert {int(n.rsplit("gb", 1)[1]) for n in paired["contenders"]} == {8, 16, 32}
    for gb in (8, 16, 32):  # every global batch's leader in the final table was among them
        leader = max((n for n in table if n.endswith(f"-gb{gb}")), key=lambda n: table[n][0])
        assert leader in paired["contenders"], leader
    assert paired["unpaired_leaders"] == []  # and the report says so
    assert all("paired" in entries[n] for n in paired["contenders"])
    for n in paired["contenders"]:
        assert entries[n]["step_s"] == pytest.approx(
            entries[n]["paired"]["rounds_step_s"] / paired["rate_vs_rounds"][n]
        )
    assert second["measured_now"] == [] and sorted(second["from_cache"]) == sorted(first["measured_now"])
    assert second["probe_measure_s"] == 0.0
    assert second["cached_probe_cost_s"] == pytest.approx(first["probe_measure_s"])
    assert (tmp_path / "mlsyskit" / "cona" / "probes.json").exists()
    # the best static pick (highest throughput) is a measured strategy, not a cost-model guess
    best = max(table, key=lambda n: table[n][0])
    assert table[best][1] == "probe", best
    for gb in {int(n.rsplit("gb", 1)[1]) for n in table}:  # and so is the fastest of every global batch
        fastest = max((n for n in table if n.endswith(f"-gb{gb}")), key=lambda n: table[n][0])
        assert table[fastest][1] == "probe", fastest
    assert {src for _, src in table.values()} == {"probe", "model"}  # some strategies are still modelled


def test_a_strategy_whose_median_round_fell_in_a_slow_spell_is_still_paired():
    """Rounds measured on 2 ranks on a VM up for minutes: dp2-mb32-gb256 ran 0.094, 0.088, 0.051 s, its median put it at
    2901 samples/s behind the pp2 leader of gb256 (3533), and gb128's leader read 4513; by its fastest round it
    leads gb256, so the cycles time it. Fastest rounds are set against fastest rounds: a strategy within the band of
    a leader's median but not of its global batch's best round is left out, the leaders never."""
    from cona.probe import pair_contenders
    from cona.space import Strategy

    dp256, pp256 = Strategy(2, 1, 1, 32, 256), Strategy(1, 1, 2, 32, 256)
    dp128, mb16_128, mb8_128 = Strategy(2, 1, 1, 32, 128), Strategy(2, 1, 1, 16, 128), Strategy(2, 1, 1, 8, 128)
    step = {dp256: 0.088, pp256: 0.0725, dp128: 0.0284, mb16_128: 0.030, mb8_128: 0.045}
    fastest = {dp256: 0.0506, pp256: 0.0722, dp128: 0.0260, mb16_128: 0.0300, mb8_128: 0.040}
    cands = [dp256, pp256, dp128, mb16_128, mb8_128, Strategy(1, 2, 1, 32, 128)]  # the last one never measured
    leaders = [pp256, dp128]  # by the table (median rounds)
    # mb16: 128 / 0.030 is within 10% of dp128's median figure (4507) but not of its fastest round (4923)
    assert 128 / 0.030 >= 0.9 * 128 / 0.0284 and 128 / 0.030 < 0.9 * 128 / 0.026
    assert pair_contenders(cands, step, fastest, leaders, 0.1) == [dp256, pp256, dp128]
    # by the median rounds alone (the rule until then) dp256 would not be
    assert 256 / step[dp256] < 0.9 * 256 / step[pp256]
    assert pair_contenders(cands, step, {}, leaders, 0.1) == [pp256, dp128, mb16_128]


def test_the_paired_level_is_the_rounds_median_not_moved_by_one_slow_median():
    """Paired cycles give ratios at some level; put at the rounds' level (the median over the contenders of rounds /
    paired), one contender whose median round ran at 0.62 of its speed moves nobody (a geometric mean moved all
    six here by ~8%)."""
    true = {"gb16": 1600.0, "gb32": 2600.0, "gb64": 3700.0, "gb128": 4400.0, "gb256": 4700.0, "pp-gb256": 3500.0}
    cycles = [{n: r * speed for n, r in true.items()} for speed in (0.5, 0.7, 0.6)]  # right ratios, another level
    rounds = dict(true, gb256=0.62 * true["gb256"])  # its median round fell in a slow spell
    got = paired_rates(cycles, reference=rounds)
    assert all(got[n] == pytest.approx(true[n]) for n in true)


def test_a_slow_strategy_is_timed_for_fewer_steps():
    # 20 steps where they fit in the round's seconds, as many as fit otherwise, never fewer than 3
    assert round_steps(0.02, 20, 1.5) == 20
    assert round_steps(0.1, 20, 1.5) == 15
    assert round_steps(0.67, 20, 1.5) == 3
    assert round_steps(0.67, 2, 1.5) == 2  # the minimum never exceeds the steps asked for
    assert round_steps(0.67, 20, None) == 20  # no limit
    calls, seen = [], []

    def step():
        calls.append(1)

    def count(first_s):
        seen.append(first_s)
        return 4

    time_steps(step, steps=20, warmup=1, steps_after_first=count)
    assert len(calls) == 1 + 4 and len(seen) == 1  # one warm-up, then the count set after the first timed step
    calls.clear()
    time_steps(step, steps=6, warmup=2)
    assert len(calls) == 8


def test_probe_round_seconds_must_be_positive():
    from cona.config import BenchConfig

    with pytest.raises(ValueError, match="probe_round_s must be > 0 seconds"):
        BenchConfig(probe_round_s=0)


def test_paired_rates_cancel_a_speed_common_to_a_cycle():
    import random

    true = {"gb32": 1700.0, "gb64": 2600.0, "gb128": 2950.0}
    rng = random.Random(0)
    cycles = []
    for c in range(21):
        speed = rng.uniform(0.55, 1.3)  # the machine's speed of this cycle, shared by its blocks
        row = {n: r * speed * rng.uniform(0.99, 1.01) for n, r in true.items()}
        if c % 5 == 0:  # a burst inside one block of a few cycles
            row["gb64"] *= 0.5
        cycles.append(row)
    got = paired_rates(cycles)
    for a in true:
        for b in true:
            assert got[a] / got[b] == pytest.approx(true[a] / true[b], rel=0.03), (a, b)
    assert set(got) == set(true)
    # the level: by default the geometric mean of each strategy's median block rate; else a reference's
    medians = {n: sorted(c[n] for c in cycles)[10] for n in true}
    assert math.prod(got.values()) == pytest.approx(math.prod(medians.values()), rel=1e-9)
    at = paired_rates(cycles, reference={n: 2.0 * r for n, r in got.items()})  # the level of figures measured otherwise
    assert all(at[n] == pytest.approx(2.0 * got[n]) for n in got)
    with pytest.raises(ValueError, match="each timing the same strategies"):
        paired_rates([{"a": 1.0}, {"b": 1.0}])
    with pytest.raises(ValueError, match="at least one cycle"):
        paired_rates([])


def test_paired_settings_are_checked():
    from cona.config import BenchConfig

    with pytest.raises(ValueError, match="probe_paired_cycles must be >= 0"):
        BenchConfig(probe_paired_cycles=-1)
    with pytest.raises(ValueError, match="probe_paired_block_s must be > 0 seconds"):
        BenchConfig(probe_paired_block_s=0)


def test_a_later_paired_pass_adds_to_the_report_and_its_figures_win():
    """A leader timed in the first pass stays in the report after a second pass that did not time it."""
    first = {
        "contenders": ["a", "b"],
        "measured": True,
        "cycles": 3,
        "cost_s": 1.0,
        "passes": 1,
        "block_steps": {"a": 2, "b": 3},
        "rate_vs_rounds": {"a": 1.1, "b": 0.9},
    }
    second = {
        "contenders": ["c", "b"],
        "measured": True,
        "cycles": 3,
        "cost_s": 0.5,
        "passes": 1,
        "block_steps": {"c": 4, "b": 5},
        "rate_vs_rounds": {"c": 1.0, "b": 0.95},
    }
    assert merge_paired(None, first) is first
    both = merge_paired(first, second)
    assert both["contenders"] == ["a", "b", "c"] and both["passes"] == 2 and both["cost_s"] == 1.5
    assert both["block_steps"] == {"a": 2, "b": 5, "c": 4}
    assert both["rate_vs_rounds"] == {"a": 1.1, "b": 0.95, "c": 1.0}
    assert first["contenders"] == ["a", "b"]  # the earlier report is not changed


def test_a_step_past_its_probed_limit_names_the_run_strategy_and_slow_rank():
    """The limit follows the probed step time (25 x, at least 5 s), not a constant for the whole run."""
    from cona.config import BenchConfig
    from cona.harness import StepLimitError, check_step, step_limit_s

    cfg = BenchConfig()
    s = Strategy(1, 1, 2, 32, 256)
    assert step_limit_s(0.4, cfg.step_limit_factor, cfg.step_limit_floor_s) == pytest.approx(10.0)
    assert step_limit_s(0.01, cfg.step_limit_factor, cfg.step_limit_floor_s) == 5.0
    check_step("cona", s, 7, [9.0, 9.9], 0.4, cfg)  # inside 10 s: nothing
    with pytest.raises(StepLimitError, match=r"cona: step 7 of dp1-tp1-pp2-mb32-gb256 took 12.00 s on rank 1") as e:
        check_step("cona", s, 7, [3.0, 12.0], 0.4, cfg)
    assert "limit of 10.00 s" in str(e.value) and "0.4000 s" in str(e.value)
    with pytest.raises(ValueError, match="step_limit_factor must be > 0"):
        BenchConfig(step_limit_factor=0)
