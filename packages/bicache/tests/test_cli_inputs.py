"""Malformed command lines: exit 2, one message naming the option, no traceback, nothing created;
every case is answered before a model is trained or loaded."""

from __future__ import annotations

import pytest

from bicache.cli import main
from hwtopo.testing import assert_fails, assert_version, scratch_tree

# (argv with {tmp} for the test's directory, text the message must contain)
CASES = [
    ("serve --port 0", "--port must be an integer >= 1 and <= 65535"),
    ("serve --port 65536", "--port"),
    ("serve --port 1e30", "--port"),
    ("serve --port -1", "--port"),
    ("serve --port http", "--port"),
    ("serve --max-batch 0", "--max-batch"),
    ("serve --max-batch 1e12", "--max-batch"),
    ("serve --max-batch nan", "--max-batch"),
    ("serve --bound -0.1", "--bound must be a number >= 0"),
    ("serve --bound nan", "--bound"),
    ("serve --bound inf", "--bound"),
    ("serve --bound 1e30", "--bound"),
    ("serve --mode fast", "--mode"),
    ("serve --host 0.0.0.0", "--token"),
    ("serve --checkpoint {tmp}/missing", "--checkpoint"),
    ("serve --checkpoint {tmp}/file", "--checkpoint '{tmp}/file' is not a directory"),
    ("calibrate --bound x", "--bound"),
    ("calibrate --checkpoint {tmp}/missing", "--checkpoint"),
    ("calibrate --json {tmp}/missing/c.json", "--json '{tmp}/missing/c.json': directory"),
    ("calibrate --json {tmp}/dir", "--json '{tmp}/dir' is a directory"),
    ("bench --json {tmp}/missing/b.json", "--json"),
    ("bench --json {tmp}/dir", "--json"),
    ("bench --bound -1", "--bound"),
    ("bench --bogus", "unrecognized arguments"),
    ("demo --out {tmp}/missing/a/b", "--out"),
    ("demo --out {tmp}/file", "--out '{tmp}/file' exists and is not a directory"),
    ("train --checkpoint {tmp}/missing", "--checkpoint"),
    ("nosuch", "invalid choice"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("BICACHE_TOKEN", raising=False)
    return scratch_tree(tmp_path)


@pytest.mark.parametrize("argv, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(argv, needle, tmp):
    assert_fails(main, argv, 2, needle, tmp=tmp, prog="bicache")


def test_version_and_options_after_the_command():
    assert_version(main, "bicache")
    assert main(["serve", "--quiet", "--debug", "--port", "0"]) == 2
