import json
from pathlib import Path

import numpy as np
import pytest

from sysprdict.blockchain import (
    CaliperError,
    Costs,
    FabricConfig,
    PerfModel,
    SchemaError,
    grouped_folds,
    load_caliper,
    read_csv,
    recommend,
    simulate,
    simulate_dataset,
    smape,
    write_csv,
)
from sysprdict.blockchain.fabricsim import SimParams
from sysprdict.blockchain.models import grouped_cv
from sysprdict.blockchain.recommend import candidates

FIX = Path(__file__).parent / "fixtures"


def test_caliper_html_fixture_parses_rounds_resources_and_config():
    rows = load_caliper(FIX / "caliper-report.html")
    assert [r["send_rate_tps"] for r in rows] == [100.2, 200.1]
    assert rows[0]["throughput_tps"] == 98.3 and rows[1]["avg_latency_s"] == 0.87
    assert rows[0]["success_rate"] == pytest.approx(2950 / 3000)
    assert rows[1]["success_rate"] == pytest.approx(5700 / 6000)
    assert rows[0]["peer_cpu_util"] == pytest.approx(0.55) and rows[0]["orderer_cpu_util"] == pytest.approx(0.2)
    assert all(r["source"] == "caliper" and r["peers"] == 2 and r["endorsement"] == "MAJORITY" for r in rows)


def test_caliper_json_and_directory():
    rows = load_caliper(FIX / "caliper-report.json")
    assert len(rows) == 1 and rows[0]["success_rate"] == 1.0 and rows[0]["endorsement"] == "AND"
    assert len(load_caliper(FIX)) == 3


def test_malformed_caliper_reports(tmp_path):
    bad = tmp_path / "r.html"
    bad.write_text("<html><table><tr><th>Foo</th></tr></table></html>")
    with pytest.raises(CaliperError, match="Summary of performance metrics"):
        load_caliper(bad)
    nocfg = tmp_path / "n.html"
    nocfg.write_text((FIX / "caliper-report.html").read_text())
    with pytest.raises(CaliperError, match="config"):
        load_caliper(nocfg)
    j = tmp_path / "x.json"
    j.write_text("{not json")
    with pytest.raises(CaliperError, match=r"x.json: not valid JSON \(line 1"):
        load_caliper(j)
    j.write_bytes(b"\xff\xfe{")
    with pytest.raises(CaliperError, match="x.json: not UTF-8 text"):
        load_caliper(j)
    obj = json.loads((FIX / "caliper-report.json").read_text())
    obj["rounds"][0]["Succ"] = "many"
    j.write_text(json.dumps(obj))
    with pytest.raises(CaliperError, match="Succ: 'many' is not a number"):
        load_caliper(j)


def test_csv_round_trip_and_errors_name_file_row_column(tmp_path):
    rows = simulate_dataset(3, 2, seed=1, params=SimParams(duration_s=2.0))
    p = write_csv(tmp_path / "b.csv", rows)
    back = read_csv(p)
    assert len(back) == 6 and back[0]["config_id"] == rows[0]["config_id"]
    assert back[2]["throughput_tps"] == pytest.approx(rows[2]["throughput_tps"])
    lines = p.read_text().splitlines()
    head = lines[0].split(",")
    cells = lines[3].split(",")
    cells[head.index("peer_cpus")] = "-1"
    lines[3] = ",".join(cells)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(SchemaError, match=r"b.csv:row 4, column 'peer_cpus': '-1' must be > 0"):
        read_csv(p)
    cells[head.index("peer_cpus")] = "abc"
    lines[3] = ",".join(cells)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(SchemaError, match=r"row 4, column 'peer_cpus': 'abc' is not a number"):
        read_csv(p)
    (tmp_path / "h.csv").write_text("peers,orderers\n1,1\n")
    with pytest.raises(SchemaError, match="header: missing column"):
        read_csv(tmp_path / "h.csv")


def test_simulator_responds_to_scaling_and_is_labelled():
    p = SimParams(duration_s=4.0)
    small = simulate(FabricConfig(peer_cpus=1.0, send_rate_tps=500, peers=2), seed=0, params=p)
    big = simulate(FabricConfig(peer_cpus=4.0, send_rate_tps=500, peers=6), seed=0, params=p)
    assert big["throughput_tps"] > 1.5 * small["throughput_tps"]
    assert big["success_rate"] > small["success_rate"]
    light = simulate(FabricConfig(send_rate_tps=100, peer_cpus=4.0), seed=0, params=p)
    # a short round's throughput includes the drain of the last block (Caliper's definition)
    assert 75 < light["throughput_tps"] <= 100 and light["success_rate"] > 0.9
    rows = simulate_dataset(2, 1, params=p)
    assert all(r["source"] == "simulated" for r in rows)


def test_grouped_folds_never_leak_configurations():
    rows = simulate_dataset(12, 3, seed=2, params=SimParams(duration_s=2.0))
    seen = set()
    for tr, te in grouped_folds(rows, 4, seed=0):
        train_ids = {rows[i]["config_id"] for i in tr}
        test_ids = {rows[i]["config_id"] for i in te}
        assert not train_ids & test_ids
        seen |= test_ids
    assert seen == {r["config_id"] for r in rows}


