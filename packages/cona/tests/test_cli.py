import json
import math

import pytest
from conftest import expected_models

from cona.cli import main
from cona.report import HEADLINE_KEYS
from hwtopo.testing import assert_fails


@pytest.mark.slow
def test_bench_quick_json_has_headline_and_baselines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--quick",
            "--quiet",
            "--json",
            str(out),
            "--budget-s",
            "2",
            "--target-ppl",
            "80",
            "--global-batches",
            "8,16",
            "--micro-batches",
            "4,8",
            "--seeds",
            "2",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res) >= {"package", "version", "config", "machine", "results", "headline", "emulated"}
    assert res["package"] == "cona" and res["emulated"] is False
    extra = {"censored_seeds", "oracle_branches", "probe_table_fresh", "held_out_seeds", "gap_to_oracle_median"}
    extra |= {"gap_to_oracle_iqr", "best_baseline_per_seed", "seeds_where_best_static_changes"}
    assert set(res["headline"]) == {*HEADLINE_KEYS, *extra}
    assert res["config"]["seed_list"] == [100, 101] == res["headline"]["held_out_seeds"]
    assert res["headline"]["probe_table_fresh"] is True and res["probe"]["table"]["reused"] is False
    for k in HEADLINE_KEYS:  # the headline is the median over seeds, with the spread beside it
        sp = res["headline_spread"][k]
        assert len(sp["per_seed"]) == 2 and sp["median"] == res["headline"][k]
        if sp["min"] is not None:
            assert sp["min"] <= sp["median"] <= sp["max"]
    assert set(res["step0"]) == {"100", "101"}
    statics = {f"static_gb{n.rsplit('gb', 1)[1]}" for n in res["step0"]["100"]["statics"]}
    assert statics == {"static_gb8", "static_gb16"}  # the fastest strategy of every global batch
    # probing is paid once and reported; every seed uses the same measurements
    assert res["probe"]["measured_now"] and res["probe"]["total_probe_cost_s"] > 0
    assert set(res["results"]) == {*statics, "surrogate_static", "goodput_scaling", "cona", "oracle"}
    assert all(c["strategy"].startswith("dp2-") for c in res["results"]["goodput_scaling"]["chain"])
    for name, r in res["results"].items():
        assert r["steps"] > 0, name
        assert set(r["per_seed"]) == {"100", "101"}, name
        if r["stopped_behind"]:  # a static stopped behind another static: ran, not necessarily learned yet
            continue
        if name in ("cona", "surrogate_static") and res["step0"]["100"]["first_step_from_step0"]:
            assert r["trace"][0][1] < math.log(256) + 0.3  # one step (step 0's warm gradient) from the untrained LM
        else:
            assert r["trace"][0][1] == pytest.approx(math.log(256), abs=0.3)  # an untrained byte-level LM
        assert r["trace"][-1][1] < r["trace"][0][1], f"{name} did not learn"
    cona = res["results"]["cona"]
    assert cona["decisions"][0]["reason"].startswith("initial choice")
    # the initial choice holds under both models (the bench's initial_models), so does every later one until the
    # noise scale's growth has been fitted, the rest under sqrt alone
    assert cona["decisions"][0]["efficiency_model"] == "sqrt+tuned"
    assert [d["efficiency_model"] for d in cona["decisions"][1:]] == expected_models(cona["decisions"][1:])
    # the oracle branches every distinct global batch (by default), and the JSON names them
    assert sorted(int(n.rsplit("gb", 1)[1]) for n in res["oracle_branches"]) == [8, 16]
    assert res["headline"]["oracle_branches"] == 2
    assert all(s["oracle_branches"] == res["oracle_branches"] for s in res["step0"].values())
    orc = res["results"]["oracle"]
    assert all(c["strategy"] in res["oracle_branches"] and "2 branches" in c["why"] for c in orc["chain"])
    assert orc["eval_s_excluded"] > 0  # every branch's evaluations, excluded from its clock and reported
    # cona's decisions read (and are charged for) evaluations decision_eval_every_s apart only
    every = res["config"]["decision_eval_every_s"]
    dt = [t for t, _ in cona["decision_trace"]]
    assert all(b - a >= every for a, b in zip(dt, dt[1:])) and len(dt) < len(cona["trace"])
    # the untrained model's evaluation (the trend's transient) is neither read nor charged: the first read
    # is one interval after the start
    assert all(t >= cona["trace"][0][0] + every for t in dt)
    # an evaluation was charged exactly when one came an interval after the start (rounded times: 1 ms slack)
    t_start = cona["trace"][0][0]
    if any(t >= t_start + every + 0.001 for t, _ in cona["trace"][1:]):
        assert dt and cona["decision_eval_s"] > 0 and 0 < cona["decision_eval_frac"] < 1
    elif all(t < t_start + every - 0.001 for t, _ in cona["trace"][1:]):
        assert not dt and cona["decision_eval_s"] == 0
    assert res["headline_spread"]["decision_eval_frac"]["per_seed"][0] == cona["decision_eval_frac"]
    # a variant that missed the target (perplexity 80 in 2 s: some may) is censored and flagged, never dropped
    for name, r in res["results"].items():
        missed = [seed for seed, p in r["per_seed"].items() if p["time_to_target_s"] is None]
        for p in r["per_seed"].values():  # one evaluation's dip comes no later than the mean of the last ones
            if p["time_to_target_s"] is not None:
                assert p["first_eval_at_target_s"] is not None
                assert p["first_eval_at_target_s"] <= p["time_to_target_s"], name
        assert r["censored_seeds"] == missed, name
        assert all(f"{seed}: {name}" in res["headline"]["censored_seeds"] for seed in missed)
    assert all(v is not None for v in res["headline_spread"]["ttp_ratio_vs_best_baseline"]["per_seed"])
    assert 0 <= res["headline"]["gns_overhead_frac"] < 1
    assert res["headline"]["switches"] == len(cona["chain"]) - 1
    pos = [c["samples"] for c in cona["chain"]]  # the samples trained at each switch: a replay follows them
    assert pos == sorted(pos) and pos[-1] <= cona["samples"]
    for p in cona["per_seed"].values():  # the per-seed chains a replay reads keep them too
        pos = [c["samples"] for c in p["chain"]]
        assert pos == sorted(pos) and pos[-1] <= p["samples"]
    # every candidate has a throughput, probed or from the fitted cost model
    assert set(res["probe"]["throughput"]) == set(json.loads(json.dumps(res["probe"]["throughput"])))
    assert {v["source"] for v in res["probe"]["throughput"].values()} <= {"probe", "model"}
    assert "| cona |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "--world", "5"], "no feasible strategy for world=5"),
        (["bench", "--budget-s", "0"], "--budget-s must be a number > 0"),
        (["bench", "--target-ppl", "1"], "--target-ppl must be > 1"),
        (["bench", "--seeds", "0"], "--seeds must be an integer >= 1"),
        (
            ["bench", "--set", "initial_models=sqrt,adam"],
            "--set initial_models must name one or more of sqrt, tuned, got sqrt,adam",
        ),
        (["bench", "--quick", "--set", "range_z=-1"], "--set range_z must be a number of standard errors >= 0"),
        (["bench", "--quick", "--set", "slice_s=0"], "--set slice_s must be > 0"),
        (["bench", "--quick", "--set", "gns_every"], "--set takes FIELD=VALUE, got 'gns_every'"),
        (["bench", "--quick", "--set", "gns_evry=4"], "--set gns_evry: not a bench setting; valid: adam_betas"),
        (["bench", "--quick", "--set", "gns_every=1.5"], "--set gns_every: '1.5' is not an integer"),
        (["bench", "--quick", "--set", "gns_every=0"], "--set gns_every must be >= 1, got 0"),
        (["bench", "--quick", "--set", "trend_window_s=inf"], "--set trend_window_s: 'inf' is not a number"),
        (["bench", "--quick", "--set", "range_z=wide"], "--set range_z: 'wide' is not a number"),
        (["bench", "--quick", "--set", "clip_norm=big"], "--set clip_norm: 'big' is not a number or none"),
        (["bench", "--quick", "--set", "adam_betas=0.9"], "--set adam_betas: '0.9' must list 2 values"),
        (["bench", "--quick", "--set", "oracle=yes"], "--set oracle: 'yes' is not true or false"),
        (["bench", "--quick", "--set", "seed=1", "--set", "seed=2"], "--set seed: given twice"),
        (
            [
                "strategies",
                "--layers",
                "1",
                "--heads",
                "3",
                "--kv-heads",
                "3",
                "--hidden",
                "66",
                "--global-batches",
                "3",
                "--micro-batches",
                "3",
            ],
            "no feasible strategy for world=2",
        ),
        (["strategies", "--hidden", "63", "--heads", "3", "--kv-heads", "3"], "--hidden"),
        (["bench", "--budget-s", "inf"], "--budget-s must be a number > 0"),
        (["strategies", "--seq-len", "0"], "--seq-len must be an integer >= 1"),
        (["bench", "--quick", "--json", "/proc/none/x.json"], "--json '/proc/none/x.json': directory"),
        (["demo", "--out", "/proc/none/out"], "--out '/proc/none/out': its parent"),
        (["simulate", "--spec", "no-such-spec"], "--spec"),
        (["simulate", "--mfu", "-1"], "--mfu"),
        (["simulate", "--top", "0"], "--top"),
        (["simulate", "--noise-scale", "0"], "--noise-scale"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, needle):
    """One error line naming the option (argparse prints its usage line above its own errors)."""
    res = assert_fails(main, argv, 2, needle, prog="cona")
    assert needle in res.err.strip().splitlines()[-1]


