import asyncio
import json

import pytest

from bicache.engine import Engine
from bicache.server import make_app
from hwtopo.testing import assert_client_errors, malformed_json, send_requests, serve_app


def _run(dlm, fn, engine=None, **app_kw):
    return serve_app(lambda: make_app(engine or Engine(dlm, mode="block", max_batch=4), **app_kw), fn)


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
        ({"prompt": "k01", "gen_length": 0}, "'gen_length' must be an integer from 1 to 256"),
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
    # the block cache alone never consults the prefix store
    assert health["prefix_store"] == {"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "evictions": 0}
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


def test_token_is_required_when_set(dlm):
    async def fn(c):
        out = []
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer tok-1"}):
            r = await c.get("/v1/models", headers=headers)
            out.append((r.status, r.headers.get("WWW-Authenticate")))
        return out

    assert _run(dlm, fn, token="tok-1") == [(401, "Bearer"), (401, "Bearer"), (200, None)]


def test_serve_refuses_a_public_host_without_token(dlm):
    from bicache.server import serve

    with pytest.raises(ValueError, match="--token"):
        serve(Engine(dlm, mode="block"), host="0.0.0.0", port=1)


def test_full_queue_is_429_with_retry_after(dlm, task):
    eng = Engine(dlm, mode="block", max_batch=1, max_queue=2)
    eng.start = lambda *a, **k: None  # nothing is served until the test drains the queue itself
    reqs = task.burst(3, 3)

    async def fn(c):
        waiting = [asyncio.create_task(c.post("/v1/generate", json={"tokens": r.prompt})) for r in reqs[:2]]
        while len(eng._queue) < 2:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/generate", json={"tokens": reqs[2].prompt})
        full = (r.status, r.headers.get("Retry-After"), await r.json())
        await asyncio.to_thread(eng.drain)
        served = [(await w).status for w in waiting]
        return full, served

    (status, retry, body), served = _run(dlm, fn, engine=eng)
    assert status == 429 and int(retry) >= 1 and "queue is full" in body["error"]["message"]
    assert served == [200, 200]


def test_deep_json_and_huge_prompts_are_rejected_before_parsing_or_tokenizing(dlm, monkeypatch):
    seen = []
    real = type(dlm.vocab).encode
    monkeypatch.setattr(
        type(dlm.vocab), "encode", lambda self, text, **kw: seen.append(len(text)) or real(self, text, **kw)
    )
    huge = " ".join(f"w{i}" for i in range(120_000))  # ~0.9 MB of words outside the vocabulary
    assert 800_000 < len(huge) < 1 << 20

    async def fn(c):
        out = []
        for path in ("/v1/generate", "/v1/completions", "/v1/chat/completions"):
            r = await c.post(path, data=b"[" * 100_000 + b"]" * 100_000)
            out.append((r.status, (await r.json())["error"]["message"]))
        r = await c.post("/v1/completions", json={"prompt": huge})
        out.append((r.status, (await r.json())["error"]["message"]))
        r = await c.post("/v1/generate", data=b" " * (1 << 20) + b"{}")
        out.append((r.status, (await r.json())["error"]["message"]))
        return out

    *deep, long, big = _run(dlm, fn)
    for status, msg in deep:
        assert status == 400 and "100000 levels deep; the limit is 64" in msg
    assert long[0] == 400 and "longer than the model's 256 positions" in long[1]
    assert seen == []  # the length check came first: the text was never tokenized
    assert big[0] == 413 and "the limit is 1048576 bytes" in big[1]


def _corpus() -> list[tuple[str, str, bytes | None, dict]]:
    """(method, path, body, headers) of malformed requests: none of them is a valid request."""
    raw = malformed_json("prompt") + [
        b'{"prompt": "k01", "gen_length": 1e999}',
        b'{"prompt": "k01", "gen_length": ' + b"9" * 5000 + b"}",
        b"[" * 100_000,
        b'{"prompt": "\\ud800 k01"}',
    ]
    objs = [
        {"prompt": 5},
        {"prompt": None},
        {"prompt": ["k01", "k02"]},
        {"prompt": " " * 10_000},
        {"tokens": "k01"},
        {"tokens": [1.5]},
        {"tokens": [True]},
        {"tokens": [-1]},
        {"tokens": [10**30]},
        {"tokens": [2] * 5000},
        {"prompt": "k01", "gen_length": 10**30, "max_tokens": 10**30},
        {"prompt": "k01", "gen_length": -3, "max_tokens": -3},
        {"prompt": "k01", "steps": "4", "max_tokens": "4"},
        {"prompt": "k01", "block_length": 3, "gen_length": 4, "max_tokens": 4},
        {"messages": [], "prompt": []},
        {"messages": [1]},
        {"messages": [{"content": {"a": 1}}]},
        {"messages": [{"content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"content": "x" * 500_000}], "prompt": "x" * 500_000},
    ]
    bodies = raw + [json.dumps(o).encode() for o in objs]
    out = [("POST", p, b, {}) for p in ("/v1/generate", "/v1/completions", "/v1/chat/completions") for b in bodies]
    out += [
        ("POST", "/v1/generate", b"prompt=k01", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", "/v1/completions", b"k01 k02", {"Content-Type": "text/plain"}),
        ("POST", "/v1/generate", b" " * ((1 << 20) + 1), {}),
        ("GET", "/v1/generate", None, {}),
        ("PUT", "/v1/completions", b"{}", {}),
        ("DELETE", "/health", None, {}),
        ("POST", "/v1/models", b"{}", {}),
        ("GET", "/nope", None, {}),
        ("GET", "/v1/../../etc/passwd", None, {}),
    ]
    return out


def test_malformed_request_corpus_gets_no_500_and_no_traceback(dlm):
    corpus = _corpus()
    assert len(corpus) >= 50

    assert_client_errors(_run(dlm, lambda c: send_requests(c, corpus)))
