"""Accounting of the service check: answered vs lost, the malformed mix, each malformed kind's answer."""

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from agentdyn.emulator import EmulatorConfig
from agentdyn.runtime import Harness
from agentdyn.service import make_app
from agentdyn.servicecheck import MALFORMED, _plan, classify


def test_classify_answered_and_lost():
    assert classify(200, b"{}") == "answered"
    assert classify(400, b'{"error": "input.shards: must be an integer"}') == "answered"
    assert classify(413, b'{"error": "body: too large"}') == "answered"
    assert classify(400, b"") == "lost"  # a 4xx that says nothing
    assert classify(404, b'{"error": ""}') == "lost"
    assert classify(500, b'{"error": "boom"}') == "lost"
    assert classify(503, b'{"error": "draining"}') == "lost"
    assert classify(None, b"") == "lost"  # timeout or reset


def test_plan_mixes_a_fifth_malformed_of_every_kind():
    plan = _plan(40, 0.2, 7, lambda i: {"task_type": "web_search", "input": {"query": f"q{i}"}})
    bad = [k for k, _, _ in plan if k != "valid"]
    assert len(bad) == 8 and set(bad) == set(MALFORMED)
    assert _plan(40, 0.2, 7, lambda i: {}) == _plan(40, 0.2, 7, lambda i: {})  # the seed decides
    valid = [json.loads(b) for k, b, auth in plan if k == "valid"]
    assert len(valid) == 32 and all(v["task_type"] == "web_search" for v in valid)


def test_every_malformed_kind_gets_a_4xx_with_a_message():
    fast = EmulatorConfig(ttft_s=0.05, ttft_sigma=0.0, tokens_per_s=2000, tps_sigma=0.0)

    async def go():
        h = Harness(emulator=fast, site_pages=30)
        await h.start()
        runner = web.AppRunner(make_app(h, token="t0k"), access_log=None)
        out = {}
        try:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/agent"
            async with aiohttp.ClientSession() as s:
                for kind, (body, auth) in MALFORMED.items():
                    headers = {"Authorization": "Bearer t0k"} if auth else {}
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.post(url, data=body, headers=headers) as r:
                            out[kind] = (r.status, await r.read())
        finally:
            await runner.cleanup()
            await h.stop()
        return out

    got = asyncio.run(go())
    assert set(got) == set(MALFORMED)
    for kind, (status, body) in got.items():
        assert 400 <= status < 500 and classify(status, body) == "answered", (kind, status, body[:200])
    assert got["oversized_body"][0] == 413 and got["no_token"][0] == 401
    assert got["unknown_task_type"][0] == 422


@pytest.mark.slow
def test_service_under_sigterm_loses_nothing_and_leaves_nothing():
    from agentdyn.servicecheck import lost_requests

    # a slow model keeps every valid request in flight when SIGTERM comes
    args = ("--policy", "native", "--ttft", "3", "--site-pages", "30", "--drain-timeout", "120")
    out = asyncio.run(
        lost_requests(10, lambda i: {"task_type": "web_search", "input": {"searches": i % 2}}, 0.2, serve_args=args)
    )
    assert out["requests"] == 10 and out["malformed"] == 2
    assert out["lost"] == 0 and out["answered"] == 10, out["lost_examples"]
    assert out["by_status"].get("200") == 8
    assert out["sent_after_sigterm"]["status"] == 503
    assert out["sigterm_exit_code"] == 0 and out["leftovers"] == []
