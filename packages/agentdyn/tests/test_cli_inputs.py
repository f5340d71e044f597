"""Malformed command lines: exit 2, one message naming the option, no traceback, and nothing created;
every case is answered before the harness, emulator or workload starts."""

from __future__ import annotations

import pytest

from agentdyn.cli import main
from hwtopo.testing import assert_fails, assert_version, scratch_tree

# (argv with {tmp} for the test's directory and {{ for a literal brace, text the message must contain)
CASES = [
    ("serve --port 99999", "--port must be an integer >= 0 and <= 65535"),
    ("serve --port -1", "--port"),
    ("serve --port 1e30", "--port"),
    ("serve --drain-timeout nan", "--drain-timeout"),
    ("serve --drain-timeout -5", "--drain-timeout"),
    ("serve --llm-timeout 0", "--llm-timeout"),
    ("serve --llm-timeout inf", "--llm-timeout"),
    ("serve --llm-retries -1", "--llm-retries"),
    ("serve --llm-retries 1e9", "--llm-retries"),
    ("serve --profiles {tmp}/missing/p.json", "--profiles '{tmp}/missing/p.json': directory"),
    ("serve --profiles {tmp}/dir", "--profiles '{tmp}/dir' is not a file"),
    ("serve --host 0.0.0.0", "--token"),
    ("serve --policy greedy", "--policy"),
    ("llm-emulator --port 99999", "--port"),
    ("run coding --profiles {tmp}/file/p.json", "--profiles"),
    ("run coding --site-pages 0", "--site-pages"),
    ("run coding --site-pages 1e30", "--site-pages"),
    ("run coding --tool-timeout -1", "--tool-timeout"),
    ("run coding --ttft nan", "--ttft must be a number >= 0"),
    ("run coding --tokens-per-s 0", "--tokens-per-s"),
    ("run coding --seed -1", "--seed must be an integer >= 0"),
    ("run coding --input [1", "--input"),
    ("run coding --input {{bad", "--input"),
    ("run coding --input " + "[" * 100_000, "--input: JSON nesting is 100000 levels deep"),
    ("run coding --policy optimized --profiles {tmp}/garbage.json", "--profiles: {tmp}/garbage.json: not an agentdyn"),
    ("run painting", "task_type"),
    ("run coding --llm-base-url ftp://x", "--llm-base-url"),
    ("run coding --llm-base-url localhost:1", "--llm-base-url"),
    ("run web_search --site-pages 0", "--site-pages"),
    ("llm-emulator --ttft inf", "--ttft"),
    ("llm-emulator --tokens-per-s -3", "--tokens-per-s"),
    ("bench --quick --ttft -1", "--ttft"),
    ("bench --quick --tool-threads many", "--tool-threads"),
    ("bench --per-type 0", "--per-type"),
    ("bench --per-type 1e12", "--per-type"),
    ("bench --coding-work -1", "--coding-work"),
    ("bench --repeats 0", "--repeats"),
    ("bench --seeds 101,x", "--seeds: '101,x'"),
    ("bench --seeds -1", "--seeds"),
    ("bench --tool-threads 0", "--tool-threads"),
    ("bench --json {tmp}/missing/b.json", "--json '{tmp}/missing/b.json': directory"),
    ("bench --json {tmp}/dir", "--json '{tmp}/dir' is a directory"),
    ("demo --out {tmp}/missing/a", "--out '{tmp}/missing/a': its parent"),
    ("demo --out {tmp}/file", "--out '{tmp}/file' exists and is not a directory"),
    ("characterize --concurrency 1,x", "--concurrency: '1,x'"),
    ("characterize --concurrency a", "--concurrency: 'a'"),
    ("characterize --llm-ttft 0.3,nan", "--llm-ttft"),
    ("characterize --llm-ttft -1", "--llm-ttft: '-1'"),
    ("characterize --cores 0", "--cores: '0'"),
    ("characterize --cores x", "--cores"),
    ("characterize --coding-work 0", "--coding-work"),
    ("characterize --out {tmp}/missing/a", "--out"),
    ("nosuch", "invalid choice"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTDYN_TOKEN", raising=False)
    return scratch_tree(tmp_path, {"garbage.json": b"\xff\xfe not json"})


@pytest.mark.parametrize("argv, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(argv, needle, tmp):
    assert_fails(main, argv, 2, needle, tmp=tmp, prog="agentdyn")


def test_version_and_options_after_the_command():
    assert_version(main, "agentdyn")
    assert main(["bench", "--quiet", "--debug", "--per-type", "0"]) == 2
