"""Characterization: a tiny grid end to end, its breakdown arithmetic, the report and plots."""

import asyncio

import pytest

from agentdyn.characterize import CharacterizeConfig, characterize
from agentdyn.report import characterize_markdown, plot_characterize, write_report


@pytest.mark.slow
def test_tiny_grid_report_and_plots(tmp_path):
    cfg = CharacterizeConfig(concurrency=(1, 2), llm_ttft_s=(0.05,), cores=(1,), types=("web_search",), mixed=False)
    out = asyncio.run(characterize(cfg))
    rows = out["rows"]
    assert [(r["concurrency"], r["task_type"]) for r in rows] == [(1, "web_search"), (2, "web_search")]
    for r in rows:
        assert r["failed"] == 0 and r["n"] == r["concurrency"]
        parts = (
            r["llm_wait_s"]
            + r["queue_s"]
            + r["tool_cpu_s"]
            + r["tool_cpu_contention_s"]
            + r["tool_io_other_s"]
            + r["other_s"]
        )
        assert parts == pytest.approx(r["latency_s"], rel=0.05, abs=0.05)  # the parts add up
        assert r["tool_cpu_s"] > 0 and r["llm_wait_s"] > 0
    assert out["classes"]["web_search"]["cpu_s"] > 0
    md = characterize_markdown(out)
    assert "| 1 | 0.05 | web_search | 2 | web_search |" in md
    plots = plot_characterize(out, str(tmp_path))
    assert len(plots) == 1 and (tmp_path / "breakdown-1core-ttft0.05.png").stat().st_size > 1000
    write_report(str(tmp_path / "report.md"), "t", md, plots)
    assert "![breakdown-1core-ttft0.05.png]" in (tmp_path / "report.md").read_text()


def test_config_validation():
    with pytest.raises(ValueError, match="concurrency"):
        CharacterizeConfig(concurrency=(0,))


def test_plots_are_skipped_not_fatal_without_matplotlib(monkeypatch, tmp_path):
    """A missing [plot] extra costs the plots, never the measured results written before them."""
    from agentdyn.report import plot_bench
    from hwtopo import console

    monkeypatch.setattr(console, "pyplot", lambda package: None)
    assert plot_characterize({"rows": []}, str(tmp_path)) == []
    assert plot_bench({"results": {}}, str(tmp_path / "latency.png")) is None
    assert list(tmp_path.iterdir()) == []
