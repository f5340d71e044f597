"""A local LLM emulator with the OpenAI chat-completions API (``agentdyn llm-emulator``).

Latency: each answer waits a time-to-first-token drawn from a lognormal (median ``ttft_s``,
``ttft_sigma``) plus its output tokens at a tokens/s rate drawn from a lognormal (median
``tokens_per_s``, ``tps_sigma``); everything is labelled emulated. Answers follow a scripted plan
per task type (read from ``task_type: <name>`` in the system message and the JSON input in the
first user message): which tools to call with which arguments, then a final answer summarising the
tool results. The "faster LLM" experiment is ``ttft_s``/``tokens_per_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import time
import uuid
from dataclasses import asdict, dataclass

from aiohttp import web

from hwtopo.httpguard import BadRequest, middleware, read_json

from .localserver import LocalServer
from .tools.coding import BUGGY_LINE, FIXED_LINE

__all__ = ["EmulatorConfig", "LLMEmulator", "plan_step", "PLANS"]


@dataclass
class EmulatorConfig:
    ttft_s: float = 0.4
    ttft_sigma: float = 0.25
    tokens_per_s: float = 60.0
    tps_sigma: float = 0.15
    tool_call_tokens: int = 40
    answer_tokens: int = 120
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ttft_s < 0:
            raise ValueError(f"ttft_s must be >= 0, not {self.ttft_s!r}")
        if self.tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, not {self.tokens_per_s!r}")

    def describe(self) -> dict:
        return {"emulated": True, **asdict(self)}


def _call(name: str, **args) -> dict:
    return {"name": name, "arguments": args}


def _rag(inp: dict, step: int) -> list[dict] | None:
    q = inp.get("question", "how are email headers parsed and encoded")
    shard = {"shard": int(inp.get("shard", 0)), "shards": int(inp.get("shards", 4))}
    plan = [
        [_call("rag_index", **shard)],
        [_call("rag_query", query=q, k=3, **shard)],
        [_call("rag_query", query=q + " example usage", k=3, **shard)],
    ]
    return plan[step] if step < len(plan) else None


def _web(inp: dict, step: int) -> list[dict] | None:
    q = inp.get("query", "socket timeout connection")
    pages = int(inp.get("pages", 12))
    plan = [
        [_call("web_search", query=q, pages=pages)],
        [_call("web_search", query=q + " error handling", pages=pages)],
    ]
    plan = plan[: int(inp.get("searches", 2))]  # 0: the model answers from what it knows
    return plan[step] if step < len(plan) else None


def _coding(inp: dict, step: int) -> list[dict] | None:
    new = FIXED_LINE
    if inp.get("variant") == "hang":  # a patch whose tests never finish (the tool must be killed)
        new = "    while n > 2:\n        pass\n" + FIXED_LINE
    plan = [
        [_call("repo_init", work=int(inp.get("work", 40_000)))],
        [_call("run_tests")],
        [_call("read_file", path="mathlib/primes.py")],
        [_call("apply_patch", edits=[{"path": "mathlib/primes.py", "old": BUGGY_LINE, "new": new}])],
        [_call("run_tests")],
    ]
    return plan[step] if step < len(plan) else None


PLANS = {"rag_qa": _rag, "web_search": _web, "coding": _coding}


def plan_step(messages: list[dict]) -> tuple[list[dict] | None, str]:
    """(tool calls to make next, or None to answer; the final answer text) for a conversation."""
    system = " ".join(str(m.get("content", "")) for m in messages if m.get("role") == "system")
    m = re.search(r"task_type:\s*(\w+)", system)
    task = m.group(1) if m else ""
    user = next((m for m in messages if m.get("role") == "user"), {})
    content = user.get("content") or "{}"
    try:
        inp = json.loads(content) if isinstance(content, str) else {}
        inp = inp if isinstance(inp, dict) else {}
    except json.JSONDecodeError:
        inp = {"question": content}
    step = sum(1 for m in messages if m.get("role") == "assistant")
    planner = PLANS.get(task)
    calls = planner(inp, step) if planner else None
    tool_msgs = [m for m in messages if m.get("role") == "tool"]
    if calls is None:
        last = tool_msgs[-1].get("content", "") if tool_msgs else ""
        return None, f"Done ({task or 'chat'}): {len(tool_msgs)} tool result(s); last: {str(last)[:200]}"
    return calls, ""


# An agent's conversation carries its tool results (retrieved passages, test logs): generous, bounded.
MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 64


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    """An OpenAI-shaped error answer."""
    err = {"message": message, "type": "invalid_request_error", **({"param": field} if field else {})}
    return web.json_response({"error": err}, status=status)


class LLMEmulator(LocalServer):
    """aiohttp app answering ``POST /v1/chat/completions`` and ``GET /v1/models``."""

    path = "/v1"

    def __init__(
        self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ):
        self.config = config or EmulatorConfig()
        self.token = token
        self.rng = random.Random(self.config.seed)
        super().__init__(host, port)
        self.requests = 0
        self.gate: asyncio.Event | None = None  # when set: answers wait for it (tests, demos)

    def latency_s(self, tokens: int, key: str | None = None) -> float:
        """The emulated time to answer with ``tokens`` tokens. With ``key`` (a conversation and its
        step) the draw depends only on it and the seed, so every policy compared on the same
        workload waits the same on the LLM, whatever order its calls come in; without, the next draw
        of the emulator's own sequence."""
        c = self.config
        rng = self.rng if key is None else random.Random(hashlib.sha256(f"{c.seed}:{key}".encode()).digest())
        ttft = c.ttft_s * rng.lognormvariate(0.0, c.ttft_sigma) if c.ttft_s > 0 else 0.0
        tps = c.tokens_per_s * rng.lognormvariate(0.0, c.tps_sigma)
        return ttft + tokens / tps

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, max_bytes=MAX_BODY_BYTES, max_depth=MAX_JSON_DEPTH)
        except BadRequest as e:
            return _error(e.status, f"body: {e}", "body")
        body = body if isinstance(body, dict) else {}  # not a JSON object: no messages
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return _error(400, "messages: required, a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in msgs):
            return _error(400, "messages: every message must be a JSON object", "messages")
        self.requests += 1
        try:
            calls, answer = plan_step(msgs)
        except (TypeError, ValueError) as e:  # an input field of the wrong type, e.g. "shard": "x"
            return _error(400, f"messages: the user message's input does not fit the task's plan ({e})", "messages")
        tokens = self.config.tool_call_tokens if calls else self.config.answer_tokens
        if self.gate is not None:
            await self.gate.wait()
        # the conversation is its opening (system and user messages); the step is how far it got
        opening = json.dumps([m.get("content") for m in msgs[:2]], default=str)
        await asyncio.sleep(self.latency_s(tokens, f"{opening}:{len(msgs)}"))
        message: dict = {"role": "assistant", "content": answer or None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for c in calls
            ]
        prompt_tokens = sum(len(str(m.get("content") or "")) for m in msgs) // 4
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "agentdyn-emulated"),
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "total_tokens": prompt_tokens + tokens,
                },
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "agentdyn-emulated", "object": "model", "emulated": True}]}
        )

    def app(self) -> web.Application:
        guard = middleware(self.token, MAX_BODY_BYTES, _error)
        app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL clients are given (``url``, which ends in ``/v1``)."""
        return self.url
