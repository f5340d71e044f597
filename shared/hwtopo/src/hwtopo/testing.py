"""Test helpers for mlsyskit CLIs: run ``main(argv)`` in-process and check how bad input fails.

    CASES = [("bench --reps 0", 2, "--reps"), ("demo --out {tmp}/missing/a", 2, "--out")]

    @pytest.mark.parametrize("argv, code, needle", CASES)
    def test_bad_input(argv, code, needle, tmp_path):
        hwtopo.testing.assert_fails(main, argv, code, needle, tmp=tmp_path, prog="kvpool")

``{tmp}`` in an argv or needle stands for ``tmp``. A bad input must exit with ``code`` (2 for
usage, 1 for a runtime failure), name what was wrong (``needle``), print no traceback, and leave
``tmp`` as it was: no work started, no directory created.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CliResult", "run_cli", "assert_fails"]


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


def _argv(argv: str | Sequence[str], tmp: Path | None) -> list[str]:
    words = shlex.split(argv) if isinstance(argv, str) else list(argv)
    return [w.format(tmp=tmp) for w in words] if tmp is not None else words


def run_cli(main: Callable[[list[str]], int], argv: str | Sequence[str], *, tmp: Path | None = None) -> CliResult:
    """``main(argv)`` in this process with stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(_argv(argv, tmp))
        except SystemExit as e:  # a main that exits instead of returning
            code = e.code if isinstance(e.code, int) else 1
    return CliResult(int(code or 0), out.getvalue(), err.getvalue())


def _tree(root: Path | None) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root is not None else []


def assert_fails(
    main: Callable[[list[str]], int],
    argv: str | Sequence[str],
    code: int,
    needle: str,
    *,
    tmp: Path | None = None,
    prog: str | None = None,
) -> CliResult:
    """Assert ``argv`` exits ``code`` with ``needle`` in stderr, no traceback, ``tmp`` unchanged."""
    before = _tree(tmp)
    res = run_cli(main, argv, tmp=tmp)
    want = needle.format(tmp=tmp) if tmp is not None else needle
    assert res.code == code, f"{argv!r}: exit {res.code}, wanted {code}; stderr: {res.err[-500:]}"
    assert want in res.err, f"{argv!r}: {want!r} not in stderr: {res.err[-500:]}"
    assert "Traceback" not in res.err, f"{argv!r} printed a traceback: {res.err[-500:]}"
    if prog is not None:
        assert res.err.strip().splitlines()[-1].startswith(prog), res.err[-300:]
    assert _tree(tmp) == before, f"{argv!r} changed {tmp}: {sorted(set(_tree(tmp)) ^ set(before))}"
    return res