def test_smape():
    assert smape([1, 2], [1, 2]) == 0
    assert smape([110], [90]) == pytest.approx(0.2)


@pytest.fixture(scope="module")
def trained():
    rows = simulate_dataset(30, 2, seed=3, params=SimParams(duration_s=3.0))
    cv = grouped_cv(rows, "rf", 4, seed=0)
    m = PerfModel("rf").fit(rows)
    m.residual_q = {t: cv[t]["residual_q05_q95"] for t in ("throughput_tps", "success_rate")}
    return rows, cv, m


def test_models_learn_beyond_a_mean(trained):
    rows, cv, _ = trained
    tps = np.array([r["throughput_tps"] for r in rows])
    assert cv["throughput_tps"]["smape"] < 0.5 * smape(np.full_like(tps, tps.mean()), tps)
    xgb = grouped_cv(rows, "xgb", 4, seed=0)
    assert xgb["throughput_tps"]["smape"] < 0.5 * smape(np.full_like(tps, tps.mean()), tps)


def test_recommender_meets_constraint_and_is_cheapest(trained, tmp_path):
    _, _, m = trained
    wl = {
        "send_rate_tps": 300.0,
        "read_fraction": 0.2,
        "block_size": 50,
        "batch_timeout_s": 1.0,
        "endorsement": "MAJORITY",
    }
    target = 0.6 * wl["send_rate_tps"]  # short simulated rounds include the last block's drain
    rec = recommend(m, wl, target, 0.9, Costs())
    assert rec is not None
    assert rec.predicted["throughput_tps"] >= target and rec.predicted["success_rate"] >= 0.9
    lo, hi = rec.interval["throughput_tps"]
    assert lo <= rec.predicted["throughput_tps"] <= hi
    cands = candidates(wl, m.space)
    pred = m.predict(cands)
    costs = Costs()
    cheaper_ok = [
        c
        for i, c in enumerate(cands)
        if costs.of(c) < rec.cost - 1e-9 and pred["throughput_tps"][i] >= target and pred["success_rate"][i] >= 0.9
    ]
    assert not cheaper_ok
    cons = recommend(m, wl, target, 0.9, Costs(), conservative=True)
    assert cons is None or cons.cost >= rec.cost
    assert recommend(m, wl, 1e9, 0.9) is None
    m.save(tmp_path / "m.pkl")
    again = PerfModel.load(tmp_path / "m.pkl")
    assert np.allclose(again.predict(cands[:5])["throughput_tps"], m.predict(cands[:5])["throughput_tps"])


def test_level_holdout_never_trains_on_the_held_out_level(monkeypatch):
    from sysprdict.blockchain import models as M
    from sysprdict.blockchain.fabricsim import SimParams, simulate_dataset

    rows = simulate_dataset(20, 1, 0, SimParams(duration_s=2.0))
    for r in rows:  # throughput exactly half the offered load: the constant baseline is exact
        r["throughput_tps"] = 0.5 * r["send_rate_tps"]
    seen = []
    fit = M.PerfModel.fit

    def spy(self, train):
        seen.append(train)
        return fit(self, train)

    monkeypatch.setattr(M.PerfModel, "fit", spy)
    lv = M.level_holdout(rows, ("constant", "linear"), ("peer_cpus", "send_rate_tps", "block_size"))
    assert lv["not_varied"] == ["block_size"]
    assert lv["factors"]["peer_cpus"]["levels"] == sorted({r["peer_cpus"] for r in rows})
    assert lv["models"]["constant"]["throughput_tps"] == pytest.approx(0.0, abs=1e-12)
    n_levels = sum(len(f["levels"]) for f in lv["factors"].values())
    assert len(seen) == 2 * n_levels
    # each fit saw every level of its factor but one
    levels = [(f, lv_) for f, v in lv["factors"].items() for lv_ in v["levels"] for _ in (0, 1)]
    for (factor, held), train in zip(levels, seen):
        assert held not in {r[factor] for r in train}
    with pytest.raises(ValueError, match="two or more levels"):
        M.level_holdout(rows, ("constant",), ("block_size",))


def test_capped_throughput_follows_capacity_beyond_the_training_levels():
    from sysprdict.blockchain import models as M
    from sysprdict.blockchain.fabricsim import SimParams, simulate_dataset

    rows = simulate_dataset(20, 1, 0, SimParams(duration_s=2.0))
    for r in rows:  # every network saturates at 10 TPS per peer core
        r["throughput_tps"] = min(r["send_rate_tps"], 10.0 * r["peers"] * r["peer_cpus"])
    train = [r for r in rows if r["peer_cpus"] > 1]
    # a held-out level with one core per peer, loaded far above what it can serve
    test = [r | {"peer_cpus": 1.0, "send_rate_tps": 2000.0} for r in train]
    want = np.array([10.0 * r["peers"] for r in test])
    capped = M.PerfModel("et-cap").fit(train).predict(test)["throughput_tps"]
    plain = M.PerfModel("et").fit(train).predict(test)["throughput_tps"]
    assert smape(capped, want) < 0.02
    assert smape(plain, want) > 0.3  # the share of the offered load that succeeds does not extrapolate
    assert set(M.PerfModel("et-cap").fit(train).predict(test)) == set(M.TARGETS)
