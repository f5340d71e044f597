"""``kvpool serve``: one pool shared by several serving processes over HTTP (aiohttp).

Endpoints (all under /v1): ``GET layout`` (model id and KV layout, for clients to check),
``POST lookup`` ({"keys": [hex, ...]} -> longest cached prefix in chunks), ``PUT chunks/{key}``
(raw chunk bytes, ``[layers, 2, kv_heads, chunk_tokens, head_dim]``; ``?context=k1,k2`` names the
request's earlier chunks for striping; 201 once stored, again for the same bytes, 409 for other
bytes: the first writer wins; 507 when there is no room), ``GET chunks/{key}`` (raw bytes or 404;
a chunk still being written is a 404) and ``GET stats``
(hit rate, per-device bytes and bandwidth, page-cache bytes). Clients compute keys themselves with
``kvpool.chunk_keys``; ``PoolClient`` is a small blocking client (urllib).

With a token (``token=`` or ``$KVPOOL_TOKEN``) every request needs ``Authorization: Bearer
<token>`` (401 otherwise), and a host beyond loopback needs one. Lookup JSON is bounded (1 MiB,
depth 64; 400/413), and an unexpected failure is a 500 naming no internals (hwtopo.httpguard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence

import torch

from hwtopo.httpguard import BadRequest, check_bind, middleware, read_json, token_from_env

from .devices import build_devices
from .keys import KVLayout
from .pool import ChunkConflict, KVPool
from .retrieval import TORCH_DTYPES

__all__ = ["parse_layout", "make_app", "serve_forever", "PoolClient", "BackgroundServer"]

log = logging.getLogger(__name__)
_LAYOUT = re.compile(r"^L(\d+)-H(\d+)-D(\d+)-(\w+)-N(\d+)$")
_KEY = re.compile(r"^[0-9a-f]{32}$")


def parse_layout(tag: str) -> KVLayout:
    """``L16-H8-D64-float32-N256`` -> KVLayout (the inverse of ``KVLayout.tag``)."""
    m = _LAYOUT.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a layout tag; use e.g. 'L16-H8-D64-float32-N256'")
    return KVLayout(int(m[1]), int(m[2]), int(m[3]), m[4], int(m[5]))


def _require_aiohttp():
    try:
        from aiohttp import web
    except ImportError:
        raise RuntimeError("kvpool serve needs aiohttp: pip install 'mlsyskit-kvpool[serve]'") from None
    return web


class _KeyLocks:
    """One asyncio lock per key while anyone uses it: PUTs of one key run one at a time, in arrival order.

    The pool is single-flight per key too; ordering here keeps waiting writers of one key out of the
    executor's threads, which GETs and other keys need.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str):
        lock, users = self._locks.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def _store_chunk(pool: KVPool, key: str, chunk: torch.Tensor, context: list[str]) -> int:
    """HTTP status of storing a chunk: 201 stored (or the same bytes already), 409 other bytes, 507 no room."""
    try:
        return 201 if pool.put_chunk(key, chunk, context) else 507
    except ChunkConflict:
        return 409


def make_app(pool: KVPool, token: str | None = None):
    """The aiohttp application serving ``pool``; blocking I/O runs in the default executor.

    ``token``: the bearer token every request must carry (None: no authentication, loopback only).
    """
    web = _require_aiohttp()
    key_locks = _KeyLocks()

    def _key(request) -> str:
        key = request.match_info["key"]
        if not _KEY.fullmatch(key):
            raise web.HTTPBadRequest(text=f"key must be 32 lowercase hex digits, not {key!r}")
        return key

    async def layout(request):
        return web.json_response({"model_id": pool.model_id, "layout": pool.layout.tag()})

    async def lookup(request):
        body = await read_json(request, max_bytes=1 << 20, max_depth=64)
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) and _KEY.fullmatch(k) for k in keys):
            raise BadRequest('body must be {"keys": [...]} of 32 lowercase hex digits each', field="keys")
        return web.json_response({"cached_chunks": pool.cached_chunks(keys)})

    async def put_chunk(request):
        key = _key(request)
        data = await request.read()
        if len(data) != pool.layout.chunk_bytes:
            raise web.HTTPBadRequest(
                text=f"chunk must be {pool.layout.chunk_bytes} bytes for {pool.layout.tag()}, not {len(data)}"
            )
        L, H, n, D = pool.layout.num_layers, pool.layout.kv_heads, pool.layout.chunk_tokens, pool.layout.head_dim
        chunk = torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[pool.layout.dtype]).view(L, 2, H, n, D)
        context = [c for c in request.query.get("context", "").split(",") if c]

        async with key_locks.hold(key):
            status = await asyncio.get_running_loop().run_in_executor(None, _store_chunk, pool, key, chunk, context)
        if status == 507:
            raise web.HTTPInsufficientStorage(text="the pool has no room for this chunk")
        if status == 409:
            raise web.HTTPConflict(text=f"chunk {key} is already stored with different bytes (the first writer wins)")
        return web.Response(status=status)

    async def get_chunk(request):
        key = _key(request)
        got = await asyncio.get_running_loop().run_in_executor(None, pool.read_chunk, key)
        if got is None:
            raise web.HTTPNotFound(text="not in the pool")
        with got:
            # the layer units go out as they lie in the staging buffer (or the memory arena): no
            # copy into one bytes object first; the chunk stays pinned until the last one is sent
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = got.nbytes
            await resp.prepare(request)
            for part in got.parts:
                await resp.write(part.numpy().data)
            await resp.write_eof()
        return resp

    async def stats(request):
        return web.Response(text=json.dumps(pool.stats(), default=str), content_type="application/json")

    max_body = max(1 << 20, pool.layout.chunk_bytes + (1 << 16))
    app = web.Application(middlewares=[middleware(token, max_body)], client_max_size=max_body)
    app.router.add_get("/v1/layout", layout)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_put("/v1/chunks/{key}", put_chunk)
    app.router.add_get("/v1/chunks/{key}", get_chunk)
    app.router.add_get("/v1/stats", stats)
    return app


