import json

import pytest
from conftest import tiny_model

from hwtopo.testing import assert_plot_skipped
from parser_moe.cli import main


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    tiny_model("qwen2_moe", experts=4).save_pretrained(str(d))
    return d


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "--ratios", "0"], "--ratios must be a number > 0 and <= 1"),
        (["compress", "--out", "x", "--keep", "1.5"], "--keep must be a number > 0 and <= 1"),
        (["bench", "--base", "median"], "--base"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_with_one_message(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err.splitlines()[-1] and "Traceback" not in err


def test_model_without_moe_layers_exits_1(tmp_path, capsys):
    import transformers as T

    cfg = T.LlamaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24
    )
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "llama"))
    assert main(["compress", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: save_pretrained's progress bar
    assert "has no MoE layers" in err and err.startswith("parser-moe: error: ")
    assert not (tmp_path / "o").exists()
    assert main(["bench", "--model", str(tmp_path / "nowhere"), "--quiet"]) == 2
    assert main(["train", "--seeds", "1,x", "--quiet"]) == 2


@pytest.mark.slow
def test_bench_json_has_the_headline_keys(moe_dir, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert (
        main(["bench", "--quick", "--json", str(out), "--model", str(moe_dir), "--ratios", "0.2,0.5", "--quiet"]) == 0
    )
    doc = json.loads(out.read_text())
    assert {"package", "version", "config", "machine", "results", "headline", "spread", "emulated"} <= set(doc)
    h = doc["headline"]
    for k in (
        "gap_ratio_vs_magnitude_reference@0.2",
        "gap_ratio_vs_wanda_reference@0.2",
        "task_acc_drop_reference@0.2",
        "task_acc_drop_wanda@0.2",
        "memory_reduction@0.2",
        "ppl_full",
    ):
        assert isinstance(h[k], float), k
    assert "gap_ratio_vs_wanda" in h  # null when the best variant has no gap at some ratio (random model)
    assert h["memory_equal_across_methods"] is True and h["reference_matches_formula"] is True
    assert h["models"] == 1 and h["best_variant"] in ("reference", "parser", "output_wanda")
    r = doc["results"]
    assert r["reference@0.2"]["expert_bytes"] < r["reference@0.5"]["expert_bytes"] < r["uncompressed"]["expert_bytes"]
    assert h["memory_reduction@0.2"] == pytest.approx(
        1 - r["reference@0.2"]["expert_bytes"] / r["uncompressed"]["expert_bytes"]
    )
    assert h["ppl_full"] == r["uncompressed"]["ppl"]
    # held out: no test file is a dev or calibration file, and the JSON lists them
    splits = doc["config"]["splits"]
    assert splits["test"] and not set(splits["test"]) & (set(splits["dev"]) | set(splits["calib"]))
    assert doc["spread"]["gap_ratio_vs_wanda_reference@0.2"]["per_model"] == [h["gap_ratio_vs_wanda_reference@0.2"]]


@pytest.mark.slow
def test_demo_writes_report_plot_and_reloadable_model(moe_dir, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--model", str(moe_dir), "--ratios", "0.2", "--quiet"]) == 0
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert names == ["gap_vs_memory.png", "parser-keep0.2", "report.md"]
    assert "outputs identical = True" in (tmp_path / "d" / "report.md").read_text()


def test_compress_writes_a_loadable_model(moe_dir, tmp_path, capsys):
    from parser_moe import CompressedExperts, compressed_modules, load_compressed

    out = tmp_path / "c"
    argv = ["compress", "--model", str(moe_dir), "--out", str(out), "--keep", "0.25", "--method", "reference"]
    assert main([*argv, "--quiet"]) == 0
    assert "reduction" in capsys.readouterr().out
    mods = compressed_modules(load_compressed(out))
    assert len(mods) == 2 and all(isinstance(m, CompressedExperts) and m.mode == "units" for m in mods.values())


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, caplog):
    # a missing optional extra is reported with the install hint instead of silently skipping the plot
    from parser_moe.cli import _plot

    assert_plot_skipped(lambda p: _plot({}, p), tmp_path / "p.png", "parser-moe", monkeypatch, caplog)
