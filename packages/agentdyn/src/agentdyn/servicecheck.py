"""Requests lost by the real HTTP service under load with malformed requests mixed in.

``lost_requests`` starts ``agentdyn serve`` (a bearer token, loopback, its own temporary directory),
sends ``n`` requests at once of which a share is malformed (each kind of ``MALFORMED`` in turn), and
accounts every request as *answered* (2xx, or 4xx with an ``error`` message) or *lost* (timeout,
connection reset, 5xx, a 4xx without a message). Once every valid request is in, it sends SIGTERM
under that load: the requests in flight must still be answered, one sent after the signal must
get 503. Then it lists what the stopped service left behind: processes, cgroups named for it,
entries in its temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable

import aiohttp

from hwtopo import cgroups

from .escapes import leftover_processes
from .sandbox import missing_layers

__all__ = ["MALFORMED", "classify", "lost_requests", "service_leftovers"]

# name -> (body bytes, whether to send the token); each a request a careless or hostile client sends
MALFORMED: dict[str, tuple[bytes, bool]] = {
    "truncated_json": (b'{"task_type": "coding", "input": {', True),
    "unknown_task_type": (b'{"task_type": "chess"}', True),
    "bad_input_field": (b'{"task_type": "rag_qa", "input": {"shards": "abc"}}', True),
    "unknown_field": (b'{"task_type": "web_search", "priority": 9}', True),
    "deep_json": (b"[" * 200 + b"]" * 200, True),
    "tool_timeout_above_ceiling": (b'{"task_type": "web_search", "tool_timeout_s": 1e9}', True),
    "oversized_body": (b'{"task_type": "rag_qa", "input": {"question": "' + b"x" * (2 << 20) + b'"}}', True),
    "no_token": (b'{"task_type": "web_search"}', False),
}


def classify(status: int | None, body: bytes) -> str:
    """``answered`` for a 2xx, or a 4xx whose JSON body carries an ``error`` message; else ``lost``
    (no response at all is ``status`` None)."""
    if status is None or status >= 500 or status < 200:
        return "lost"
    if status < 300:
        return "answered"
    if status < 500:
        try:
            msg = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return "lost"
        return "answered" if isinstance(msg, str) and msg.strip() else "lost"
    return "lost"


def service_leftovers(pid: int, tmp: str) -> list[str]:
    """What a stopped service (process ``pid``, temporary directory ``tmp``) left: cgroups named for
    it, entries in ``tmp``, processes of its sandbox working under ``tmp``."""
    out = [str(g) for h in cgroups._hierarchies() for g in h.root.glob(f"{cgroups.PREFIX}{pid}-*")]
    entries = os.listdir(tmp) if os.path.isdir(tmp) else []
    return out + entries + [f"pid {p}" for p in leftover_processes(under=tmp)]


def _plan(n: int, share: float, seed: int, valid: Callable[[int], dict]) -> list[tuple[str, bytes, bool]]:
    """``n`` requests (kind, body, with token): ``round(n x share)`` malformed at places drawn by
    ``seed``, cycling through ``MALFORMED``; the rest ``valid(i)`` bodies."""
    rng = random.Random(seed)
    bad = set(rng.sample(range(n), round(n * share)))
    kinds = list(MALFORMED)
    out, j = [], 0
    for i in range(n):
        if i in bad:
            kind = kinds[j % len(kinds)]
            j += 1
            out.append((kind, *MALFORMED[kind]))
        else:
            out.append(("valid", json.dumps(valid(i)).encode(), True))
    return out


async def _start(cmd: list[str], env: dict, timeout_s: float) -> tuple[asyncio.subprocess.Process, str]:
    """The service process and its URL, read from its 'serving on' line."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout_s)).decode()
    if "serving on" not in line:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"agentdyn serve did not start (exit {proc.returncode}): {line.strip()!r}")
    return proc, line.split("serving on", 1)[1].split()[0]


async def _send(session: aiohttp.ClientSession, url: str, token: str, body: bytes, auth: bool) -> tuple:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if auth else {})}
    try:
        async with session.post(url + "/v1/agent", data=body, headers=headers) as r:
            return r.status, await r.read(), None
    except asyncio.TimeoutError:
        return None, b"", "timeout"
    except aiohttp.ClientError as e:
        return None, b"", type(e).__name__


