"""Guards for the small HTTP servers of mlsyskit: bounded JSON, bearer tokens, no tracebacks.

``parse_json`` checks a body's size, encoding and nesting depth before ``json.loads`` sees it (a
100,000-deep array would otherwise end in a RecursionError); ``middleware`` is an aiohttp
middleware that checks a bearer token, rejects oversized bodies with 413, turns :class:`BadRequest`
into a 400 JSON answer and any unexpected exception into a 500 without its traceback. aiohttp is
imported only inside the functions that need it: hwtopo itself does not depend on it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from itertools import accumulate

__all__ = ["BadRequest", "check_bind", "middleware", "parse_json", "read_json", "token_from_env"]

log = logging.getLogger(__name__)

# Escapes go first, so that a string is then quote, non-quotes, quote: a pattern that fails at most
# once (at an unterminated string), where the one-pass string pattern with escapes could retry at
# every escaped quote and take quadratic time.
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class BadRequest(ValueError):
    """A client error; the message names the problem (and the field, when one is at fault).

    ``status`` is the HTTP status to answer with: 400 unless the body was too large (413).
    """

    def __init__(self, message: str, *, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def _nesting_depth(text: str) -> int:
    """The deepest bracket nesting of ``text``, brackets inside strings not counted (no recursion).

    A backslash outside a string is invalid JSON: the parser stops there, so dropping it with the
    character after it cannot hide nesting that the parser would reach.
    """
    bare = _STRING.sub("", _ESCAPE.sub("", text))
    # an unterminated string runs to the end: the parser fails there, so what follows never nests
    bare = bare.split('"', 1)[0]
    steps = map(_STEP.__getitem__, _NOT_BRACKET.sub("", bare))
    return max(accumulate(steps), default=0)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadRequest(f"the number {text[:40]} is out of range for a 64-bit float")
    return value


def _no_constant(name: str) -> float:
    raise BadRequest(f"{name} is not valid JSON; send a finite number")


def parse_json(body: bytes, *, max_bytes: int, max_depth: int = 64) -> object:
    """Decode a JSON request body within limits; a :class:`BadRequest` names what broke which limit.

    Size is checked first (413), then UTF-8, then nesting depth by a bracket scan outside strings,
    and only then ``json.loads``, so no input reaches the recursive parser deeper than ``max_depth``.
    NaN, Infinity and numbers beyond a float's range are rejected too: they are not JSON.
    """
    if len(body) > max_bytes:
        raise BadRequest(f"request body is {len(body)} bytes; the limit is {max_bytes} bytes", status=413)
    if not body.strip():
        raise BadRequest("request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not UTF-8 (invalid byte at offset {exc.start}); send UTF-8 JSON") from None
    # fewer opening brackets than the limit cannot nest deeper than it: skip the scan
    if text.count("[") + text.count("{") > max_depth:
        depth = _nesting_depth(text)
        if depth > max_depth:
            raise BadRequest(f"JSON nesting is {depth} levels deep; the limit is {max_depth}")
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    except BadRequest:
        raise
    except ValueError:  # an integer longer than Python's int-string conversion limit
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise BadRequest(f"request body holds an integer of more than {limit} digits") from None


async def read_json(request, *, max_bytes: int, max_depth: int = 64) -> object:
    """Read an aiohttp request's body (at most ``max_bytes``) and :func:`parse_json` it."""
    from aiohttp import web

    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"request body is over the limit of {max_bytes} bytes", status=413) from None
    return parse_json(body, max_bytes=max_bytes, max_depth=max_depth)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token: anyone on the network could use the server."""
    if not token and not is_loopback(host):
        raise ValueError(
            f"--host {host} listens beyond this machine; give --token so that only clients "
            "holding it are served (or bind to 127.0.0.1)"
        )


def token_from_env(var: str) -> str | None:
    """The token in environment variable ``var``; None when unset or blank."""
    value = os.environ.get(var, "").strip()
    return value or None


def _default_error(status: int, message: str, field: str | None):
    from aiohttp import web

    body = {"error": message, **({"field": field} if field else {})}
    return web.json_response(body, status=status)


def middleware(
    token: str | None,
    max_body_bytes: int,
    error_response: Callable[[int, str, str | None], object] | None = None,
):
    """An aiohttp middleware: bearer token, body size, and errors answered as JSON.

    Requests without ``Authorization: Bearer <token>`` get 401 (compared in constant time) when a
    token is set; a declared Content-Length over ``max_body_bytes`` gets 413 before the body is
    read; :class:`BadRequest` becomes its status (400) and any other exception a 500 that names no
    internals (the traceback goes to the log). ``error_response(status, message, field)`` builds
    the answer, so each server keeps its own error shape; the default is ``{"error": message}``.
    """
    from aiohttp import web

    respond = error_response or _default_error
    expected = token.encode("utf-8") if token else None

    def _authorized(request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given_bytes = given.strip().encode("utf-8", "replace")
        return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, expected)

    @web.middleware
    async def guard(request, handler):
        if expected is not None and not _authorized(request):
            resp = respond(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>'", None)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if request.content_length is not None and request.content_length > max_body_bytes:
            msg = f"request body is {request.content_length} bytes; the limit is {max_body_bytes} bytes"
            return respond(413, msg, None)
        try:
            return await handler(request)
        except BadRequest as exc:
            return respond(exc.status, str(exc), exc.field)
        except web.HTTPRequestEntityTooLarge:
            return respond(413, f"request body is over the limit of {max_body_bytes} bytes", None)
        except web.HTTPException:
            raise
        except Exception:  # noqa: BLE001 - the client gets one line, the log gets the traceback
            log.exception("%s %s failed", request.method, request.path)
            return respond(500, "internal error while handling the request; the server log has the details", None)

    return guard
