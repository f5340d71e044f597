"""Malformed command lines: exit 2 (bad input) or 1 (a broken checkpoint), one message naming the
option or file, no traceback, and nothing created (the checks run before any model is loaded)."""

from __future__ import annotations

import pytest

from hwtopo.testing import assert_fails, assert_version, scratch_tree
from parser_moe.cli import main

# (argv with {tmp} for the test's directory, exit code, text the message must contain)
CASES = [
    ("bench --ratios 0", 2, "--ratios must be a number > 0 and <= 1, not '0'"),
    ("bench --ratios nan", 2, "--ratios"),
    ("bench --ratios inf", 2, "--ratios"),
    ("bench --ratios 1e30", 2, "--ratios"),
    ("bench --ratios -0.1", 2, "--ratios"),
    ("bench --ratios ,", 2, "--ratios needs at least one keep ratio"),
    ("bench --ratios 0.1,abc", 2, "--ratios"),
    ("bench --threads 0", 2, "--threads must be an integer >= 1"),
    ("bench --threads 1e9", 2, "--threads"),
    ("bench --threads two", 2, "--threads"),
    ("bench --seed -1", 2, "--seed"),
    ("bench --seed 1.5", 2, "--seed"),
    ("bench --base median", 2, "--base"),
    ("bench --json {tmp}/missing/b.json", 2, "--json '{tmp}/missing/b.json': directory"),
    ("bench --json {tmp}/dir", 2, "--json '{tmp}/dir' is a directory"),
    ("bench --model {tmp}/missing", 2, "--model"),
    ("demo --out {tmp}/missing/a/b", 2, "--out"),
    ("demo --out {tmp}/file", 2, "--out '{tmp}/file' exists and is not a directory"),
    ("demo --ratios 2", 2, "--ratios"),
    ("compress", 2, "--out"),
    ("compress --out {tmp}/o --keep 0", 2, "--keep must be a number > 0 and <= 1"),
    ("compress --out {tmp}/o --keep nan", 2, "--keep"),
    ("compress --out {tmp}/o --keep 2", 2, "--keep"),
    ("compress --out {tmp}/o --keep -1", 2, "--keep"),
    ("compress --out {tmp}/o --keep 1e-400", 2, "--keep"),
    ("compress --out {tmp}/missing/o", 2, "--out '{tmp}/missing/o': directory"),
    ("compress --out {tmp}/file", 2, "--out"),
    ("compress --out {tmp}/file/o", 2, "--out"),
    ("compress --out {tmp}/o --method best", 2, "--method"),
    ("compress --out {tmp}/o --model {tmp}/missing", 2, "--model"),
    ("compress --out {tmp}/o --model {tmp}/dir", 2, "--model '{tmp}/dir': no config.json"),
    ("compress --out {tmp}/o --model {tmp}/file", 2, "--model"),
    ("compress --out {tmp}/o --model {tmp}/broken --quiet", 1, "config.json"),
    ("--debug nosuch", 2, "invalid choice"),
]


@pytest.fixture
def tmp(tmp_path):
    return scratch_tree(tmp_path, {"broken/config.json": "{not json"})


@pytest.mark.parametrize("argv, code, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(argv, code, needle, tmp):
    assert_fails(main, argv, code, needle, tmp=tmp, prog="parser-moe")


def test_version():
    assert_version(main, "parser-moe", "0.1.0")
