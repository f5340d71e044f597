"""OpenAI-compatible client and the LLM emulator: plans, latency, retries, clear errors."""

import asyncio
import json
import time

import pytest
from aiohttp import web

from agentdyn.emulator import EmulatorConfig, LLMEmulator, plan_step
from agentdyn.llm import LLMClient, LLMConfig, LLMError


def msgs(task, inp=None, extra=()):
    return [
        {"role": "system", "content": f"agent. task_type: {task}."},
        {"role": "user", "content": json.dumps(inp or {})},
        *extra,
    ]


def test_plans_per_task_type():
    calls, _ = plan_step(msgs("coding", {"work": 500}))
    assert calls[0]["name"] == "repo_init" and calls[0]["arguments"]["work"] == 500
    calls, _ = plan_step(msgs("rag_qa", {"question": "q", "shard": 2}))
    assert calls[0] == {"name": "rag_index", "arguments": {"shard": 2, "shards": 4}}
    done = [{"role": "assistant", "content": None}] * 2 + [{"role": "tool", "content": "R"}]
    calls, answer = plan_step(msgs("web_search", {}, done))
    assert calls is None and "R" in answer
    calls, _ = plan_step(msgs("web_search", {"searches": 0}))
    assert calls is None


def test_client_talks_to_emulator_with_tool_calls():
    async def go():
        emu = LLMEmulator(EmulatorConfig(ttft_s=0.2, ttft_sigma=0.0, tokens_per_s=400, tps_sigma=0.0))
        url = await emu.start()
        c = LLMClient(LLMConfig(base_url=url, api_key="k"))
        try:
            t0 = time.monotonic()
            msg, info = await c.chat(msgs("coding"), tools=[{"type": "function", "function": {"name": "repo_init"}}])
            dt = time.monotonic() - t0
        finally:
            await c.close()
            await emu.stop()
        return msg, info, dt

    msg, info, dt = asyncio.run(go())
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "repo_init"
    assert json.loads(call["function"]["arguments"])["work"] == 40000
    assert info["attempts"] == 1 and info["usage"]["completion_tokens"] == 40
    assert dt >= 0.2  # the emulated time to first token was waited


def test_endpoint_down_gives_clear_error_after_bounded_retries(free_port):
    async def go():
        c = LLMClient(LLMConfig(base_url=f"http://127.0.0.1:{free_port}/v1", retries=2, backoff_s=0.01, timeout_s=2))
        try:
            await c.chat(msgs("coding"))
        finally:
            await c.close()

    with pytest.raises(LLMError, match=r"failed after 3 attempt\(s\)"):
        asyncio.run(go())


def test_slow_endpoint_times_out_per_attempt():
    async def go():
        emu = LLMEmulator(EmulatorConfig(ttft_s=1.0, ttft_sigma=0.0))
        url = await emu.start()
        c = LLMClient(LLMConfig(base_url=url, retries=1, backoff_s=0.01, timeout_s=0.3))
        try:
            await c.chat(msgs("coding"))
        finally:
            await c.close()
            await emu.stop()

    with pytest.raises(LLMError, match=r"after 2 attempt\(s\): no answer within 0.3s"):
        asyncio.run(go())


def test_retry_recovers_from_a_503():
    async def go():
        hits = {"n": 0}

        async def handler(request):
            hits["n"] += 1
            if hits["n"] == 1:
                return web.Response(status=503, text="busy")
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        c = LLMClient(LLMConfig(base_url=f"http://127.0.0.1:{port}/v1", retries=2, backoff_s=0.01))
        try:
            return await c.chat(msgs("x")), hits["n"]
        finally:
            await c.close()
            await runner.cleanup()

    (msg, info), n = asyncio.run(go())
    assert msg["content"] == "ok" and info["attempts"] == 2 and n == 2


def test_config_validation():
    with pytest.raises(ValueError, match="base_url"):
        LLMConfig(base_url="localhost:8000")
    with pytest.raises(ValueError, match="tokens_per_s"):
        EmulatorConfig(tokens_per_s=0)


def test_emulated_latency_depends_on_the_conversation_not_the_call_order():
    cfg = EmulatorConfig(ttft_s=0.3, tokens_per_s=80.0, seed=5)
    a, b = LLMEmulator(cfg), LLMEmulator(cfg)
    keys = [f"conversation-{i}:{step}" for i in range(4) for step in (2, 4)]
    first = {k: a.latency_s(40, k) for k in keys}
    second = {k: b.latency_s(40, k) for k in reversed(keys)}  # another policy, another order
    assert first == second
    assert len(set(first.values())) == len(keys)  # still a draw per conversation step
    assert LLMEmulator(EmulatorConfig(ttft_s=0.3, tokens_per_s=80.0, seed=6)).latency_s(40, keys[0]) != first[keys[0]]
    # without a key: the emulator's own sequence, as before
    assert a.latency_s(40) != a.latency_s(40)
