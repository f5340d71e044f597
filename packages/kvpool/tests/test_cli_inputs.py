"""Malformed command lines: exit 2, one message naming the option, no traceback, and nothing created
(not even a parent of --workdir or --out); every case is answered before a model or pool is built."""

from __future__ import annotations

import pytest

from hwtopo.testing import assert_fails, assert_version, scratch_tree
from kvpool.cli import main

# (argv with {tmp} for the test's directory, text the message must contain)
CASES = [
    ("bench --tokens 0", "--tokens must be an integer >= 1"),
    ("bench --tokens 1e30", "--tokens"),
    ("bench --tokens nan", "--tokens"),
    ("bench --tokens -5", "--tokens"),
    ("bench --tokens 2000000", "--tokens"),
    ("bench --layers 0", "--layers"),
    ("bench --layers 1000", "--layers"),
    ("bench --reps inf", "--reps"),
    ("bench --ssds 0", "--ssds"),
    ("bench --ssds 1000", "--ssds"),
    ("bench --ssd-cap fast", "--ssd-cap"),
    ("bench --ssd-cap -1MB/s", "--ssd-cap"),
    ("bench --ssd-cap 1e400MB/s", "--ssd-cap"),
    ("bench --io-backend mmap", "--io-backend"),
    ("bench --quick --tokens 100", "tokens must exceed chunk_tokens"),
    ("bench --json {tmp}/missing/b.json", "--json '{tmp}/missing/b.json': directory"),
    ("bench --json {tmp}/dir", "--json '{tmp}/dir' is a directory"),
    ("bench --workdir {tmp}/a/b/c", "--workdir '{tmp}/a/b/c': its parent"),
    ("bench --workdir {tmp}/file", "--workdir '{tmp}/file' exists and is not a directory"),
    ("bench --quick --workdir /proc/no-such-dir", "--workdir"),
    ("demo --out {tmp}/missing/a", "--out"),
    ("demo --out {tmp}/file", "--out"),
    ("serve --port 99999", "--port must be an integer >= 0 and <= 65535"),
    ("serve --port -1", "--port"),
    ("serve --port x", "--port"),
    ("serve --memory-modules -1", "--memory-modules must be an integer >= 0 and <= 64"),
    ("serve --memory-modules 1e3", "--memory-modules"),
    ("serve --memory-bytes 1e400GiB", "--memory-bytes"),
    ("serve --memory-bytes 0", "--memory-bytes"),
    ("serve --ssd-bytes nan", "--ssd-bytes"),
    ("serve --layout bad", "--layout"),
    ("serve --memory-modules 0", "serve needs at least one --ssd"),
    ("serve --ssd {tmp}/missing/ssd0", "--ssd '{tmp}/missing/ssd0': its parent"),
    ("serve --ssd {tmp}/file", "--ssd"),
    ("serve --host 0.0.0.0", "--token"),
    ("nosuch", "invalid choice"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    return scratch_tree(tmp_path)


@pytest.mark.parametrize("argv, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(argv, needle, tmp):
    assert_fails(main, argv, 2, needle, tmp=tmp, prog="kvpool")


def test_version_and_options_after_the_command():
    assert_version(main, "kvpool")
    assert main(["bench", "--quiet", "--debug", "--tokens", "0"]) == 2
