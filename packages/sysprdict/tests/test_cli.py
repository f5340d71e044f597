import json

import pytest

from sysprdict.cli import main


def test_fit_and_predict_cli(capsys):
    assert main(["fit", "--memory", "3MiB", "llama-xs", "--seq-len", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["batch"] >= 1 and out["predicted_peak_bytes"] <= 3 * 2**20
    assert main(["predict", "llava-clip-xs", "--batch", "2", "--seq-len", "16", "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["memory"]["peak_bytes"] > pred["accelerate_style_bytes"]


def test_profile_cli_writes_dataset(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    rc = main(
        [
            "--quiet",
            "profile",
            "--models",
            "gpt2-xs",
            "--batches",
            "1",
            "--precisions",
            "fp32",
            "--steps",
            "1",
            "--seq-len",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    from sysprdict.dataset import load_rows

    _, rows = load_rows(out)
    assert len(rows) == 1 and rows[0]["peak_bytes"] > 0


def test_grid_options_without_models_are_a_usage_error(tmp_path, capsys):
    # --batches only applies with --models; silently profiling the built-in grid instead would mislead
    assert main(["profile", "--batches", "1", "--out", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--batches" in err and "--models" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.jsonl").exists()
    assert main(["profile", "--models", "gpt2-xs", "--steps", "0", "--out", str(tmp_path / "p.jsonl")]) == 2
    assert "--steps" in capsys.readouterr().err


def test_blockchain_bench_cli(tmp_path, capsys, monkeypatch):
    import sysprdict.blockchain.evaluate as ev
    from sysprdict.blockchain.fabricsim import SimParams, simulate_dataset

    monkeypatch.setattr(
        ev, "simulate_dataset", lambda n, r, s, p: simulate_dataset(12, 2, s, SimParams(duration_s=2.0))
    )
    out = tmp_path / "b.json"
    assert main(["blockchain-bench", "--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    h = res["headline"]
    assert h["data_source"] == "simulated" and res["emulated"]["simulated"] is True
    # on simulated data every key says so; the held-out-level error stands beside its baselines
    assert all(k.endswith("_simulated") for k in h if k != "data_source")
    for key in ("tps_smape_heldout_level", "tps_smape_heldout_level_constant", "tps_smape_heldout_level_linear"):
        assert 0 <= h[f"{key}_simulated"] < 2
    assert h["tps_heldout_level_over_best_baseline_simulated"] == pytest.approx(
        h["tps_smape_heldout_level_simulated"]
        / min(h["tps_smape_heldout_level_constant_simulated"], h["tps_smape_heldout_level_linear_simulated"])
    )
    lv = res["results"]["heldout_level"]
    assert "peer_cpus" in lv["factors"] and "block_size" in lv["not_varied"]
    # the headline is the configured model's held-out-level error; the random forest's stands beside it
    assert h["tps_smape_heldout_level_simulated"] == lv["models"][ev.HELDOUT_MODEL]["throughput_tps"]
    assert h["tps_smape_heldout_level_rf_simulated"] == lv["models"]["rf"]["throughput_tps"]


def test_blockchain_bad_data_is_one_line_naming_file_row_column(tmp_path, capsys):
    bad = tmp_path / "runs.csv"
    bad.write_text("peers,orderers\n2,1\n")
    assert main(["blockchain-bench", "--data", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "runs.csv" in err and "missing column" in err and len(err.strip().splitlines()) == 1
    rep = tmp_path / "report.json"
    rep.write_text('{"config": {"peers": 2}, "rounds": [{"Name": "r", "Succ": "x"}]}')
    assert main(["blockchain-demo", "--data", str(rep), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "report.json" in err and "round 0" in err and "Traceback" not in err


def _fake_evaluation(**kwargs):
    fams, precs = ["llama", "vit"], ["fp32", "bf16"]
    per = {
        m: {"per_family": {f: 0.1 for f in fams}, "per_precision": {q: 0.2 for q in precs}}
        for m in ("aware", "blind", "analytical")
    }
    tpts = [{"precision": q, "true": 0.01 * (i + 1), "pred": 0.011 * (i + 1)} for i, q in enumerate(precs * 2)]
    mpts = [
        {
            "model": "llava-clip-xs",
            "precision": "fp32",
            "batch": 2,
            "modality": m,
            "true": 2**22,
            "pred": 2**22 + 9,
            "accelerate_style": 2**20,
        }
        for m in ("multimodal", "text")
    ]
    guard = {
        "cases": [
            {
                "model": "llama-xs",
                "limit_bytes": 2**24,
                "batch": 3,
                "predicted_peak_bytes": 2**23,
                "measured_peak_bytes": 2**22,
                "violation": False,
            }
        ]
    }
    return {
        "rows": [],
        "timing": {"families": fams, **per, "points": tpts},
        "memory": {"points": mpts},
        "oom_guard": guard,
        "headline": {"time_mape": 0.09, "oom_guard_violations": 0},
    }


def test_demo_prints_tables_and_writes_report_and_plots(tmp_path, capsys, monkeypatch):
    import sysprdict.evaluate

    monkeypatch.setattr(sysprdict.evaluate, "run_evaluation", _fake_evaluation)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| held-out family " in printed and "| llava-clip-xs " in printed and "| ok " in printed
    report = (out / "report.md").read_text()
    assert "| time_mape " in report and "time_scatter.png" in report
    assert {p.name for p in out.iterdir()} == {"profile.jsonl", "report.md", "time_scatter.png", "memory_scatter.png"}
