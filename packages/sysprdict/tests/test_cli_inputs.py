"""Malformed command lines: exit 2 (bad input) or 1 (a bad data file), one message naming the option,
no traceback, nothing created, and no work started (every case answers before profiling or training)."""

from __future__ import annotations

import pytest

from hwtopo.testing import assert_fails
from sysprdict.cli import PRECISIONS, main

# (argv with {tmp} for the test's directory, exit code, text the message must contain)
CASES = [
    ("predict gpt2-xs --batch 1e12", 2, "--batch must be an integer >= 1 and <= 65536"),
    ("predict gpt2-xs --batch 1000000000000", 2, "--batch"),
    ("predict gpt2-xs --batch 0", 2, "--batch"),
    ("predict gpt2-xs --batch -4", 2, "--batch"),
    ("predict gpt2-xs --batch nan", 2, "--batch"),
    ("predict gpt2-xs --seq-len inf", 2, "--seq-len"),
    ("predict gpt2-xs --image-size 1e30", 2, "--image-size"),
    ("predict gpt2-xs --world-size 0", 2, "--world-size"),
    ("predict gpt2-xs --zero-stage 7", 2, "--zero-stage"),
    ("predict gpt2-xs --bandwidth fast", 2, "--bandwidth"),
    ("predict gpt2-xs --bandwidth -1GB/s", 2, "--bandwidth"),
    ("predict gpt2-xs --dataset {tmp}/missing.jsonl", 2, "--dataset"),
    ("predict nosuch-s", 2, "model: 'nosuch-s' is not a known model"),
    ("predict gpt2-xs --precision fp8", 2, "--precision"),
    ('fit --memory "8 parsecs" llama-s', 2, "--memory must be a size from 1 B to 1PiB, e.g. 256MiB, not '8 parsecs'"),
    ("fit llama-s --memory 1e30", 2, "--memory must be a size from 1 B to 1PiB"),
    ("fit llama-s --memory nan", 2, "--memory"),
    ("fit llama-s --memory 0", 2, "--memory"),
    ("fit llama-s --memory 1e400GiB", 2, "--memory"),
    ("fit llama-s --memory 1GiB --margin 1.5", 2, "--margin"),
    ("fit llama-s --memory 1GiB --margin nan", 2, "--margin"),
    ("fit llama-s", 2, "--memory"),
    ("profile --models gpt2-xs --batches 1,x", 2, "--batches"),
    ("profile --models gpt2-xs --batches ,", 2, "--batches"),
    ("profile --models gpt2-xs --precisions fp8", 2, "--precisions"),
    ("profile --models gpt2-xs --world-sizes 16", 2, "--world-sizes"),
    ("profile --models gpt2-xs,nosuch-s", 2, "model: 'nosuch-s'"),
    ("profile --models gpt2-xs --steps 1e9", 2, "--steps"),
    ("profile --models gpt2-xs --rounds -1", 2, "--rounds"),
    ("profile --seq-len 8", 2, "--seq-len: only apply with --models"),
    ("profile --out {tmp}/dir", 2, "--out"),
    ("profile --models gpt2-xs --out {tmp}/file/p.jsonl", 2, "--out"),
    ("bench --json {tmp}/missing/b.json", 2, "--json"),
    ("bench --save-dataset {tmp}/dir", 2, "--save-dataset"),
    ("bench --dataset {tmp}/missing.jsonl", 2, "--dataset"),
    ("bench --dataset {tmp}/dir", 2, "--dataset '{tmp}/dir' is not a file"),
    ("bench --dataset {tmp}/garbage.jsonl", 1, "garbage.jsonl:1"),
    ("bench --dataset {tmp}/binary.jsonl", 1, "binary.jsonl: not UTF-8 text"),
    ("demo --out {tmp}/missing/a/b", 2, "--out"),
    ("demo --out {tmp}/file", 2, "--out"),
    ("blockchain-bench --json {tmp}/missing/b.json", 2, "--json"),
    ("blockchain-bench --json {tmp}/dir", 2, "--json"),
    ("blockchain-bench --seed 1.5", 2, "--seed"),
    ("blockchain-bench --seed 1e30", 2, "--seed"),
    ("blockchain-bench --data {tmp}/missing.csv", 2, "--data"),
    ("blockchain-bench --data {tmp}/runs.csv", 1, "runs.csv"),
    ("blockchain-demo --out {tmp}/file", 2, "--out"),
    ("blockchain-demo --seed inf", 2, "--seed"),
    ("--quiet nosuch-command", 2, "invalid choice"),
]


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "garbage.jsonl").write_text("garbage\n")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01")
    (tmp_path / "runs.csv").write_text("peers,orderers\n2,1\n")
    return tmp_path


@pytest.mark.parametrize("argv, code, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(argv, code, needle, tmp):
    assert_fails(main, argv, code, needle, tmp=tmp, prog="sysprdict")


def test_cli_precisions_are_the_predictors():
    from sysprdict.layers import PRECISIONS as LAYERS_PRECISIONS

    assert PRECISIONS == LAYERS_PRECISIONS


def test_version_and_common_options_after_the_command(capsys):
    assert main(["--version"]) == 0
    assert "sysprdict 0.1.0" in capsys.readouterr().out
    assert main(["blockchain-bench", "--quiet", "--debug", "--json", "/nonexistent-dir/b.json"]) == 2
