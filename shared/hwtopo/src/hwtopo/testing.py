"""Test helpers for mlsyskit CLIs: run ``main(argv)`` in-process and check how bad input fails.

    CASES = [("bench --reps 0", 2, "--reps"), ("demo --out {tmp}/missing/a", 2, "--out")]

    @pytest.mark.parametrize("argv, code, needle", CASES)
    def test_bad_input(argv, code, needle, tmp_path):
        hwtopo.testing.assert_fails(main, argv, code, needle, tmp=tmp_path, prog="kvpool")

``{tmp}`` in an argv or needle stands for ``tmp``. A bad input must exit with ``code`` (2 for
usage, 1 for a runtime failure), name what was wrong (``needle``), print no traceback, and leave
``tmp`` as it was: no work started, no directory created.

The same module holds what the packages' safety tests share: a pickle payload that betrays a
loader which executes code (``Payload``), and the loop that sends a corpus of malformed HTTP
requests to a server and checks that every answer is a 4xx without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shlex
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CliResult",
    "run_cli",
    "assert_fails",
    "scratch_tree",
    "assert_version",
    "Payload",
    "Answer",
    "malformed_json",
    "send_requests",
    "assert_client_errors",
    "serve_app",
    "assert_plot_skipped",
]


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


def scratch_tree(root: Path, files: Mapping[str, str | bytes] | None = None) -> Path:
    """``root`` with the paths bad-input cases point at: an empty ``dir/``, a ``file`` holding "x",
    and each of ``files`` (a path relative to ``root``, its parents created) with its content."""
    (root / "dir").mkdir()
    (root / "file").write_text("x")
    for name, content in (files or {}).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def assert_version(main: Callable[[list[str]], int], prog: str, version: str | None = None) -> str:
    """``--version`` exits 0 and prints ``prog <version>``; any version when ``version`` is None."""
    res = run_cli(main, ["--version"])
    line = res.out.strip()
    assert res.code == 0, f"--version exit {res.code}: {res.err[-300:]}"
    if version is None:
        assert line.startswith(f"{prog} "), f"--version printed {line!r}, wanted {prog} <version>"
    else:
        assert line == f"{prog} {version}", f"--version printed {line!r}, wanted {prog} {version}"
    return line


class Payload:
    """Unpickling this runs a shell command that creates ``marker``: a loader that executes code
    from a user's file gives itself away by the marker appearing."""

    def __init__(self, marker: str | os.PathLike):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def malformed_json(field: str) -> list[bytes]:
    """Request bodies no JSON endpoint may accept or fail on with a 500: not JSON, not an object,
    not UTF-8, nested past any limit, numbers JSON has no value for, a lone surrogate, trailing
    junk. ``field`` is the endpoint's main field, so that a body gets as far into it as it can."""
    f = b'"' + field.encode() + b'"'
    return [
        b"",
        b"{",
        b"{not json",
        b"null",
        b"[]",
        b"42",
        f,
        b"\xff\xfe{}",
        b"{" + f + b": NaN}",
        b"{" + f + b": 1e999}",
        b"{" + f + b": " + b"9" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 1000 + b"1" + b"}" * 1000,
        b"{" + f + b': "\\ud800"}',
        b"{" + f + b": " + b"[" * 70 + b"]" * 70 + b"}",
        b"{" + f + b": 1} extra",
        b"{" + f + b": 1,}",
        b"{'" + field.encode() + b"': 1}",
    ]


@dataclass(frozen=True)
class Answer:
    """What a server said to one request of a corpus (``body``: its first 40 bytes)."""

    method: str
    path: str
    body: bytes
    status: int
    text: str


async def send_requests(
    session: Any, corpus: Sequence[tuple[str, str, bytes | None, dict]], base: str = ""
) -> list[Answer]:
    """Send each ``(method, path, body, headers)`` of ``corpus`` through ``session`` (an aiohttp
    ClientSession with ``base`` its server's URL, or an aiohttp TestClient) one after another."""
    out = []
    for method, path, body, headers in corpus:
        async with session.request(method, base + path, data=body, headers=headers) as r:
            out.append(Answer(method, path, (body or b"")[:40], r.status, await r.text()))
    return out


def assert_client_errors(answers: Sequence[Answer]) -> None:
    """Every answer is a 4xx (the request was wrong, not the server) and shows no traceback."""
    for a in answers:
        assert 400 <= a.status < 500, (a.method, a.path, a.body, a.status, a.text)
        assert "Traceback" not in a.text and 'File "' not in a.text, (a.method, a.path, a.body, a.text)


def serve_app(make_app: Callable[[], Any], fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """``fn(client)`` against the aiohttp app ``make_app()`` (built inside the event loop, as
    handlers that hold loop objects need) on a loopback test server; the server is closed after."""
    from aiohttp.test_utils import TestClient, TestServer

    async def main():
        client = TestClient(TestServer(make_app()))
        await client.start_server()
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def assert_plot_skipped(plot: Callable[[Path], Any], path: Path, package: str, monkeypatch: Any, caplog: Any) -> None:
    """With matplotlib missing, ``plot(path)`` returns False, logs the install hint of ``package``'s
    ``plot`` extra (instead of skipping the plot silently) and writes nothing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    caplog.set_level("WARNING", logger="hwtopo.console")  # an earlier --quiet run raised the root level
    assert plot(path) is False
    hint = f"pip install 'mlsyskit-{package}[plot]'"
    assert hint in caplog.text, f"no {hint!r} in the log: {caplog.text[-300:]}"
    assert not path.exists(), f"{path} was written without matplotlib"
