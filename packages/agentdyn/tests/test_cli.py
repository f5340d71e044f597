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
