from dataclasses import replace

import pytest

from geomesh import WanEmulator
from geomesh.bench import BenchConfig, _verdict, bench_cluster, emulation_check, load_corpus, ppl_at_tokens, run_bench
from geomesh.simulate import scheme_of

pytestmark = pytest.mark.slow


def test_corpus_is_real_python_text():
    train, val, files = load_corpus(100_000)
    assert len(train) + len(val) == 100_000 and files[0].endswith(".py")
    assert b"def " in bytes(train[:50_000].tolist())


def test_small_bench_side_by_side():
    cfg = BenchConfig(
        outer_steps=4,  # room after the loss: the survivors must meet it at a later sync
        inner_steps=3,
        batch=2,
        hidden=32,
        layers=1,
        heads=2,
        cpus=1.0,
        text_bytes=200_000,
        val_seqs=8,
        profile_s=0.1,
        wan="inprocess",
        methods=("geomesh", "diloco-fp32", "async"),
        bw_bound_methods=("geomesh", "diloco-fp32"),
        loss_at=1,
        quorum_grace_s=0.5,
    )
    res = run_bench(cfg)
    h = res["headline"]
    # the target comes from a separate DiLoCo-fp32 run at a development seed, fixed before the compared runs
    ref = res["reference"]
    assert res["seeds"] == {"development": [0, 1, 2, 3], "reference": 0, "held_out": [100, 101]}
    assert ref["seed"] == 0 and h["target_ppl"] == ref["target_ppl"]
    assert ref["target_ppl"] == ppl_at_tokens(ref["curve"], int(0.85 * ref["curve"][-1]["tokens"]))
    for name, r in [*res["results"].items(), *res["bw_bound"]["results"].items()]:
        first = next((c["time_s"] for c in r["curve"] if c["ppl"] <= h["target_ppl"]), None)
        assert r["time_to_target_s"] == first, name
    # the dense baseline runs the all-reduce the link model says is faster, charged per hop like the signs
    d_bytes = res["results"]["diloco-fp32"]["payload_bytes_per_worker_per_sync"]
    for links, scale in ((res, 1.0), (res["bw_bound"], 0.1)):
        cl = bench_cluster(replace(cfg, link_bandwidth_scale=scale))
        assert links["results"]["diloco-fp32"]["collective"] == WanEmulator(cl, cl.names).best_all_reduce(d_bytes)
        assert links["results"]["geomesh"]["collective"] == "all_gather"
    assert res["bw_bound"]["emulated"]["link_bandwidth_scale"] == 0.1
    assert "ttt_ratio_vs_diloco_bw_bound" in h
    # the 8-64 worker model, checked against the 3-worker runs (seconds only: no link counters in-process)
    val = res["simulation"]["latency_bound"]["validation"]
    assert set(val) == {
        "allgather-sign",
        d_scheme := scheme_of("diloco-fp32", res["results"]["diloco-fp32"]["collective"]),
    }
    assert val[d_scheme]["measured_collective_s"] == res["results"]["diloco-fp32"]["collective_s_per_sync"]
    assert h["sim_traffic_ratio_vs_ring_fp32@64"] <= 1 / 8 < h["sim_traffic_ratio_allgather_sign_vs_ring_fp32@64"]
    # every run's achieved worker speeds against the reference's, and a verdict when they could be compared
    check = res["emulated"]["cpu_speed_check"]["runs"]
    assert set(check) == {"geomesh", "diloco-fp32", "async", "geomesh (seed 101)", "diloco-fp32 (seed 101)"} | {
        f"{m} (bandwidth-bound)" for m in ("geomesh", "diloco-fp32")
    }
    assert set(check["diloco-fp32"]["host_speed_vs_reference"]) == set(ref["step_s"]) and len(ref["step_s"]) == 3
    # every worker of every run measured: a verdict for each, and the headline is their conjunction
    assert all(c["unmeasured"] == [] and len(c["speed_held"]) == 3 for c in check.values())
    assert h["emulation_valid"] == all(c["valid"] for c in check.values())
    assert h["emulation_invalid_runs"] == [k for k, c in check.items() if not c["valid"]]
    # worker 1 left at its first sync after profiling: the other two went on to the same tokens and the target
    loss = res["worker_loss"]
    assert loss["lost_machine"] == "euw-v100" and h["worker_loss_survived"] is loss["survived"]
    assert loss["tokens"] >= res["results"]["diloco-fp32"]["tokens"]
    assert loss["quorum_lost"] == ["euw-v100"] and loss["survived"] is True
    per = loss["syncs_per_worker"]
    assert per["use-a100"] == per["aps-t4"] == loss["syncs"] >= per["euw-v100"] >= 2
    # no namespaces here: no link counters, and the JSON says so instead of a number
    assert h["bytes_ratio_vs_fp32_measured"] is None and h["bytes_measured"].startswith("not available")
    for key in (
        "bytes_ratio_vs_fp32",
        "ttt_ratio_vs_diloco",
        "straggler_idle_geomesh",
        "straggler_idle_diloco",
        "ppl_rel_diff_vs_diloco",
    ):
        assert key in h
    assert h["bytes_ratio_vs_fp32"] < 1 / 25
    assert res["emulated"]["wan"]["emulated"] is True
    assert all(t["emulated"] for t in res["emulated"]["cpu"])
    # slower workers by compute dilation (cpus=1: the fastest runs undilated): each one's compute took
    # 1/speed as long, as sleep or as time it already waited for a CPU (a debt under 1 ms may be left)
    cpu = res["emulated"]["cpu"]
    assert [t["method"] for t in cpu] == ["dilation"] * 3 and [t["speed"] < 1 for t in cpu] == [False, True, True]
    for t in cpu:
        paid = t["slept_s"] + (t["runqueue_wait_s"] or 0.0)
        assert t["sync_points"] > 0 and paid >= t["cpu_s"] * (1 / t["speed"] - 1) - 1e-3, t
        assert t["speed"] < 1 or t["slept_s"] == 0.0, t
    for name, r in res["results"].items():
        assert r["curve"][0]["ppl"] > r["final_ppl"], name  # training lowered validation perplexity
        assert 0 <= r["straggler_idle"] < 1
    g = res["results"]["geomesh"]
    # a time-boxed profiling phase, then planned phases until at least DiLoCo's tokens are done
    assert g["syncs"] >= 2 and g["plan"]["imbalance"] < 0.5
    # it stops at the first sync at or past DiLoCo's tokens, so it overshoots by less than its last phase
    # (how far depends on the measured speeds: the profiling phase is time-boxed, H=3 leaves coarse plans)
    d_tokens, last_phase = res["results"]["diloco-fp32"]["tokens"], sum(g["final_inner_steps"][0])
    assert d_tokens <= g["tokens"] < d_tokens + last_phase
    assert h["tokens_rel_diff_vs_diloco"] == pytest.approx((g["tokens"] - d_tokens) / d_tokens)
    assert res["emulated"]["wan_mode"]["mode"] == "inprocess"
    # GeoMesh vs DiLoCo repeated at a second seed: the perplexity gap is reported per seed and as their mean
    per = h["ppl_rel_diff_vs_diloco_per_seed"]
    assert list(per) == ["100", "101"] and len(res["repeats"]) == 1
    assert h["ppl_rel_diff_vs_diloco"] == pytest.approx(sum(per.values()) / 2)
    assert per["100"] == h["ppl_rel_diff_vs_diloco_first_seed"]
    for key in ("straggler_idle_geomesh", "straggler_idle_diloco", "ttt_ratio_vs_diloco"):
        per = h[f"{key}_per_seed"]
        if None not in per.values():
            assert h[key] == pytest.approx(sum(per.values()) / 2) and per["100"] == h[f"{key}_first_seed"]
    phases = g["phases_per_worker"]
    assert len(phases) == 3 and all(len(p) == g["syncs"] for p in phases.values())
    # every worker timed its steps at the bench's batch (the profiling phase runs it) and at others
    steps = g["step_s_per_worker"]
    assert set(steps) == set(phases) and all(str(cfg.batch) in s and len(s) >= 2 for s in steps.values())


