import subprocess
import sys

from bicache.cli import main
from hwtopo.testing import assert_fails


def test_module_entry_point_parses_like_main():
    r = subprocess.run([sys.executable, "-m", "bicache", "bench", "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_runtime_error_exits_1_without_traceback(tmp_path):
    # a directory without a checkpoint: the path is fine, loading fails
    argv = ["calibrate", "--checkpoint", str(tmp_path), "--quiet"]
    assert_fails(main, argv, 1, "holds no bicache checkpoint", tmp=tmp_path, prog="bicache")


def test_demo_writes_report_and_drift_plot(tmp_path, capsys, monkeypatch):
    # the demo's own layer (tables, report, plot) on a fixed bench result; the bench has its own tests
    import types

    import bicache.bench
    import bicache.cli

    drift = [[0.0, 0.01], [0.02, 0.05]]
    cal = {"fractions": [0.5, 0.9], "kv": drift, "hidden": drift, "drift": drift, "drift_max": drift}
    res = {
        "results": {"none": {"0.5": {"accuracy": 0.9, "tokens_per_cpu_s": 120.0}}},
        "headline": {"speedup": 1.9},
        "calibration": {**cal, "samples": 4, "num_layers": 2},
        "config": {"drift_bound": 0.03},
        "policy": [{"fraction": 0.5, "depth": 2, "reason": "under the bound"}],
    }
    monkeypatch.setattr(bicache.cli, "_model", lambda args: types.SimpleNamespace(num_layers=2))
    monkeypatch.setattr(bicache.bench, "run_bench", lambda dlm, **kw: res)
    assert main(["demo", "--out", str(tmp_path / "d"), "--quiet"]) == 0
    report = (tmp_path / "d" / "report.md").read_text()
    assert "| none " in report and "| under the bound " in report and "drift.png" in report
    assert (tmp_path / "d" / "drift.png").stat().st_size > 0


def test_bench_json_envelope_on_a_fixed_result(tmp_path, capsys, monkeypatch):
    # the bench's JSON layer on a fixed result: the shared keys first, bicache's own after them
    import json
    import types

    import bicache.bench
    import bicache.cli

    res = {
        "config": {"quick": True},
        "results": {"none": {"0.5": {"accuracy": 0.9, "tokens_per_cpu_s": 120.0}}},
        "headline": {"speedup": 1.9},
        "round_ratios": [1.8, 2.0],
        "calibration": {"samples": 4},
        "policy": [{"fraction": 0.5, "depth": 2}],
    }
    monkeypatch.setattr(bicache.cli, "_model", lambda args: types.SimpleNamespace(num_layers=2))
    monkeypatch.setattr(bicache.bench, "run_bench", lambda dlm, **kw: res)
    assert main(["bench", "--quick", "--suite", "table", "--json", str(tmp_path / "b.json"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert list(doc)[:6] == ["package", "version", "config", "machine", "results", "headline"]
    assert doc["package"] == "bicache" and doc["headline"] == {"speedup": 1.9} and doc["machine"]["machines"]
    assert doc["round_ratios"] == [1.8, 2.0] and doc["emulated"] is False and doc["policy"] == res["policy"]


def test_bench_all_takes_the_headline_from_the_text_seeds(tmp_path, capsys, monkeypatch):
    # suite all: the over-seeds text headline leads, the table model's run sits under table_task
    import json
    import types

    import bicache.bench
    import bicache.cli
    import bicache.textbench

    row = {"0.5": {"accuracy": 0.5, "token_accuracy": 0.6, "tokens_per_cpu_s": 10.0}}
    table = {k: {} for k in ("config", "round_ratios", "calibration", "policy")}
    table.update(results={"nocache": row}, headline={"throughput_ratio_vs_dual_cache": 1.1})
    seed = {k: {} for k in ("config", "round_ratios", "calibration", "policy", "bound_search")}
    seed.update(results={"nocache": row}, headline={}, config={"model": {"arch": "LlamaForCausalLM"}})
    text = {
        "per_seed": {0: seed, 1: seed, 2: seed},
        "results": {"nocache": row},
        "headline": {"safe_depth_all_global": 0},
    }
    monkeypatch.setattr(bicache.cli, "_model", lambda args: types.SimpleNamespace(num_layers=2))
    monkeypatch.setattr(bicache.bench, "run_bench", lambda dlm, **kw: table)
    monkeypatch.setattr(bicache.textbench, "run_text_bench", lambda **kw: text)
    assert main(["bench", "--quick", "--json", str(tmp_path / "b.json"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["headline"] == {"safe_depth_all_global": 0} and doc["config"]["seeds"] == [0, 1, 2]
    assert doc["config"]["suite"] == "text" and set(doc["per_seed"]) == {"0", "1", "2"}
    assert doc["table_task"]["headline"] == {"throughput_ratio_vs_dual_cache": 1.1}