def test_strategies_lists_feasible_ones(capsys):
    assert main(["strategies", "--world", "2", "--global-batches", "8", "--micro-batches", "4"]) == 0
    names = [ln.split("\t")[0] for ln in capsys.readouterr().out.splitlines()]
    assert names == ["dp1-tp1-pp2-mb4-gb8", "dp1-tp2-pp1-mb4-gb8", "dp2-tp1-pp1-mb4-gb8"]


def test_bad_spec_is_a_usage_error(capsys):
    assert main(["strategies", "--spec", "/nonexistent.toml"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_headline_is_the_median_over_seeds_with_spread():
    from cona.report import aggregate

    per = {
        0: {
            "ttp_ratio_vs_best_baseline": 0.5,
            "gap_to_oracle": None,
            "switches": 2,
            "switch_overhead_frac": 0.01,
            "gns_overhead_frac": 0.02,
        },
        1: {
            "ttp_ratio_vs_best_baseline": 0.9,
            "gap_to_oracle": 0.1,
            "switches": 1,
            "switch_overhead_frac": 0.0,
            "gns_overhead_frac": 0.03,
        },
        2: {
            "ttp_ratio_vs_best_baseline": 0.6,
            "gap_to_oracle": 0.3,
            "switches": 3,
            "switch_overhead_frac": 0.02,
            "gns_overhead_frac": 0.01,
        },
    }
    head, spread = aggregate(per)
    assert head["ttp_ratio_vs_best_baseline"] == 0.6 and head["switches"] == 2
    assert head["gap_to_oracle"] == pytest.approx(0.2)  # a seed without a value is left out, and counted
    assert spread["gap_to_oracle"]["seeds_without_value"] == 1
    assert (spread["ttp_ratio_vs_best_baseline"]["min"], spread["ttp_ratio_vs_best_baseline"]["max"]) == (0.5, 0.9)


def _runs(cona_t, oracle_t, best_t=20.0, surrogate_t=12.0, scaling_t=15.0):
    def run(t, stopped=None):
        return {
            "time_to_target_s": t,
            "final_val_ppl": 6.0,
            "chain": [{}, {}],
            "switch_s": 0.1,
            "gns_s": 0.2,
            "clock_s": 10.0,
            "decision_eval_frac": 0.01,
            "stopped_behind": stopped,
        }

    return {
        "static_gb16": run(None, stopped="static_gb64"),  # stopped behind: out of the running, not censored
        "static_gb64": run(best_t),
        "surrogate_static": run(surrogate_t),
        "goodput_scaling": run(scaling_t),
        "cona": run(cona_t),
        "oracle": run(oracle_t),
    }


def test_the_headline_divides_by_the_best_baseline_and_says_which():
    from types import SimpleNamespace

    from cona.report import headline

    cfg = SimpleNamespace(target_ppl=5.8, budget_s=60.0, target_window=5)
    h, notes = headline(_runs(9.0, 8.0, best_t=11.0, surrogate_t=12.0, scaling_t=10.0), cfg, 0)
    assert h["best_baseline"] == "goodput_scaling" and h["best_static_hindsight"] == "static_gb64"
    assert h["ttp_ratio_vs_best_baseline"] == pytest.approx(0.9)
    assert h["oracle_gain_captured"] == pytest.approx((10.0 - 9.0) / (10.0 - 8.0))
    assert h["ttp_ratio_vs_best_static_hindsight"] == pytest.approx(9.0 / 11.0)
    assert h["oracle_gain_vs_best_baseline"] == pytest.approx(0.2)
    assert h["ttp_ratio_vs_surrogate_static"] == pytest.approx(0.75)
    assert h["censored"] == [] and notes == []  # the stopped static is neither censored nor noted
    h, _ = headline(_runs(9.0, 8.0, best_t=7.0), cfg, 0)  # the hindsight static beats even the oracle
    assert h["best_baseline"] == "static_gb64" and h["oracle_gain_captured"] is None
    h, _ = headline(_runs(9.0, 8.0, best_t=None), cfg, 0)  # no static reached the target: censored at the budget
    assert h["best_static_hindsight"] == "static_gb64" and h["censored"] == ["static_gb64"]
    assert h["ttp_ratio_vs_best_static_hindsight"] == pytest.approx(9.0 / 60.0)


def test_a_seed_where_cona_misses_the_target_stays_in_the_headline_censored():
    """cona missing the target in one seed (budget 60 s): its time is censored at the budget, the seed is
    flagged, and the medians include it (they would read 0.5 / 0.0 had the seed been dropped)."""
    from types import SimpleNamespace

    from cona.report import aggregate, headline

    cfg = SimpleNamespace(target_ppl=5.8, budget_s=60.0, target_window=5)
    per, notes = {}, []
    for seed, (c, o) in enumerate([(6.0, 6.0), (None, 7.2), (6.0, 6.0)]):
        per[seed], n = headline(_runs(c, o), cfg, seed)
        notes += n
    assert per[1]["ttp_ratio_vs_best_baseline"] == pytest.approx(60.0 / 12.0)
    assert per[1]["gap_to_oracle"] == pytest.approx((60.0 - 7.2) / 7.2)
    assert per[1]["censored"] == ["cona"] and any("seed 1: cona did not reach" in x for x in notes)
    head, spread = aggregate(per)
    assert head["censored_seeds"] == ["1: cona"]
    assert spread["ttp_ratio_vs_best_baseline"]["per_seed"] == pytest.approx([0.5, 5.0, 0.5])
    assert spread["gap_to_oracle"]["seeds_without_value"] == 0
    assert head["gap_to_oracle_median"] == head["gap_to_oracle"] == pytest.approx(0.0)
    assert head["gap_to_oracle_iqr"] == pytest.approx([0.0, (60.0 - 7.2) / 7.2 / 2])  # inclusive quartiles of 3
    # two of three censored: the medians are the censored values, not the one seed that reached the target
    per = {seed: headline(_runs(c, 10.0), cfg, seed)[0] for seed, c in enumerate([None, None, 6.0])}
    head, _ = aggregate(per)
    assert head["ttp_ratio_vs_best_baseline"] == pytest.approx(5.0) and head["gap_to_oracle"] == pytest.approx(5.0)
    assert head["censored_seeds"] == ["0: cona", "1: cona"]
    # a censored oracle is censored too (not a missing gap)
    h, _ = headline(_runs(30.0, None), cfg, 0)
    assert h["gap_to_oracle"] == pytest.approx(-0.5) and h["censored"] == ["oracle"]


def test_best_strategy_changes_are_measured_from_the_static_runs_and_the_oracle():
    from cona.report import strategy_changes

    runs = {
        # gb16 leads to the early losses, gb64 to the target: the best static changes during training
        "static_gb16": {"trace": [[0.0, 5.5], [1.0, 4.0], [2.0, 3.0], [6.0, 2.5]]},
        "static_gb64": {"trace": [[0.0, 5.5], [1.5, 4.0], [3.0, 3.0], [4.0, 2.0]]},
        "oracle": {"chain": [{"strategy": "a"}, {"strategy": "b"}, {"strategy": "b"}]},
    }
    got = strategy_changes(runs, target_loss=2.0, window=1, levels=2)
    assert [x["first"] for x in got["static_first_to_loss"]] == ["static_gb16", "static_gb64"]
    assert got["static_first_to_loss"][0] == {"loss": 3.75, "first": "static_gb16", "clock_s": 2.0}
    assert got["static_leader_changes"] == 1 and got["oracle_changes"] == 1
    assert got["oracle_kept_by_phase"] == ["a", "b", "b"]


def test_development_seeds_in_the_report_are_flagged_as_not_held_out():
    from cona.config import BenchConfig
    from cona.report import _seed_notes

    assert "held-out seeds [100, 101, 102]" in _seed_notes(BenchConfig())[0]
    assert "seeds [8, 9] are development seeds" in _seed_notes(BenchConfig(seed=8, seeds=3))[0]


def test_set_replaces_any_bench_setting_and_wins_over_flags():
    from cona.cli import _parser, _run_config

    argv = [
        "bench",
        "--quick",
        "--budget-s",
        "30",
        "--set",
        "budget_s=45",
        "--set",
        "gns_every=16",
        "--set",
        "decision_eval_every_s=1",
        "--set",
        "range_z=1",
        "--set",
        "global_batches=32,64",
        "--set",
        "oracle=false",
        "--set",
        "adam_betas=0.9,0.99",
    ]
    cfg = _run_config(_parser().parse_args(argv), quick=True)
    assert (cfg.gns_every, cfg.decision_eval_every_s, cfg.range_z) == (16, 1.0, 1.0)
    assert (cfg.global_batches, cfg.oracle, cfg.adam_betas) == ((32, 64), False, (0.9, 0.99))
    assert cfg.budget_s == 45.0  # --set wins over the flag
    assert cfg.world == 2 and cfg.trend_window_s == 5.0  # the rest as --quick has it