def serve_forever(
    host: str,
    port: int,
    ssd_paths: Sequence[str],
    memory_modules: int,
    memory_bytes: int,
    ssd_bytes: int,
    model_id: str,
    layout: KVLayout,
    token: str | None = None,
) -> None:
    """Serve a new pool until interrupted; ``token`` defaults to ``$KVPOOL_TOKEN`` and is required
    for a ``host`` beyond loopback (ValueError before any device is built)."""
    web = _require_aiohttp()
    token = token or token_from_env("KVPOOL_TOKEN")
    check_bind(host, token)
    devs = build_devices(ssd_paths, memory_modules=memory_modules, memory_bytes=memory_bytes, ssd_bytes=ssd_bytes)
    for name, why in devs.skipped.items():
        log.warning("serving without %s: %s", name, why)
    pool = KVPool(devs.stores, layout, model_id, devs.bandwidths)
    try:
        web.run_app(make_app(pool, token), host=host, port=port, print=lambda msg: log.warning("%s", msg))
    finally:
        pool.close()


class BackgroundServer:
    """Serve a pool on 127.0.0.1 from a background thread (tests, notebooks). ``.url`` once started."""

    def __init__(self, pool: KVPool, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.pool, self.host, self.port, self.token = pool, host, port, token
        self.url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-serve", daemon=True)

    def _run(self) -> None:
        web = _require_aiohttp()
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(make_app(self.pool, self.token))
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        self._runner = runner
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("kvpool server did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class PoolClient:
    """Blocking client of ``kvpool serve``; checks the server's model and layout on connect.

    ``token``: the server's bearer token (default ``$KVPOOL_TOKEN``; none when unset).
    """

    def __init__(
        self,
        url: str,
        model_id: str | None = None,
        layout: KVLayout | None = None,
        timeout: float = 30.0,
        token: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        token = token or token_from_env("KVPOOL_TOKEN")
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        info = self._json("GET", "/v1/layout")
        self.model_id = info["model_id"]
        self.layout = parse_layout(info["layout"])
        if model_id is not None and model_id != self.model_id:
            raise ValueError(f"server pools KV of model {self.model_id!r}, not {model_id!r}")
        if layout is not None and layout != self.layout:
            raise ValueError(f"server layout is {self.layout.tag()}, not {layout.tag()}")

    def _req(self, method: str, path: str, data: bytes | None = None, headers: dict | None = None):
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={**self._auth, **(headers or {})}
        )
        return urllib.request.urlopen(req, timeout=self.timeout)

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        with self._req(method, path, data, {"Content-Type": "application/json"}) as r:
            return json.loads(r.read())

    def lookup(self, keys: Sequence[str]) -> int:
        return int(self._json("POST", "/v1/lookup", {"keys": list(keys)})["cached_chunks"])

    def put_chunk(self, key: str, chunk: torch.Tensor, context: Sequence[str] = ()) -> bool:
        """True once stored; False when the pool has no room; ``ChunkConflict`` when stored with other bytes."""
        q = f"?context={','.join(context)}" if context else ""
        data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        try:
            with self._req("PUT", f"/v1/chunks/{key}{q}", data, {"Content-Type": "application/octet-stream"}):
                return True
        except urllib.error.HTTPError as e:
            if e.code == 507:
                return False
            if e.code == 409:
                raise ChunkConflict(
                    f"chunk {key} is already stored with different bytes (the first writer wins)"
                ) from None
            raise

    def get_chunk(self, key: str) -> torch.Tensor | None:
        """The chunk as ``[layers, 2, kv_heads, chunk_tokens, head_dim]``, or None when not pooled.

        The body is read straight into the tensor's memory (no intermediate bytes object).
        """
        L, H, n, D = self.layout.num_layers, self.layout.kv_heads, self.layout.chunk_tokens, self.layout.head_dim
        out = torch.empty(L, 2, H, n, D, dtype=TORCH_DTYPES[self.layout.dtype])
        dst = out.view(-1).view(torch.uint8).numpy().data
        try:
            with self._req("GET", f"/v1/chunks/{key}") as r:
                got = 0
                while got < len(dst):
                    k = r.readinto(dst[got:])
                    if not k:
                        break
                    got += k
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
        if got != len(dst):
            raise ValueError(
                f"server sent {got} bytes for chunk {key}; the layout {self.layout.tag()} needs {len(dst)}"
            )
        return out

    def stats(self) -> dict:
        return self._json("GET", "/v1/stats")
