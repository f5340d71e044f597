"""``kvpool serve`` under malformed and unauthenticated requests: 4xx answers, nothing stored."""

import asyncio
import json

import pytest
import torch

pytest.importorskip("aiohttp")

import aiohttp  # noqa: E402

from hwtopo.testing import assert_client_errors, malformed_json, send_requests  # noqa: E402
from kvpool import KVPool, MemoryStore  # noqa: E402
from kvpool.serve import BackgroundServer, PoolClient, parse_layout, serve_forever  # noqa: E402

LAY = parse_layout("L2-H2-D8-float32-N16")
KEY = "0123456789abcdef0123456789abcdef"


def _pool() -> KVPool:
    return KVPool([MemoryStore("mem0", 4 * LAY.chunk_bytes)], LAY, "m", {"mem0": 8e9})


def _corpus() -> list[tuple[str, str, bytes | None, dict]]:
    """(method, path, body, headers) of malformed requests: none of them may store or crash anything."""
    lookups = (
        malformed_json("keys")
        + [
            b'{"keys": [1e999]}',
            b'{"keys":' * 1000 + b"1" + b"}" * 1000,
            b'{"keys": ["\\ud800"]}',
            b'{"keys": [' + b"[" * 70 + b"]" * 70 + b"]}",
            b'{"keys": ["a"]} extra',
            b'{"keys": ["a",]}',
            b"{'keys': []}",
        ]
        + [
            json.dumps(o).encode()
            for o in (
                {},
                {"key": [KEY]},
                {"keys": KEY},
                {"keys": None},
                {"keys": [1, 2]},
                {"keys": [None]},
                {"keys": [[KEY]]},
                {"keys": {"a": KEY}},
                {"keys": [True]},
                {"keys": [10**30]},
            )
        ]
    )
    chunk = b"\0" * LAY.chunk_bytes
    out = [("POST", "/v1/lookup", b, {"Content-Type": "application/json"}) for b in lookups]
    out += [
        ("POST", "/v1/lookup", b"keys=" + KEY.encode(), {"Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", "/v1/lookup", b" " * ((1 << 20) + 1), {}),
        ("PUT", f"/v1/chunks/{KEY}", b"", {}),
        ("PUT", f"/v1/chunks/{KEY}", chunk[:-1], {}),
        ("PUT", f"/v1/chunks/{KEY}?context=" + "z," * 500, chunk[:8], {}),
        ("PUT", f"/v1/chunks/{KEY}?context=%ZZ", b"", {}),
        ("PUT", f"/v1/chunks/{KEY}", chunk + b"\0", {}),
        ("PUT", f"/v1/chunks/{KEY}", b'{"chunk": 1}', {"Content-Type": "application/json"}),
        ("PUT", f"/v1/chunks/{KEY}", b"\0" * (LAY.chunk_bytes + (2 << 20)), {}),
        ("PUT", f"/v1/chunks/{KEY.upper()}", chunk, {}),
        ("PUT", f"/v1/chunks/{KEY[:-1]}", chunk, {}),
        ("PUT", f"/v1/chunks/{KEY}0", chunk, {}),
        ("PUT", f"/v1/chunks/{KEY}%0A", chunk, {}),
        ("POST", "/v1/lookup", json.dumps({"keys": [KEY + "\n"]}).encode(), {}),
        ("PUT", "/v1/chunks/..%2F..%2Fetc%2Fpasswd", chunk, {}),
        ("PUT", "/v1/chunks/", chunk, {}),
        ("GET", "/v1/chunks/zz", None, {}),
        ("GET", f"/v1/chunks/{KEY}%00", None, {}),
        ("GET", "/v1/chunks/" + "a" * 5000, None, {}),
        ("GET", "/v1/lookup", None, {}),
        ("DELETE", f"/v1/chunks/{KEY}", None, {}),
        ("POST", f"/v1/chunks/{KEY}", chunk, {}),
        ("PUT", "/v1/layout", b"{}", {}),
        ("POST", "/v1/stats", b"{}", {}),
        ("GET", "/v2/layout", None, {}),
        ("GET", "/v1/../../etc/passwd", None, {}),
    ]
    return out


def test_malformed_request_corpus_gets_no_500_and_no_traceback():
    corpus = _corpus()
    assert len(corpus) >= 50

    async def send(url):
        async with aiohttp.ClientSession() as s:
            return await send_requests(s, corpus, url)

    with _pool() as pool, BackgroundServer(pool) as srv:
        out = asyncio.run(send(srv.url))
        stored = pool.stats()["counters"]["chunks_stored"]
    assert stored == 0
    assert_client_errors(out)
    deep = [json.loads(a.text) for a in out if a.body.startswith(b"[[[[")]
    assert "100000 levels deep; the limit is 64" in deep[0]["error"]


def test_token_guards_every_route_and_the_client_sends_it(monkeypatch):
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    chunk = torch.randn(2, 2, 2, 16, 8)
    with _pool() as pool, BackgroundServer(pool, token="pool-secret") as srv:
        with pytest.raises(Exception, match="401"):
            PoolClient(srv.url)
        with pytest.raises(Exception, match="401"):
            PoolClient(srv.url, token="wrong")
        c = PoolClient(srv.url, token="pool-secret")
        assert c.put_chunk(KEY, chunk)
        assert torch.equal(c.get_chunk(KEY), chunk)
        monkeypatch.setenv("KVPOOL_TOKEN", "pool-secret")  # a second process finds it in its environment
        assert PoolClient(srv.url).lookup([KEY]) == 1


def test_serve_beyond_loopback_needs_a_token(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="--token"):
        serve_forever("0.0.0.0", 0, [], 1, 1 << 20, 0, "m", LAY)
