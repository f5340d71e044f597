"""The HTTP service: validation (400/422), LLM down (502), hung tools, 200 concurrent, SIGTERM drain."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from agentdyn.emulator import EmulatorConfig
from agentdyn.llm import LLMConfig
from agentdyn.monitor import SystemSampler
from agentdyn.runtime import Harness
from agentdyn.sandbox import SandboxUnavailable, missing_layers, zombie_children
from agentdyn.service import make_app
from agentdyn.servicecheck import service_leftovers
from hwtopo.testing import assert_client_errors, malformed_json, send_requests

# a host without every sandbox layer (CI runners are not root) serves with --unsafe-no-sandbox
UNSAFE = bool(missing_layers())


@contextlib.asynccontextmanager
async def _served(h: Harness, **app_kw):
    """``h`` behind the HTTP service on a free loopback port: yields the base URL, stops both after."""
    await h.start()
    runner = web.AppRunner(make_app(h, **app_kw), access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await h.stop()


def _fast():
    return EmulatorConfig(ttft_s=0.05, ttft_sigma=0.0, tokens_per_s=2000, tps_sigma=0.0)


def test_malformed_and_unknown_requests():
    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        out = []
        async with _served(h) as url, aiohttp.ClientSession() as s:
            for body in [
                b"{not json",
                b"[1,2]",
                b'{"input": {}}',
                b'{"task_type": 3}',
                b'{"task_type": "coding", "input": 5}',
                b'{"task_type": "coding", "tool_timeout_s": -1}',
                b'{"task_type": "coding", "colour": 1}',
                b'{"task_type": "painting"}',
            ]:
                async with s.post(url + "/v1/agent", data=body) as r:
                    out.append((r.status, await r.json()))
        return out

    out = asyncio.run(go())
    fields = [(st, b.get("field")) for st, b in out]
    assert fields == [
        (400, "body"),
        (400, "body"),
        (400, "task_type"),
        (400, "task_type"),
        (400, "input"),
        (400, "tool_timeout_s"),
        (400, "colour"),
        (422, "task_type"),
    ]
    assert "one of rag_qa, web_search, coding" in out[-1][1]["error"]


def test_llm_down_gives_clear_per_request_error(free_port):
    async def go():
        llm = LLMConfig(base_url=f"http://127.0.0.1:{free_port}/v1", retries=1, backoff_s=0.01, timeout_s=1)
        h = Harness(llm=llm, site_pages=30)
        async with _served(h) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/agent", json={"task_type": "rag_qa"}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 502 and body["ok"] is False
    assert body["error"].startswith("llm:") and "failed after 2 attempt(s)" in body["error"]


@pytest.mark.slow
def test_hung_tool_is_killed_and_the_request_still_answers():
    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        async with _served(h) as url, aiohttp.ClientSession() as s:
            body = {"task_type": "coding", "input": {"variant": "hang", "work": 500}, "tool_timeout_s": 25}
            async with s.post(url + "/v1/agent", json=body) as r:
                return r.status, await r.json()

    status, body = asyncio.run(go())
    # the agent answered, but a tool call failed: the request is not ok, and says which and why
    assert status == 500 and body["ok"] is False, body
    assert body["error"].startswith("tool 'run_tests' failed: tool 'run_tests' timed out after 25s")
    tools = [e for e in body["timeline"] if e["phase"] == "tool"]
    assert [e["tool"] for e in tools] == ["repo_init", "run_tests", "read_file", "apply_patch", "run_tests"]
    assert tools[1]["ok"] is True and tools[1]["killed"] is False  # buggy tests run and fail
    # the limit covers every tool of the request, the first real pytest run too (two interpreter starts and a
    # collection: a few seconds on a loaded 2-core machine), so it is not tight; only the hung run reaches it
    assert tools[-1]["killed"] is True and "timed out after 25s" in tools[-1]["error"]
    assert zombie_children() == []


@pytest.mark.slow
def test_holds_200_concurrent_requests():
    async def go():
        h = Harness(emulator=_fast(), site_pages=30, sampler=SystemSampler(0.1).start())
        gate = asyncio.Event()
        try:
            async with _served(h) as url, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                h.emulator.gate = gate  # the LLM answers nobody until all 200 requests are in flight

                async def one(i):
                    # most answer from the model; every 20th also runs a (real, sandboxed) search
                    inp = {"searches": 1, "pages": 2} if i % 20 == 0 else {"searches": 0}
                    body = {"task_type": "web_search", "input": inp, "request_id": f"r{i}"}
                    async with s.post(url + "/v1/agent", json=body) as r:
                        return r.status, await r.json()

                async def opener():
                    while h.runtime.inflight < 200:
                        await asyncio.sleep(0.01)
                    gate.set()
                    return h.runtime.inflight

                op = asyncio.create_task(opener())
                res = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 300)
                peak = await op
                async with s.get(url + "/v1/stats") as r:
                    stats = await r.json()
                return res, peak, stats
        finally:
            h.sampler.stop()

    res, peak, stats = asyncio.run(go())
    assert peak == 200  # all 200 were held in flight at once
    assert [st for st, _ in res] == [200] * 200
    assert sorted(b["request_id"] for _, b in res) == sorted(f"r{i}" for i in range(200))
    assert sum(1 for _, b in res if b["usage"]["tool_calls"] == 1) == 10
    assert stats["completed"] == 200 and stats["failed"] == 0


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(free_port, tmp_path):
    # its work root, sandbox state and probes go to tmp_path, which must be empty once it stops
    # with a token, as the service is run: the refusal while draining is a 503, not a 401
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path), AGENTDYN_TOKEN="drain-test-token")
    auth = {"Authorization": "Bearer drain-test-token"}
    cmd = [
        sys.executable,
        "-m",
        "agentdyn",
        "--quiet",
        "serve",
        "--port",
        str(free_port),
        "--policy",
        "native",
        "--ttft",
        "3",
        "--site-pages",
        "30",
    ] + (["--unsafe-no-sandbox"] if UNSAFE else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "serving on" in line, line + p.stderr.read()
        url = f"http://127.0.0.1:{free_port}"

        def post(i):
            req = urllib.request.Request(
                url + "/v1/agent",
                data=json.dumps({"task_type": "web_search", "input": {"searches": i % 2}}).encode(),
                method="POST",
                headers=auth,
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        def accepted():
            with urllib.request.urlopen(urllib.request.Request(url + "/v1/stats", headers=auth), timeout=10) as r:
                return json.loads(r.read())["accepted"]

        async def go():
            tasks = [asyncio.create_task(asyncio.to_thread(post, i)) for i in range(5)]
            while await asyncio.to_thread(accepted) < 5:  # all five in (waiting on the 3 s LLM)
                await asyncio.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            late = await asyncio.to_thread(post, 5)  # the five still hold the LLM for seconds
            return await asyncio.gather(*tasks), late

        codes, late = asyncio.run(go())
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert codes == [200] * 5 and late == 503
    assert rc == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/healthz", timeout=2)
    assert service_leftovers(p.pid, str(tmp_path)) == []


def test_port_in_use_still_stops_the_harness():
    # serve() must release the emulator, site and LLM session when it cannot bind, not leak them
    import socket

    from agentdyn.service import serve

    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        calls = []
        real_stop = h.stop

        async def stop():
            calls.append("stop")
            await real_stop()

        h.stop = stop
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            with pytest.raises(OSError):
                await serve(h, "127.0.0.1", s.getsockname()[1], unsafe_no_sandbox=UNSAFE)
        return calls

    assert asyncio.run(go()) == ["stop"]


def _corpus() -> list[tuple[str, str, bytes | None, dict]]:
    """(method, path, body, headers) of malformed requests: none of them is a valid agent request."""
    raw = malformed_json("task_type") + [
        b"   ",
        b"[1, 2]",
        b'"coding"',
        b'{"task_type": "coding", "tool_timeout_s": 1e999}',
        b'{"task_type": "coding", "max_steps": ' + b"9" * 5000 + b"}",
        b'{"task_type": "coding", "input": ' + b"[" * 70 + b"]" * 70 + b"}",
        b'{"task_type": "coding",}',
        b"{'task_type': 'coding'}",
    ]
    objs = [
        {},
        {"input": {}},
        {"task_type": None},
        {"task_type": 3},
        {"task_type": ["coding"]},
        {"task_type": {"name": "coding"}},
        {"task_type": "painting"},
        {"task_type": "CODING"},
        {"task_type": "x" * 100_000},
        {"task_type": "coding", "input": 5},
        {"task_type": "coding", "input": "{}"},
        {"task_type": "coding", "input": []},
        {"task_type": "coding", "tool_timeout_s": -1},
        {"task_type": "coding", "tool_timeout_s": 0},
        {"task_type": "coding", "tool_timeout_s": 10**30},
        {"task_type": "coding", "tool_timeout_s": "5"},
        {"task_type": "coding", "tool_timeout_s": True},
        {"task_type": "coding", "max_steps": 0},
        {"task_type": "coding", "max_steps": 1.5},
        {"task_type": "coding", "max_steps": 10**30},
        {"task_type": "coding", "max_steps": False},
        {"task_type": "coding", "request_id": "a b"},
        {"task_type": "coding", "request_id": "x" * 65},
        {"task_type": "coding", "request_id": 7},
        {"task_type": "coding", "request_id": "../../etc"},
        {"task_type": "coding", "colour": 1},
    ]
    bodies = raw + [json.dumps(o).encode() for o in objs]
    out = [("POST", "/v1/agent", b, {}) for b in bodies]
    out += [
        ("POST", "/v1/agent", b"task_type=coding", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", "/v1/agent", b"coding", {"Content-Type": "text/plain"}),
        ("POST", "/v1/agent", b"--x\r\n\r\ncoding\r\n--x--", {"Content-Type": "multipart/form-data; boundary=x"}),
        ("POST", "/v1/agent", b" " * ((1 << 20) + 1), {}),
        ("GET", "/v1/agent", None, {}),
        ("PUT", "/v1/agent", b"{}", {}),
        ("DELETE", "/healthz", None, {}),
        ("POST", "/v1/stats", b"{}", {}),
        ("GET", "/v1/agents", None, {}),
        ("GET", "/v1/../../etc/passwd", None, {}),
    ]
    return out


def test_malformed_request_corpus_gets_no_500_and_no_traceback():
    corpus = _corpus()
    assert len(corpus) >= 50

    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        async with _served(h) as url, aiohttp.ClientSession() as s:
            out = await send_requests(s, corpus, url)
            accepted = h.runtime.completed + h.runtime.failed
        return out, accepted

    out, ran = asyncio.run(go())
    assert ran == 0  # nothing malformed reached the agent
    assert_client_errors(out)
    deep = [json.loads(a.text) for a in out if a.body.startswith(b"[[[[")]
    assert deep[0]["field"] == "body" and "100000 levels deep; the limit is 64" in deep[0]["error"]


def test_token_guards_every_route():
    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        out = []
        async with _served(h, token="t0ken") as url, aiohttp.ClientSession() as s:
            for path, headers in (
                ("/healthz", {}),
                ("/v1/stats", {"Authorization": "Bearer t0ke"}),
                ("/healthz", {"Authorization": "Bearer t0ken"}),
            ):
                async with s.get(url + path, headers=headers) as r:
                    out.append((r.status, r.headers.get("WWW-Authenticate")))
            async with s.post(url + "/v1/agent", json={"task_type": "coding"}) as r:
                out.append((r.status, r.headers.get("WWW-Authenticate")))
        return out, h.runtime.completed + h.runtime.failed

    out, ran = asyncio.run(go())
    assert out == [(401, "Bearer"), (401, "Bearer"), (200, None), (401, "Bearer")]
    assert ran == 0


def test_serve_beyond_loopback_without_token_starts_nothing():
    from agentdyn.service import serve

    h = Harness(emulator=_fast(), site_pages=30)
    started = []
    h.start = lambda: started.append(1)
    with pytest.raises(ValueError, match="--token"):
        asyncio.run(serve(h, "0.0.0.0", 0))
    assert started == []


def test_serve_refuses_a_host_without_the_sandbox_unless_told(monkeypatch):
    from agentdyn import service

    monkeypatch.setattr(service, "missing_layers", lambda: {"cgroup pids": "no writable cgroup pids controller"})
    h = Harness(emulator=_fast(), site_pages=30)
    started = []

    async def start():
        started.append(h.isolation)
        raise RuntimeError("started")  # far enough: the sandbox was settled before this

    h.start = start
    with pytest.raises(SandboxUnavailable, match=r"cgroup pids.*--unsafe-no-sandbox"):
        asyncio.run(service.serve(h, "127.0.0.1", 0))
    assert started == []
    with pytest.raises(RuntimeError, match="started"):
        asyncio.run(service.serve(h, "127.0.0.1", 0, unsafe_no_sandbox=True))
    assert started == ["off"]


def test_every_bad_input_field_is_a_400_naming_it():
    cases = [
        ({"task_type": "rag_qa", "input": {"shards": "abc"}}, "input.shards"),
        ({"task_type": "rag_qa", "input": {"shards": 0}}, "input.shards"),
        ({"task_type": "rag_qa", "input": {"shard": 4, "shards": 4}}, "input.shard"),
        ({"task_type": "rag_qa", "input": {"question": "q" * 900_000}}, "input.question"),
        ({"task_type": "rag_qa", "input": {"question": "  "}}, "input.question"),
        ({"task_type": "web_search", "input": {"query": 5}}, "input.query"),
        ({"task_type": "web_search", "input": {"pages": 10**6}}, "input.pages"),
        ({"task_type": "web_search", "input": {"question": "q"}}, "input.question"),
        ({"task_type": "coding", "input": {"work": 10**9}}, "input.work"),
        ({"task_type": "coding", "input": {"work": 40_000.5}}, "input.work"),
        ({"task_type": "coding", "input": {"variant": "rm -rf"}}, "input.variant"),
        ({"task_type": "coding", "tool_timeout_s": 31}, "tool_timeout_s"),  # over this server's ceiling
        ({"task_type": "coding", "request_id": ""}, "request_id"),
        ({"task_type": "coding", "request_id": "ü"}, "request_id"),
    ]

    async def go():
        h = Harness(emulator=_fast(), site_pages=30, tool_timeout_s=30)
        out = []
        async with _served(h) as url, aiohttp.ClientSession() as s:
            for body, _ in cases:
                async with s.post(url + "/v1/agent", json=body) as r:
                    out.append((r.status, await r.json()))
            ran = h.runtime.completed + h.runtime.failed
        return out, ran

    out, ran = asyncio.run(go())
    assert [(st, b.get("field")) for st, b in out] == [(400, f) for _, f in cases]
    assert "(0, 30]" in out[-3][1]["error"] and "integer in [1, 256]" in out[1][1]["error"]
    assert ran == 0


def test_duplicate_in_flight_request_id_is_409_and_work_dirs_are_the_servers():
    async def go():
        h = Harness(emulator=_fast(), site_pages=30)
        async with _served(h) as url, aiohttp.ClientSession() as s:
            h.runtime.keep_workdirs = True
            gate = asyncio.Event()
            h.emulator.gate = gate  # the first request waits in its LLM call
            body = {"task_type": "web_search", "input": {"searches": 0}, "request_id": "same"}
            first = asyncio.create_task(s.post(url + "/v1/agent", json=body))
            while h.runtime.inflight < 1:
                await asyncio.sleep(0.01)
            async with s.post(url + "/v1/agent", json=body) as r:
                dup = r.status, await r.json()
            gate.set()
            async with await first as r:
                one = r.status
            async with s.post(url + "/v1/agent", json=body) as r:  # no longer in flight: fine
                again = r.status
            dirs = sorted(os.listdir(h.runtime.workroot))
        return dup, one, again, dirs

    dup, one, again, dirs = asyncio.run(go())
    assert dup[0] == 409 and dup[1]["field"] == "request_id" and "in flight" in dup[1]["error"]
    assert one == again == 200
    assert len(dirs) == 2 and all(d.startswith("req-") and "same" not in d for d in dirs)


def test_cli_serve_on_a_host_without_the_sandbox_exits_1_naming_the_layer(monkeypatch):
    from agentdyn import service
    from agentdyn.cli import main
    from hwtopo.testing import assert_fails

    monkeypatch.setattr(service, "missing_layers", lambda: {"pid namespace": "unshare: Operation not permitted"})
    res = assert_fails(main, ["serve", "--port", "0"], 1, "pid namespace", prog="agentdyn")
    assert "--unsafe-no-sandbox" in res.err