def test_emulation_check_marks_runs_whose_worker_speeds_moved():
    def run(slowdown: dict, step_s: float = 0.1, steps: int = 40, batch: int = 8) -> dict:
        return {
            "cpu_emulation": {"a": {"speed": 0.5}, "b": {"speed": 0.25}},
            "slowdown_per_worker": slowdown,
            "step_s_per_worker": {m: {str(batch): [step_s, steps]} for m in slowdown},
        }

    ref = {"a": 0.10, "b": 0.10}
    got = emulation_check(
        ref,
        {
            "ok": run({"a": 2.1, "b": 3.8}),
            "starved": run({"a": 2.0, "b": 6.0}),  # b ran 1.5x slower than its speed asks
            "undilated": run({"a": 1.0, "b": 4.0}),  # a was not slowed at all
            "one missing": run({"a": 2.0}),
            "host slower": run({"a": 2.0, "b": 4.0}, step_s=0.125),
            "few steps": run({"a": 2.0, "b": 4.0}, steps=2),
        },
        8,
    )
    assert got["ok"]["valid"] is True and got["ok"]["speed_held"]["a"] == pytest.approx(2.0 / 2.1)
    assert got["starved"]["valid"] is False and got["undilated"]["valid"] is False
    assert got["one missing"]["valid"] is None and got["one missing"]["unmeasured"] == ["b"]
    # the host's own speed is reported, not judged; too few steps at the batch: not reported
    assert got["host slower"]["valid"] is True and got["host slower"]["host_speed_vs_reference"]["a"] == pytest.approx(
        0.8
    )
    assert got["few steps"]["host_speed_vs_reference"] == {}
    assert _verdict({k: got[k] for k in ("ok", "host slower")}) is True
    assert _verdict({k: got[k] for k in ("ok", "one missing")}) is None
    assert _verdict(got) is False and _verdict({}) is None


def test_held_out_seeds_must_not_be_development_seeds():
    with pytest.raises(ValueError, match=r"seed: seeds \[3\] are development seeds"):
        BenchConfig(seed=3, repeat_seeds=1, wan="inprocess").validate()
    with pytest.raises(ValueError, match="all_reduce: 'tree' is not valid"):
        BenchConfig(all_reduce="tree", wan="inprocess").validate()
    with pytest.raises(ValueError, match="cpu_emulation: 'nice' must be 'dilation' or 'quota'"):
        BenchConfig(cpu_emulation="nice", wan="inprocess").validate()
    with pytest.raises(ValueError, match=r"cpus: 2 x the fastest machine's relative speed 1 must be <= 1"):
        BenchConfig(cpus=2, wan="inprocess").validate()
    BenchConfig(cpus=2, cpu_emulation="quota", wan="inprocess").validate()
    BenchConfig(seed=4, repeat_seeds=3, wan="inprocess").validate()


def test_ppl_at_tokens_interpolates_in_tokens():
    from geomesh.bench import ppl_at_tokens

    curve = [{"tokens": 0, "ppl": 100.0}, {"tokens": 100, "ppl": 20.0}, {"tokens": 200, "ppl": 10.0}]
    assert ppl_at_tokens(curve, 150) == 15.0
    assert ppl_at_tokens(curve, 100) == 20.0
    assert ppl_at_tokens(curve, 500) == 10.0
