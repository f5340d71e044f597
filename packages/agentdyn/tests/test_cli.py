"""Command line: usage errors exit 2 with one line naming the option; `run` answers a request."""

import json
import subprocess
import sys

import pytest

from agentdyn.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "--quick", "--ttft", "-1"], "--ttft"),
        (["bench", "--per-type", "0"], "--per-type"),
        (["bench", "--quick", "--tool-threads", "many"], "--tool-threads"),
        (["run", "painting"], "task_type"),
        (["run", "coding", "--input", "{bad"], "--input"),
        (["run", "coding", "--llm-base-url", "localhost:1"], "--llm-base-url"),
        (["characterize", "--cores", "x"], "--cores"),
        (["run", "web_search", "--site-pages", "0"], "--site-pages"),
        (["characterize", "--concurrency", "a"], "--concurrency: 'a'"),
        (["characterize", "--cores", "0"], "--cores: '0'"),
        (["characterize", "--llm-ttft", "-1"], "--llm-ttft: '-1'"),
    ],
)
def test_usage_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1] and "Traceback" not in err


def test_unknown_command_is_argparse_usage_error():
    assert main(["fly"]) == 2


@pytest.mark.parametrize("cmd", ["serve", "llm-emulator"])
def test_bad_port_is_a_usage_error_before_any_work(cmd, capsys):
    assert main([cmd, "--port", "99999"]) == 2
    assert "--port" in capsys.readouterr().err


def test_run_one_request_in_process():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentdyn",
            "--quiet",
            "run",
            "web_search",
            "--input",
            '{"searches": 0}',
            "--policy",
            "native",
            "--ttft",
            "0.01",
            "--site-pages",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] and out["task_type"] == "web_search" and out["policy"] == "native"


def test_run_reports_llm_down_as_runtime_failure(free_port):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentdyn",
            "--quiet",
            "run",
            "coding",
            "--policy",
            "native",
            "--llm-base-url",
            f"http://127.0.0.1:{free_port}/v1",
            "--llm-retries",
            "0",
            "--site-pages",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert "failed after 1 attempt(s)" in json.loads(p.stdout)["error"]


def test_bench_schedule_alternates_native_and_optimized():
    from agentdyn.bench import _schedule

    assert _schedule(("native", "static", "optimized"), 2) == ["native", "optimized", "optimized", "native", "static"]
    assert _schedule(("static",), 3) == ["static"]


def test_serve_beyond_loopback_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("AGENTDYN_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--token" in err[0]
