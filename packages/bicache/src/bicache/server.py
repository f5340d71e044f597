"""aiohttp server: ``POST /v1/generate`` (JSON), OpenAI-style ``/v1/completions`` and ``/v1/chat/completions``.

Requests go to a background :class:`~bicache.engine.Engine`, which batches concurrent requests and
reuses shared prefixes. Bad requests get a 400 with one sentence naming the field; a body over
``max_body_bytes`` 413, JSON nested deeper than 64 levels 400, a full engine queue 429 with
``Retry-After``. With a ``token`` every route needs ``Authorization: Bearer <token>`` (401 without);
a host beyond loopback needs one. Unexpected failures are a 500 without internals (logged).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from hwtopo.httpguard import BadRequest, check_bind, middleware, read_json

from .diffusion import DecodeConfig
from .engine import Engine, QueueFull

ENGINE_KEY = web.AppKey("engine", Engine)
NAME_KEY = web.AppKey("model_name", str)
BODY_LIMIT_KEY = web.AppKey("max_body_bytes", int)

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 64

__all__ = ["BadRequest", "make_app", "serve"]


def _error_body(status: int, message: str, field: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": status}}


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response(_error_body(status, message, field), status=status)


async def _json(request: web.Request) -> dict:
    body = await read_json(request, max_bytes=request.app[BODY_LIMIT_KEY], max_depth=MAX_JSON_DEPTH)
    if not isinstance(body, dict):
        raise BadRequest('request body must be a JSON object such as {"prompt": "..."}')
    return body


def _int_field(body: dict, name: str, default: int, hi: int) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise BadRequest(f"field '{name}' must be an integer from 1 to {hi}", field=name)
    return v


def _decode_cfg(engine: Engine, body: dict, length_field: str = "gen_length") -> DecodeConfig:
    base, hi = engine.cfg, engine.dlm.max_length
    gen = _int_field(body, length_field, base.gen_length, hi)
    block = _int_field(body, "block_length", base.block_length if gen % base.block_length == 0 else gen, hi)
    steps = _int_field(body, "steps", gen, hi)
    cfg = DecodeConfig(gen, block, steps)
    try:
        cfg.validate()
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return cfg


def _too_long(engine: Engine, n: int, field: str) -> BadRequest:
    return BadRequest(
        f"field '{field}' is longer than the model's {engine.dlm.max_length} positions ({n} tokens or more)",
        field=field,
    )


def _check_text_length(engine: Engine, text: str, field: str) -> None:
    """Reject text that cannot fit the model before tokenizing it (a C-speed pass, no Python loop).

    A vocabulary word is one token of at most ``longest`` characters and an unknown word at least
    one token per character, so text with more than ``max_length * longest`` non-space characters
    needs more than ``max_length`` tokens; what passes is small enough to tokenize on the event loop.
    """
    longest = max(len(w) for w in engine.dlm.vocab.index)
    chars = len("".join(text.split()))
    if chars > engine.dlm.max_length * longest:
        raise _too_long(engine, -(-chars // longest), field)


def _text_ids(engine: Engine, text: str, field: str, open_vocab: bool) -> list[int]:
    _check_text_length(engine, text, field)
    try:
        return engine.dlm.vocab.encode(text, open_vocab=open_vocab)
    except UnicodeEncodeError:
        raise BadRequest(
            f"field '{field}' holds a lone surrogate code point; send valid Unicode text", field=field
        ) from None
    except ValueError as exc:
        raise BadRequest(str(exc), field=field) from None


def _token_list(engine: Engine, toks) -> list[int]:
    if not isinstance(toks, list):
        raise BadRequest("field 'tokens' must be a list of integer token ids", field="tokens")
    if len(toks) > engine.dlm.max_length:
        raise _too_long(engine, len(toks), "tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise BadRequest("field 'tokens' must be a list of integer token ids", field="tokens")
    return toks


def _prompt_ids(engine: Engine, body: dict, field: str = "prompt", open_vocab: bool | None = None) -> list[int]:
    """Prompt token ids from ``tokens`` or the text in ``field``.

    Text outside the task vocabulary is spelled as UTF-8 byte tokens when ``open_vocab`` (the
    OpenAI-style routes; ``/v1/generate`` when the body says ``"open_vocab": true``), else a 400.
    """
    vocab = engine.dlm.vocab
    if open_vocab is None:
        open_vocab = body.get("open_vocab", False)
        if not isinstance(open_vocab, bool):
            raise BadRequest("field 'open_vocab' must be true or false", field="open_vocab")
    if "tokens" in body:
        ids = _token_list(engine, body["tokens"])
    else:
        text = body.get(field)
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise BadRequest(f"field '{field}' is required and must be a string (or send 'tokens': [ids])", field=field)
        ids = _text_ids(engine, text, field, open_vocab)
    if not ids:
        raise BadRequest(f"field '{field}' is empty; give at least one token", field=field)
    if ids[0] != vocab.bos_id:
        ids = [vocab.bos_id, *ids]
    return ids


async def _complete(engine: Engine, ids: list[int], cfg: DecodeConfig):
    try:
        fut = engine.submit(ids, cfg)
    except QueueFull as exc:
        raise web.HTTPTooManyRequests(
            text=json.dumps(_error_body(429, str(exc), None)),
            content_type="application/json",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return await asyncio.wrap_future(fut)


def _answer_text(engine: Engine, tokens: list[int]) -> tuple[str, str]:
    vocab = engine.dlm.vocab
    if vocab.eos_id in tokens:
        return vocab.decode(tokens[: tokens.index(vocab.eos_id)]), "stop"
    return vocab.decode(tokens), "length"


def _usage(ids: list[int], tokens: list[int]) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json(request)
    ids = _prompt_ids(engine, body)
    cfg = _decode_cfg(engine, body)
    c = await _complete(engine, ids, cfg)
    text, finish = _answer_text(engine, c.tokens)
    return web.json_response(
        {
            "text": text,
            "tokens": c.tokens,
            "finish_reason": finish,
            "latency_s": round(c.latency_s, 5),
            "mode": c.mode,
            "depth": c.depth,
            "prefix_len": c.prefix_len,
            "shared_fraction": c.fraction,
            "batch_size": c.batch_size,
            "explain": c.explain,
        }
    )


async def _openai(request: web.Request, body: dict, ids: list[int], kind: str) -> web.Response:
    """Decode ``ids`` and answer in the OpenAI completions / chat.completions shape."""
    engine = request.app[ENGINE_KEY]
    cfg = _decode_cfg(engine, body, "max_tokens")
    c = await _complete(engine, ids, cfg)
    text, finish = _answer_text(engine, c.tokens)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        prefix, obj = "chatcmpl", "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        prefix, obj = "cmpl", "text_completion"
    return web.json_response(
        {
            "id": f"{prefix}-{uuid.uuid4().hex[:16]}",
            "object": obj,
            "created": int(time.time()),
            "model": request.app[NAME_KEY],
            "choices": [choice],
            "usage": _usage(ids, c.tokens),
        }
    )


async def completions(request: web.Request) -> web.Response:
    body = await _json(request)
    return await _openai(request, body, _prompt_ids(request.app[ENGINE_KEY], body, open_vocab=True), "text")


def _message_text(i: int, m) -> str:
    """The text of one chat message: a string, null (an assistant turn that only called tools) or
    a list of ``{"type": "text", "text": ...}`` parts (other part types are not supported)."""
    if not isinstance(m, dict):
        raise BadRequest(f"field 'messages[{i}]' must be an object with 'role' and 'content'", field="messages")
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f'field \'messages[{i}].content\' parts must be {{"type": "text", "text": str}}')
            texts.append(part["text"])
        return " ".join(texts)
    raise BadRequest(f"field 'messages[{i}].content' must be a string, null or a list of text parts")


async def chat_completions(request: web.Request) -> web.Response:
    body = await _json(request)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest('field \'messages\' must be a non-empty list of {"role", "content"} objects')
    parts = [_message_text(i, m) for i, m in enumerate(msgs)]
    text = " ".join(p for p in parts if p)
    ids = _prompt_ids(request.app[ENGINE_KEY], {"messages": text}, "messages", open_vocab=True)
    return await _openai(request, body, ids, "chat")


async def models(request: web.Request) -> web.Response:
    name = request.app[NAME_KEY]
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "bicache"}]})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        {
            "status": "ok",
            "mode": engine.mode,
            "layers": engine.dlm.num_layers,
            "stats": engine.stats.summary(),
            "prefix_store": {
                "entries": len(engine.store.entries),
                "bytes": engine.store.nbytes(),
                "hits": engine.store.hits,
                "misses": engine.store.misses,
                "evictions": engine.store.evictions,
            },
        }
    )


def make_app(
    engine: Engine,
    model_name: str = "bicache-tiny-dlm",
    *,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> web.Application:
    """The aiohttp application; the engine's background thread starts and stops with the app.

    ``token``: the bearer token every request must carry (None: no authentication, loopback only).
    """
    guard = middleware(token, max_body_bytes, _error)
    app = web.Application(middlewares=[guard], client_max_size=max_body_bytes)
    app[ENGINE_KEY] = engine
    app[NAME_KEY] = model_name
    app[BODY_LIMIT_KEY] = max_body_bytes

    async def on_startup(app: web.Application) -> None:
        engine.start()

    async def on_cleanup(app: web.Application) -> None:
        engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/generate", generate)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, token: str | None = None) -> None:
    """Serve until interrupted; a ``host`` beyond loopback needs a ``token`` (ValueError otherwise)."""
    check_bind(host, token)
    web.run_app(make_app(engine, token=token), host=host, port=port, print=None)
