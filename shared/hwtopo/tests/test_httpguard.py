"""hwtopo.httpguard: bounded JSON without recursion, bind checks, and the aiohttp middleware."""

import sys

import pytest

from hwtopo.httpguard import BadRequest, check_bind, middleware, parse_json, read_json, token_from_env
from hwtopo.testing import Answer, assert_client_errors, malformed_json, send_requests, serve_app


def test_parse_json_accepts_ordinary_bodies():
    body = b'{"a": [1, 2.5, {"b": "[[[ not brackets \\" ]]]"}], "c": null}'
    assert parse_json(body, max_bytes=1000) == {"a": [1, 2.5, {"b": '[[[ not brackets " ]]]'}], "c": None}
    assert parse_json(b"[" * 64 + b"]" * 64, max_bytes=1000) is not None


def test_parse_json_rejects_deep_nesting_without_recursion():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadRequest, match="100000 levels deep; the limit is 64") as info:
        parse_json(deep, max_bytes=1 << 20)
    assert info.value.status == 400
    # one level past the limit, objects too; deeper than the interpreter's recursion limit unclosed
    with pytest.raises(BadRequest, match="65 levels deep; the limit is 64"):
        parse_json(b'{"a":' * 65 + b"1" + b"}" * 65, max_bytes=1 << 20)
    with pytest.raises(BadRequest, match="levels deep"):
        parse_json(b"[" * (sys.getrecursionlimit() * 10), max_bytes=1 << 20)


def test_brackets_in_strings_and_escapes_do_not_count():
    inner = b'"' + b'\\"[' * 1000 + b'"'
    assert parse_json(b"[" + inner + b"]", max_bytes=1 << 20) == ['"[' * 1000]
    # an unterminated string: what follows it is never parsed, so it is not nesting
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_json(b'["' + b"[" * 1000, max_bytes=1 << 20, max_depth=4)


def test_parse_json_size_and_encoding():
    with pytest.raises(BadRequest, match="1001 bytes; the limit is 1000 bytes") as info:
        parse_json(b" " * 1001, max_bytes=1000)
    assert info.value.status == 413
    with pytest.raises(BadRequest, match="not UTF-8 .*offset 2"):
        parse_json(b'["\xff"]', max_bytes=1000)
    with pytest.raises(BadRequest, match="empty"):
        parse_json(b"  ", max_bytes=1000)
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_json(b"{not json", max_bytes=1000)


@pytest.mark.parametrize(
    "body, needle",
    [(b"[NaN]", "NaN is not valid JSON"), (b"[1e999]", "out of range"), (b"1" * 5000, "more than .* digits")],
)
def test_parse_json_rejects_numbers_json_does_not_have(body, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_json(body, max_bytes=1 << 20)


def test_check_bind_needs_a_token_beyond_loopback():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        check_bind(host, None)
    check_bind("0.0.0.0", "secret")
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.org", ""):
        with pytest.raises(ValueError, match="--token"):
            check_bind(host, None)


def test_token_from_env(monkeypatch):
    monkeypatch.setenv("HWTOPO_TEST_TOKEN", " abc ")
    assert token_from_env("HWTOPO_TEST_TOKEN") == "abc"
    monkeypatch.setenv("HWTOPO_TEST_TOKEN", "  ")
    assert token_from_env("HWTOPO_TEST_TOKEN") is None
    monkeypatch.delenv("HWTOPO_TEST_TOKEN")
    assert token_from_env("HWTOPO_TEST_TOKEN") is None


def _app(token, max_body):
    from aiohttp import web

    async def echo(request):
        body = await read_json(request, max_bytes=max_body)
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object", field="body")
        return web.json_response({"got": body})

    async def boom(request):
        raise RuntimeError("secret internals")

    app = web.Application(middlewares=[middleware(token, max_body)], client_max_size=max_body)
    app.router.add_post("/echo", echo)
    app.router.add_get("/boom", boom)
    return app


def _client_run(token, fn, max_body=1000):
    return serve_app(lambda: _app(token, max_body), fn)


def test_middleware_token_accept_and_reject():
    async def fn(c):
        out = []
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": "Bearer s3cret"},
        ):
            r = await c.post("/echo", json={"x": 1}, headers=headers)
            out.append((r.status, r.headers.get("WWW-Authenticate"), await r.json()))
        return out

    (none, wrong, basic, good) = _client_run("s3cret", fn)
    for status, challenge, body in (none, wrong, basic):
        assert status == 401 and challenge == "Bearer" and "bearer token" in body["error"]
    assert good[0] == 200 and good[2] == {"got": {"x": 1}}


def test_middleware_errors_are_json_without_tracebacks(caplog):
    async def fn(c):
        out = []
        r = await c.post("/echo", data=b"[" * 100_000)
        out.append((r.status, await r.json()))
        r = await c.post("/echo", data=b"[1]")
        out.append((r.status, await r.json()))
        r = await c.post("/echo", data=b" " * 2000)
        out.append((r.status, await r.json()))
        r = await c.get("/boom")
        out.append((r.status, await r.text()))
        return out

    deep, notobj, blank, boom = _client_run(None, fn, max_body=200_000)
    assert deep[0] == 400 and "levels deep" in deep[1]["error"]
    assert notobj == (400, {"error": "body must be a JSON object", "field": "body"})
    assert blank[0] == 400 and "empty" in blank[1]["error"]  # within the size limit, then read as blank
    assert boom[0] == 500 and "secret internals" not in boom[1] and "Traceback" not in boom[1]
    assert "secret internals" in caplog.text  # the log keeps what the client does not see


def test_middleware_rejects_oversized_bodies_with_413():
    async def fn(c):
        r = await c.post("/echo", data=b"[" + b"1," * 1000 + b"1]")
        declared = (r.status, await r.json())

        async def chunks():
            for _ in range(10):
                yield b" " * 500

        r = await c.post("/echo", data=chunks())  # no Content-Length: the read stops at the limit
        return declared, (r.status, await r.json())

    declared, streamed = _client_run(None, fn, max_body=1000)
    assert declared[0] == 413 and "the limit is 1000 bytes" in declared[1]["error"]
    assert streamed[0] == 413 and "1000 bytes" in streamed[1]["error"]


def test_a_request_corpus_passes_only_when_every_answer_is_a_clean_4xx():
    corpus = [("POST", "/echo", b"{", {}), ("POST", "/echo", b"[1]", {}), ("GET", "/echo", None, {})]
    answers = _client_run(None, lambda c: send_requests(c, corpus))
    assert [(a.method, a.body, a.status) for a in answers] == [
        ("POST", b"{", 400),
        ("POST", b"[1]", 400),
        ("GET", b"", 405),
    ]
    assert_client_errors(answers)
    (boom,) = _client_run(None, lambda c: send_requests(c, [("GET", "/boom", None, {})]))
    with pytest.raises(AssertionError, match="500"):
        assert_client_errors([boom])
    with pytest.raises(AssertionError, match="Traceback"):
        assert_client_errors([Answer("GET", "/", b"", 404, 'Traceback (most recent call last):\n  File "x"')])


def test_malformed_json_is_refused_by_the_parser_or_is_the_wrong_shape():
    parsed = []
    for body in malformed_json("keys"):
        try:
            parsed.append(parse_json(body, max_bytes=1 << 20))
        except BadRequest:
            pass
    # what JSON can hold: no object, or an object whose field is a string Python cannot encode
    assert parsed == [None, [], 42, "keys", {"keys": "\ud800"}]
