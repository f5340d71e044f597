"""Command line: `run` answers a request and reports a dead LLM as a runtime failure (bad input:
test_cli_inputs.py)."""

import json
import subprocess
import sys

from agentdyn.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    """``agentdyn --quiet run ... --policy native --site-pages 20`` in a fresh interpreter."""
    argv = [sys.executable, "-m", "agentdyn", "--quiet", "run", *args, "--policy", "native", "--site-pages", "20"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_run_one_request_in_process():
    p = _run("web_search", "--input", '{"searches": 0}', "--ttft", "0.01")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] and out["task_type"] == "web_search" and out["policy"] == "native"


def test_run_reports_llm_down_as_runtime_failure(free_port):
    p = _run("coding", "--llm-base-url", f"http://127.0.0.1:{free_port}/v1", "--llm-retries", "0")
    assert p.returncode == 1
    assert "failed after 1 attempt(s)" in json.loads(p.stdout)["error"]


def test_serve_beyond_loopback_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("AGENTDYN_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--token" in err[0]


def test_bench_json_envelope_on_a_fixed_result(tmp_path, monkeypatch):
    # the bench's JSON layer on a fixed result: the shared keys first, agentdyn's own after them
    import agentdyn.bench
    import agentdyn.report

    async def fake_bench(cfg, **kw):
        return {"results": {"baseline": {"p50_s": 1.0}}, "headline": {"speedup": 1.5}, "order": ["baseline"]}

    monkeypatch.setattr(agentdyn.bench, "bench", fake_bench)
    monkeypatch.setattr(agentdyn.report, "bench_table", lambda out: "table")
    assert main(["bench", "--quick", "--json", str(tmp_path / "b.json"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert list(doc) == [
        *("package", "version", "config", "machine", "results", "headline", "emulated", "profiles", "classes"),
        "order",
        *("loads", "host", "service", "sandbox", "wall_s", "sampler_overhead", "group_watcher_overhead", "note"),
    ]
    assert doc["package"] == "agentdyn" and doc["headline"] == {"speedup": 1.5} and doc["order"] == ["baseline"]
    assert doc["config"]["quick"] is True and doc["config"]["repeats"] == 1 and doc["emulated"]["llm"]
