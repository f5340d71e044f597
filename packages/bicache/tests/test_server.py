import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bicache.engine import Engine
from bicache.server import make_app


def _run(dlm, fn):
    async def main():
        client = TestClient(TestServer(make_app(Engine(dlm, mode="block", max_batch=4))))
        await client.start_server()
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_bad_json_is_400(dlm):
    async def fn(c):
        r = await c.post("/v1/generate", data="{not json", headers={"Content-Type": "application/json"})
        return r.status, await r.json()

    status, body = _run(dlm, fn)
    assert status == 400 and "not valid JSON" in body["error"]["message"]


@pytest.mark.parametrize(
    "payload, needle",
    [
        ({}, "'prompt' is required"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "k01 hello"}, "'hello' is not in the vocabulary"),
        ({"prompt": "k01 hello", "open_vocab": "yes"}, "'open_vocab' must be true or false"),
        ({"prompt": "k01", "gen_length": 0}, "'gen_length' must be an integer >= 1"),
        ({"prompt": "k01", "gen_length": 4, "block_length": 3}, "block_length"),
        ({"tokens": [2] * 300}, "longer than the model"),
        ({"tokens": ["a"]}, "'tokens' must be a list of integer"),
    ],
)
def test_bad_requests_are_400(dlm, payload, needle):
    async def fn(c):
        r = await c.post("/v1/generate", json=payload)
        return r.status, await r.json()

    status, body = _run(dlm, fn)
    assert status == 400 and needle in body["error"]["message"]


def test_generate_and_openai_routes(dlm, task):
    req = task.burst(2, 3)
    text = dlm.vocab.decode(req[0].prompt)

    async def fn(c):
        out = []
        rs = await asyncio.gather(*[c.post("/v1/generate", json={"tokens": r.prompt}) for r in req])
        out.append([await r.json() for r in rs])
        r = await c.post("/v1/completions", json={"model": "x", "prompt": text, "max_tokens": 4})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/chat/completions", json={"messages": "hi"})
        out.append((r.status, await r.json()))
        r = await c.get("/health")
        out.append(await r.json())
        r = await c.get("/v1/models")
        out.append(await r.json())
        return out

    gens, comp, chat, badchat, health, models = _run(dlm, fn)
    for g in gens:
        assert len(g["tokens"]) == 4 and g["mode"] == "block"
    assert comp[0] == 200 and comp[1]["object"] == "text_completion" and "text" in comp[1]["choices"][0]
    assert comp[1]["usage"]["completion_tokens"] == 4
    assert chat[0] == 200 and chat[1]["choices"][0]["message"]["role"] == "assistant"
    assert badchat[0] == 400 and "'messages'" in badchat[1]["error"]["message"]
    assert health["status"] == "ok" and health["stats"]["requests"] >= 4
    assert models["data"][0]["object"] == "model"


def test_openai_routes_accept_any_text(dlm):
    """An agent's English system prompt, JSON input and a tool-call turn: byte fallback, not a 400."""
    messages = [
        {
            "role": "system",
            "content": "You are a tool-using agent. task_type: rag_qa. Call tools, then answer briefly.",
        },
        {"role": "user", "content": '{"question": "json décoder error"}'},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": [{"type": "text", "text": "no results"}]},
    ]
    tools = [{"type": "function", "function": {"name": "web_search", "parameters": {}}}]

    async def fn(c):
        out = []
        r = await c.post("/v1/chat/completions", json={"model": "x", "messages": messages, "tools": tools})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/completions", json={"prompt": "Hello, world! ? k01", "max_tokens": 2})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/generate", json={"prompt": "hello k01", "open_vocab": True})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image"}]}]})
        out.append((r.status, await r.json()))
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 400}]})
        out.append((r.status, await r.json()))
        return out

    chat, comp, gen, badpart, toolong = _run(dlm, fn)
    assert chat[0] == 200, chat
    assert chat[1]["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(chat[1]["choices"][0]["message"]["content"], str)
    text = " ".join(m["content"] for m in messages[:2]) + " no results"
    assert chat[1]["usage"]["prompt_tokens"] == 1 + len(dlm.vocab.encode(text, open_vocab=True))
    assert chat[1]["usage"]["completion_tokens"] == 4
    assert comp[0] == 200 and comp[1]["usage"]["completion_tokens"] == 2
    assert gen[0] == 200 and len(gen[1]["tokens"]) == 4
    assert badpart[0] == 400 and "messages[0].content" in badpart[1]["error"]["message"]
    assert toolong[0] == 400 and "longer than the model" in toolong[1]["error"]["message"]