async def lost_requests(
    n: int,
    valid_body: Callable[[int], dict],
    malformed_share: float = 0.2,
    seed: int = 0,
    serve_args: tuple[str, ...] = (),
    timeout_s: float = 600.0,
) -> dict:
    """Send ``n`` requests at once to a fresh ``agentdyn serve`` (``serve_args`` added to its command
    line), ``malformed_share`` of them malformed, the others ``valid_body(i)``; each answered or lost
    (see ``classify``). SIGTERM once the valid ones are in: the answer to a request sent after it
    (``sent_after_sigterm``), the exit code, and what the stopped service left (``leftovers``)."""
    if n < 1 or not 0 <= malformed_share <= 1:
        raise ValueError(f"n must be >= 1 and malformed_share in [0, 1], not {n!r}, {malformed_share!r}")
    token = secrets.token_urlsafe(24)
    tmp = tempfile.mkdtemp(prefix="agentdyn-svc-")
    env = dict(os.environ, TMPDIR=tmp, AGENTDYN_TOKEN=token, PYTHONUNBUFFERED="1")
    unsafe = bool(missing_layers())
    cmd = [sys.executable, "-m", "agentdyn", "--quiet", "serve", "--port", "0", *serve_args]
    cmd += ["--unsafe-no-sandbox"] if unsafe else []
    plan = _plan(n, malformed_share, seed, valid_body)
    proc, url = await _start(cmd, env, timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            sent = [asyncio.ensure_future(_send(s, url, token, body, auth)) for _, body, auth in plan]
            valid = sum(kind == "valid" for kind, _, _ in plan)
            late = await _sigterm_when_in(s, url, token, valid, proc, sent, json.dumps(valid_body(0)).encode())
            got = await asyncio.gather(*sent)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            rc = await proc.wait()
    await asyncio.sleep(0.2)
    left = service_leftovers(proc.pid, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    out = _account(plan, got, rc, left, unsafe)
    out["sent_after_sigterm"] = {"status": late[0], "error": late[2], "refused_503": late[0] == 503}
    return out


async def _sigterm_when_in(s, url: str, token: str, valid: int, proc, sent: list, body: bytes) -> tuple:
    """Once the service has accepted ``valid`` requests (or every send has ended), SIGTERM it and,
    once it reports draining, send one more request: the answer to that late request (a 503)."""
    auth = {"Authorization": f"Bearer {token}"}
    while not all(f.done() for f in sent):
        try:
            async with s.get(url + "/v1/stats", headers=auth) as r:
                if (await r.json())["accepted"] >= valid:
                    break
        except (aiohttp.ClientError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    # the signal is handled on the service's event loop: wait until it says it drains
    while proc.returncode is None:
        try:
            async with s.get(url + "/healthz", headers=auth) as r:
                if (await r.json()).get("draining"):
                    break
        except (aiohttp.ClientError, ValueError):
            break  # no longer listening: the drain has already ended
        await asyncio.sleep(0.02)
    return await _send(s, url, token, body, True)


def _account(plan: list, got: list, rc: int, left: list[str], unsafe: bool) -> dict:
    by_status: dict[str, int] = {}
    lost: list[dict] = []
    for (kind, _, _), (status, body, err) in zip(plan, got):
        key = str(status) if status is not None else err or "no response"
        by_status[key] = by_status.get(key, 0) + 1
        if classify(status, body) == "lost":
            lost.append({"kind": kind, "status": status, "error": err, "body": body[:200].decode(errors="replace")})
    return {
        "requests": len(plan),
        "malformed": sum(kind != "valid" for kind, _, _ in plan),
        "answered": len(plan) - len(lost),
        "lost": len(lost),
        "lost_examples": lost[:5],
        "by_status": by_status,
        "sigterm_exit_code": rc,
        "leftovers": left,
        "sandbox": "off (host lacks a layer: --unsafe-no-sandbox)" if unsafe else "strict",
    }
