"""aiohttp server: ``POST /v1/generate`` (JSON), OpenAI-style ``/v1/completions`` and ``/v1/chat/completions``.

Requests go to a background :class:`~bicache.engine.Engine`, which batches concurrent requests and
reuses shared prefixes. Bad requests get a 400 with one sentence naming the field.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from .diffusion import DecodeConfig
from .engine import Engine

ENGINE_KEY = web.AppKey("engine", Engine)
NAME_KEY = web.AppKey("model_name", str)


class BadRequest(ValueError):
    """A client error: the message names the field and what is valid."""


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": status}}
    return web.json_response(body, status=status)


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest('request body is not valid JSON; send a JSON object such as {"prompt": "..."}') from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _int_field(body: dict, name: str, default: int, lo: int = 1) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"field '{name}' must be an integer >= {lo}")
    return v


def _decode_cfg(engine: Engine, body: dict, length_field: str = "gen_length") -> DecodeConfig:
    base = engine.cfg
    gen = _int_field(body, length_field, base.gen_length)
    block = _int_field(body, "block_length", base.block_length if gen % base.block_length == 0 else gen)
    steps = _int_field(body, "steps", gen)
    cfg = DecodeConfig(gen, block, steps)
    try:
        cfg.validate()
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return cfg


def _prompt_ids(engine: Engine, body: dict, field: str = "prompt", open_vocab: bool | None = None) -> list[int]:
    """Prompt token ids from ``tokens`` or the text in ``field``.

    Text outside the task vocabulary is spelled as UTF-8 byte tokens when ``open_vocab`` (the
    OpenAI-style routes; ``/v1/generate`` when the body says ``"open_vocab": true``), else a 400.
    """
    vocab = engine.dlm.vocab
    if open_vocab is None:
        open_vocab = body.get("open_vocab", False)
        if not isinstance(open_vocab, bool):
            raise BadRequest("field 'open_vocab' must be true or false")
    if "tokens" in body:
        toks = body["tokens"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise BadRequest("field 'tokens' must be a list of integer token ids")
        ids = toks
    else:
        text = body.get(field)
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise BadRequest(f"field '{field}' is required and must be a string (or send 'tokens': [ids])")
        try:
            ids = vocab.encode(text, open_vocab=open_vocab)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    if not ids:
        raise BadRequest(f"field '{field}' is empty; give at least one token")
    if ids[0] != vocab.bos_id:
        ids = [vocab.bos_id, *ids]
    return ids


async def _complete(engine: Engine, ids: list[int], cfg: DecodeConfig):
    try:
        fut = engine.submit(ids, cfg)
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


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))
    except web.HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001 - a failure is a 500 with one line, the server stays up
        return _error(500, f"generation failed: {exc}")


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
        raise BadRequest(f"field 'messages[{i}]' must be an object with 'role' and 'content'")
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
            },
        }
    )


def make_app(engine: Engine, model_name: str = "bicache-tiny-dlm") -> web.Application:
    """The aiohttp application; the engine's background thread starts and stops with the app."""
    app = web.Application(middlewares=[errors], client_max_size=1 << 20)
    app[ENGINE_KEY] = engine
    app[NAME_KEY] = model_name

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


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000) -> None:
    web.run_app(make_app(engine), host=host, port=port, print=None)
