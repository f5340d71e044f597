import json

import pytest

from hwtopo.testing import assert_plot_skipped
from kvpool.cli import main


@pytest.mark.slow
def test_bench_json_has_the_headline_keys(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(
        [
            "--quiet",
            "bench",
            "--quick",
            "--tokens",
            "288",
            "--layers",
            "2",
            "--reps",
            "1",
            "--small-chunks",
            "64",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    for key in (
        "ttft_ratio_vs_best_equal_bw",
        "ttft_ratio_vs_best_equal_bw_raw",
        "get_chunk_bw_ratio_vs_torch_load",
        "ttft_ratio_vs_serial_one_disk_emulated",
        "page_cache_bytes_passthrough",
        "emulated_run_valid",
        "fs_time_ratio_vs_files_small_chunks",
    ):
        assert key in res["headline"] and key in res["headline_labels"]
    assert "emulated" in res["headline_labels"]["ttft_ratio_vs_best_equal_bw"]
    emu = res["results"]["emulated"]
    assert set(emu["baselines"]) == {"serial_one_disk", "serial_all_disks", "buffered_all_disks", "layerwise_all_disks"}
    assert emu["baselines"]["serial_all_disks"]["disks"] == res["config"]["ssds"]
    assert emu["best_equal_bw_baseline"] != "serial_one_disk" and emu["in_memory_ttft_s"] > 0
    assert emu["emulation_check"]["emulated"] and emu["emulation_check"]["devices"]
    mixed = res["results"]["emulated_mixed_speed"]
    assert mixed["ssd_read_caps"] == [200e6, 200e6, 100e6, 100e6] and mixed["ssds"] == 4
    caps = {d: v["cap_read_bytes_per_s"] for d, v in mixed["emulation_check"]["devices"].items()}
    assert caps["kvpool.ssd0"] == caps["layerwise_all_disks.disk0"] == 200e6
    assert caps["kvpool.ssd3"] == caps["layerwise_all_disks.disk3"] == 100e6
    for tag in ("mixed_speed", "io_bound"):
        for key in (f"ttft_ratio_vs_best_equal_bw_{tag}", f"emulated_run_valid_{tag}"):
            assert key in res["headline"] and "emulated" in res["headline_labels"][key]
    assert res["results"]["emulated_io_bound"]["ssd_read_caps"] == [100e6] * 4
    small = res["results"]["small_chunks"]
    assert small["files"] == 64 and small["median"]["kvpool_calls"] == 0 and small["median"]["files_calls"] > 0
    assert "virtio" in res["notes"]["why_not_84pct_in_filesystem"]
    assert res["package"] == "kvpool" and res["emulated"]["devices"]
    assert res["results"]["emulated"]["max_abs_logit_diff_vs_recompute"] < 1e-4
    assert res["results"]["raw"]["emulation"] is False
    assert not any((tmp_path / "w").glob("*/ssd0/kvpool.slab"))  # cleaned up
    assert "| kvpool " in capsys.readouterr().out


@pytest.mark.slow
def test_demo_writes_report_and_plot(tmp_path):
    rc = main(
        ["--quiet", "demo", "--out", str(tmp_path / "d"), "--tokens", "288", "--layers", "2", "--reps", "1"]
        + ["--small-chunks", "0"]
    )
    assert rc == 0
    report = (tmp_path / "d" / "report.md").read_text()
    assert "emulated" in report and "ttft_ratio_vs_best_equal_bw" in report
    assert (tmp_path / "d" / "bandwidth.png").stat().st_size > 0


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, caplog):
    # a missing optional extra is reported with the install hint instead of silently skipping the plot
    from kvpool.cli import _plot

    assert_plot_skipped(lambda p: _plot({}, p), tmp_path / "p.png", "kvpool", monkeypatch, caplog)
