"""``agentdyn serve``: the agent runtime as an HTTP service (aiohttp).

``POST /v1/agent`` {"task_type", "input", "request_id"?, "tool_timeout_s"?, "max_steps"?} runs one
agent request and answers its result with the timeline. Malformed bodies get 400 naming the field
(each field of ``input`` too; JSON nested deeper than 64 levels; a ``tool_timeout_s`` above the
server's ``--tool-timeout``; a body over ``max_body_bytes`` 413), unknown task types 422, a
``request_id`` already in flight 409. The client's ``request_id`` only labels the request: its
work directory is named by the server. An LLM that stays down or slow after the bounded retries
is a 502 with the reason; a failed tool call (timed out, out of memory, an error) makes the
request ``ok: false`` with that error, a 500, as other agent failures; an unexpected exception is
a 500 naming no internals (logged). With a ``token`` every route needs ``Authorization: Bearer
<token>`` (401 without); a host beyond loopback needs one. ``GET /healthz`` and ``GET /v1/stats``
report state (the sandbox's layers too). ``serve`` refuses to start when the host does not permit
every sandbox layer (``SandboxUnavailable`` names the missing ones) unless told
``unsafe_no_sandbox``. On SIGTERM or SIGINT the service drains: new requests get 503, in-flight
ones finish (up to ``drain_timeout_s``), then tools, groups and servers are closed and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from hwtopo.httpguard import BadRequest, check_bind, middleware, read_json

from .runtime import Harness, RequestError, validate_request
from .sandbox import SandboxUnavailable, missing_layers

__all__ = ["make_app", "sandbox_isolation", "serve"]

log = logging.getLogger(__name__)

HARNESS = web.AppKey("harness", Harness)
STATE = web.AppKey("state", dict)
BODY_LIMIT = web.AppKey("max_body_bytes", int)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64


def _err(status: int, message: str, field: str | None = None, **extra) -> web.Response:
    body = {"error": message, **({"field": field} if field else {}), **extra}
    return web.json_response(body, status=status)


async def _agent(request: web.Request) -> web.Response:
    h = request.app[HARNESS]
    state = request.app[STATE]
    if state["draining"]:
        return _err(503, "draining: the service is shutting down and takes no new requests")
    try:
        body = await read_json(request, max_bytes=request.app[BODY_LIMIT], max_depth=MAX_JSON_DEPTH)
    except BadRequest as e:
        return _err(e.status, f"body: {e}", "body")
    try:
        req = validate_request(body, max_tool_timeout_s=h.runtime.tool_timeout_s)
    except RequestError as e:
        return _err(e.status, str(e), e.field)
    if req.request_id in state["inflight_ids"]:
        return _err(409, f"request_id: {req.request_id!r} is in flight; use another id or wait for it", "request_id")
    state["accepted"] += 1
    state["inflight_ids"].add(req.request_id)
    try:
        res = await h.runtime.run(req)
    finally:
        state["inflight_ids"].discard(req.request_id)
    out = res.to_dict()
    if res.ok:
        return web.json_response(out)
    status = 502 if res.error and res.error.startswith("llm:") else 500
    return web.json_response(out, status=status)


async def _health(request: web.Request) -> web.Response:
    h = request.app[HARNESS]
    state = request.app[STATE]
    return web.json_response(
        {"ok": not state["draining"], "draining": state["draining"], "inflight": h.runtime.inflight}
    )


async def _stats(request: web.Request) -> web.Response:
    h = request.app[HARNESS]
    state = request.app[STATE]
    rt = h.runtime
    body = {
        "accepted": state["accepted"],
        "completed": rt.completed,
        "failed": rt.failed,
        "inflight": rt.inflight,
        "uptime_s": time.monotonic() - state["started"],
        "policy": rt.policy.describe(),
        "pressure": rt.sampler.latest().to_dict() if rt.sampler is not None else None,
        "emulated": {"llm": h.emulator.config.describe() if h.emulator else False, "site": h.site.describe()},
        "sandbox": rt.sandbox.describe(),
    }
    return web.json_response(body)


def sandbox_isolation(unsafe_no_sandbox: bool = False) -> str:
    """The tool isolation a service runs with: ``"strict"``, after checking that this host permits
    every sandbox layer (``SandboxUnavailable`` naming those it lacks), or ``"off"`` when told."""
    if unsafe_no_sandbox:
        log.warning("--unsafe-no-sandbox: tools run as this service's user, with its filesystem and network")
        return "off"
    missing = missing_layers()
    if missing:
        raise SandboxUnavailable(missing)
    return "strict"


def make_app(harness: Harness, *, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """The service app around a started ``Harness``; ``token``: the bearer token requests must carry."""
    guard = middleware(token, max_body_bytes, _err)
    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app[HARNESS] = harness
    app[BODY_LIMIT] = max_body_bytes
    app[STATE] = {"draining": False, "accepted": 0, "started": time.monotonic(), "inflight_ids": set()}
    app.router.add_post("/v1/agent", _agent)
    app.router.add_get("/healthz", _health)
    app.router.add_get("/v1/stats", _stats)
    return app


async def serve(
    harness: Harness,
    host: str = "127.0.0.1",
    port: int = 8080,
    drain_timeout_s: float = 120.0,
    ready=None,
    setup=None,
    token: str | None = None,
    unsafe_no_sandbox: bool = False,
) -> int:
    """Run until SIGTERM/SIGINT, then drain. ``await setup(harness)`` runs after start (e.g. to
    calibrate and install a policy); ``ready(url)`` is called once listening. A ``host`` beyond
    loopback needs a ``token`` (ValueError before anything starts). Tools run in the full sandbox
    (``SandboxUnavailable`` before anything starts, naming each layer the host lacks) unless
    ``unsafe_no_sandbox``, which runs them with only an allow-listed environment and rlimits."""
    check_bind(host, token)
    harness.isolation = sandbox_isolation(unsafe_no_sandbox)
    await harness.start()
    runner = None
    try:  # a failed setup or bind (port in use) still stops the harness: no leaked sessions or tools
        if setup is not None:
            await setup(harness)
        app = make_app(harness, token=token)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        url = f"http://{host}:{bound}"
        if ready is not None:
            ready(url)
        await stop.wait()
        app[STATE]["draining"] = True
        log.info("draining: %d request(s) in flight", harness.runtime.inflight)
        t0 = time.monotonic()
        while harness.runtime.inflight and time.monotonic() - t0 < drain_timeout_s:
            await asyncio.sleep(0.05)
        left = harness.runtime.inflight
    finally:
        if runner is not None:
            await runner.cleanup()
        await harness.stop()
    if left:
        log.warning("drain timed out with %d request(s) in flight; their tools were killed", left)
        return 1
    return 0
