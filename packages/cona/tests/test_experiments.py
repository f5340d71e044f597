"""The experiments' helpers: chain_replay's hand-written chains, oracle_luck, pool_gaps and target_level."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "chain_replay.py"
_spec = importlib.util.spec_from_file_location("chain_replay", _PATH)
chain_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain_replay)

TABLE = {"dp4-mb16-gb64": 900.0, "dp2-pp2-mb32-gb64": 1100.0, "dp4-mb32-gb128": 1400.0, "dp4-mb32-gb256": 1600.0}


def test_fixed_chain_takes_each_global_batch_on_its_fastest_strategy():
    by, sched = chain_replay._fixed("64:0,128:6,256:9.5", TABLE)
    assert by == "clock"
    assert sched == [(0.0, 64, "dp2-pp2-mb32-gb64"), (6.0, 128, "dp4-mb32-gb128"), (9.5, 256, "dp4-mb32-gb256")]
    assert chain_replay._table({"probe": {"throughput": {n: {"samples_per_s": v} for n, v in TABLE.items()}}}) == TABLE


@pytest.mark.parametrize(
    "spec, message",
    [
        ("64", "must be global_batch:clock_s"),
        ("x:0", "must be global_batch:clock_s"),
        ("64:soon", "must be global_batch:clock_s"),
        ("64:0,128:nan", "must be global_batch:clock_s"),
        ("64:0,128:inf", "must be global_batch:clock_s"),
        ("64:0,512:3", "no strategy of global batch 512"),
        ("64:1,128:3", "must start at clock 0"),
        ("64:0,128:6,256:3", "clocks must increase"),
    ],
)
def test_fixed_chain_errors_name_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        chain_replay._fixed(spec, TABLE)


_LUCK = Path(__file__).resolve().parents[1] / "experiments" / "oracle_luck.py"
_lspec = importlib.util.spec_from_file_location("oracle_luck", _LUCK)
oracle_luck = importlib.util.module_from_spec(_lspec)
_lspec.loader.exec_module(oracle_luck)


def _branch(name, samples, train_s, held):
    return {"strategy": name, "samples": samples, "train_s": train_s, "held_out_mean_at_compare": held}


def _bench(phases, ttt):
    return {
        "probe": {"throughput": {n: {"samples_per_s": v} for n, v in TABLE.items()}},
        "results": {
            "oracle": {"per_seed": {"0": {"chain": phases, "time_to_target_s": ttt["oracle"]}}},
            **{who: {"per_seed": {"0": {"time_to_target_s": t}}} for who, t in ttt.items() if who != "oracle"},
        },
    }


def test_oracle_luck_reads_the_kept_branch_rate_against_its_rivals():
    phases = [
        {"clock": 0.0, "strategy": "dp2-pp2-mb32-gb64", "branches": []},  # no timed branches: skipped
        {"clock": 3.0, "strategy": "dp4-mb32-gb128", "branches": [
            _branch("dp4-mb32-gb128", 1400 * 3 * 1.10, 3.0, 2.0),  # kept: 10% over its table rate
            _branch("dp4-mb32-gb256", 1600 * 3 * 1.00, 3.0, 2.2),  # runner-up by held-out loss, on table
            _branch("dp2-pp2-mb32-gb64", 1100 * 3 * 0.90, 3.0, 2.3),
            _branch("dp4-mb16-gb64", 900 * 3 * 0.50, 3.0, None),  # not the gb64 leader, still a rival
        ]},
        {"clock": 6.0, "strategy": "dp4-mb16-gb64", "branches": [  # kept below --min-global-batch 128: skipped there
            _branch("dp4-mb16-gb64", 900 * 3, 3.0, 2.0), _branch("dp4-mb32-gb128", 1400 * 3, 3.0, 2.1),
        ]},
    ]  # fmt: skip
    bench = _bench(phases, {"oracle": 9.0, "cona": 9.9, "surrogate_static": 10.0, "best_static": 20.0})
    rows = oracle_luck.phase_luck(bench)
    assert [r["clock"] for r in rows] == [3.0, 6.0]
    assert rows[0]["vs_others"] == pytest.approx(1.10 / ((1.0 + 0.9 + 0.5) / 3) - 1)
    assert rows[0]["vs_runner_up"] == pytest.approx(0.10)
    assert rows[1]["vs_others"] == pytest.approx(0.0) and rows[1]["vs_runner_up"] == pytest.approx(0.0)
    assert [r["clock"] for r in oracle_luck.phase_luck(bench, min_global_batch=128)] == [3.0]
    s = oracle_luck.summary(bench)
    assert s["phases"] == 2
    assert s["time_to_target_vs_surrogate_static"] == pytest.approx({"cona": -0.01, "oracle": -0.1, "best_static": 1.0})


def test_oracle_luck_says_which_runs_it_cannot_read(tmp_path, capsys):
    old = _bench([{"clock": 0.0, "strategy": "dp4-mb32-gb128", "branches": [
        {"strategy": "dp4-mb32-gb128", "held_out_mean_at_compare": 2.0}]}], {"oracle": 9.0, "surrogate_static": 10.0})  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(SystemExit) as e:
        oracle_luck.main([str(path)])
    assert e.value.code == 2
    assert "a run of commit 7f5cd73 or later is needed" in capsys.readouterr().err


_POOL = Path(__file__).resolve().parents[1] / "experiments" / "pool_gaps.py"
_pspec = importlib.util.spec_from_file_location("pool_gaps", _POOL)
pool_gaps = importlib.util.module_from_spec(_pspec)
_pspec.loader.exec_module(pool_gaps)


def _gaps(values, **config):
    return {"config": {"world": 4, "seeds": len(values), "wall_s": 1.0} | config,
            "headline_spread": {"gap_to_oracle": {"per_seed": values}}}  # fmt: skip


def test_pool_gaps_pools_seeds_of_runs_of_one_configuration():
    a, b = _gaps([0.0, 0.02, 0.04, None]), _gaps([0.06, 0.08, 0.10], wall_s=9.0)  # wall time is run-local
    out = pool_gaps.pool({"a": a, "b": b}, draws=500)
    assert out["runs"] == {"a": {"seeds": 3, "median": 0.02}, "b": {"seeds": 3, "median": 0.08}}
    assert out["pooled"]["seeds"] == 6 and out["pooled"]["median"] == pytest.approx(0.05)
    assert out["pooled"]["at_or_under_target"] == 3  # 0.05 exactly is not in the data; 0.0, 0.02, 0.04 are
    lo, hi = out["pooled"]["median_interval_90"]
    assert 0.0 <= lo <= 0.05 <= hi <= 0.10
    assert 0.0 < out["p_run_median_above_target"]["3"] < 1.0
    low = pool_gaps.pool({"a": _gaps([-0.1, -0.05, 0.0])}, draws=500)
    assert low["p_run_median_above_target"] == {"3": 0.0}


def test_pool_gaps_refuses_runs_of_other_configurations_and_unknown_keys():
    with pytest.raises(ValueError, match="config field 'world' differs between a and b"):
        pool_gaps.pool({"a": _gaps([0.01]), "b": _gaps([0.02], world=2)}, draws=500)
    with pytest.raises(ValueError, match="key 'gap' is not in the run's headline_spread"):
        pool_gaps.pool({"a": _gaps([0.01])}, key="gap", draws=500)
    with pytest.raises(ValueError, match="run a has no per-seed value"):
        pool_gaps.pool({"a": _gaps([None])}, draws=500)


def _target_level():
    import sys

    exp = str(Path(__file__).resolve().parents[1] / "experiments")
    if exp not in sys.path:
        sys.path.insert(0, exp)  # it imports batch_efficiency from beside it
    spec = importlib.util.spec_from_file_location("target_level", Path(exp) / "target_level.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_target_level_reads_the_larger_set_where_the_smaller_reaches_the_target():
    import argparse

    import numpy as np

    from cona.model import stdlib_tokens, tiny_llama_config

    tl = _target_level()
    assert tl.trailing([1.0, 3.0, 5.0, 7.0], w=2) == [1.0, 2.0, 4.0, 6.0]
    assert np.allclose(tl.wiggle(np.arange(12.0)), 0.0)  # a straight line has no wiggle
    assert tl.seeds_arg("2-4") == [2, 3, 4] and tl.seeds_arg("0,5") == [0, 5]
    args = argparse.Namespace(small=8, large=32, target=40.0, every=2, steps=400, after_steps=40, held_out_bytes=0)
    r = tl.one(tiny_llama_config(2, 32, 4, 2, 96), stdlib_tokens(200_000), 0, args)
    assert abs(r["small_mean5_at_hit"] - np.log(40.0)) < 0.5 and r["small_mean5_at_hit"] <= np.log(40.0)
    assert r["level_offset"] == pytest.approx(r["small_mean5_at_hit"] - r["large_mean5_at_hit"])
    assert r["large_ppl_at_hit"] == pytest.approx(np.exp(r["large_mean5_at_hit"]))
    assert r["wiggle_sd_small"] > 0 and r["wiggle_sd_large"] > 0 and -1 <= r["wiggle_corr"] <= 1
    args.target = 1.01  # never reached in a few steps: the error says which set and how to go on
    args.steps = 8
    with pytest.raises(SystemExit, match="8-window set never reached perplexity 1.01 in 8 steps"):
        tl.one(tiny_llama_config(2, 32, 4, 2, 96), stdlib_tokens(200_000), 0, args)
