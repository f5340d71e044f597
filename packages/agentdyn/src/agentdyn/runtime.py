"""The agent runtime: an asyncio loop of LLM calls and sandboxed tool calls per request.

``Runtime.run(AgentRequest)`` -> ``AgentResult`` with the answer (or a clear error), the latency,
a per-request timeline (queue, llm, tool_queue, tool events with their measured usage) and totals.
``Harness`` bundles what runs offline: the LLM emulator, the fixture web site and a runtime.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from .emulator import EmulatorConfig, LLMEmulator
from .llm import LLMClient, LLMConfig, LLMError
from .monitor import GroupWatcher, RequestUsage, SystemSampler
from .sandbox import Sandbox, SandboxLimits
from .scheduler import NativePolicy, Policy
from .website import FixtureSite

__all__ = ["TASK_TYPES", "TOOL_SCHEMAS", "AgentRequest", "AgentResult", "Runtime", "Harness", "validate_request"]

log = logging.getLogger(__name__)


def _fn(name: str, desc: str, props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required or []},
        },
    }


_INT = {"type": "integer"}
_STR = {"type": "string"}
TOOL_SCHEMAS = {
    "rag_index": _fn("rag_index", "Build the BM25 index of a corpus shard", {"shard": _INT, "shards": _INT}),
    "rag_query": _fn(
        "rag_query", "Top passages for a question", {"query": _STR, "k": _INT, "shard": _INT, "shards": _INT}, ["query"]
    ),
    "web_search": _fn("web_search", "Search the web, fetch and rank pages", {"query": _STR, "pages": _INT}, ["query"]),
    "repo_init": _fn("repo_init", "Check out the repository", {"work": _INT}),
    "read_file": _fn("read_file", "Read a file of the repository", {"path": _STR}, ["path"]),
    "apply_patch": _fn("apply_patch", "Apply exact-text edits", {"edits": {"type": "array"}}, ["edits"]),
    "run_tests": _fn("run_tests", "Run the repository's test suite", {"k": _STR}),
}
TASK_TYPES = {
    "rag_qa": ["rag_index", "rag_query"],
    "web_search": ["web_search"],
    "coding": ["repo_init", "read_file", "apply_patch", "run_tests"],
}


class RequestError(ValueError):
    """A malformed agent request; ``field`` names what is wrong, ``status`` is 400, 409 or 422."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


@dataclass
class AgentRequest:
    task_type: str
    input: dict = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    tool_timeout_s: float | None = None
    max_steps: int = 12


MAX_TEXT = 4096  # characters of a question or query: more is not a question
MAX_TOOL_TIMEOUT_S = 3600.0
_TEXT = ("text", MAX_TEXT)
# per task type: input field -> (kind, bound); the tools' own arguments come from these
INPUT_FIELDS: dict[str, dict[str, tuple]] = {
    "rag_qa": {"question": _TEXT, "shard": ("int", 0, 255), "shards": ("int", 1, 256)},
    "web_search": {"query": _TEXT, "pages": ("int", 1, 200), "searches": ("int", 0, 10)},
    "coding": {"work": ("int", 100, 1_000_000), "variant": ("choice", "fix", "hang")},
}


def _check_input(task_type: str, inp) -> dict:
    """The request's ``input`` checked against ``INPUT_FIELDS``: one 400 naming the first bad field."""
    if not isinstance(inp, dict):
        raise RequestError("input", "must be a JSON object")
    fields = INPUT_FIELDS[task_type]
    for key, value in inp.items():
        name = f"input.{key}"
        if key not in fields:
            raise RequestError(name, f"unknown field for {task_type}; valid: {', '.join(fields)}")
        kind, *bound = fields[key]
        if kind == "text" and not (isinstance(value, str) and 0 < len(value.strip()) and len(value) <= bound[0]):
            raise RequestError(name, f"must be a non-empty string of at most {bound[0]} characters")
        if kind == "int" and (
            isinstance(value, bool) or not isinstance(value, int) or not bound[0] <= value <= bound[1]
        ):
            raise RequestError(name, f"must be an integer in [{bound[0]}, {bound[1]}]")
        if kind == "choice" and value not in bound:
            raise RequestError(name, f"must be one of {', '.join(map(repr, bound))}")
    if task_type == "rag_qa" and inp.get("shard", 0) >= inp.get("shards", 4):
        raise RequestError("input.shard", f"must be below input.shards ({inp.get('shards', 4)})")
    return inp


def validate_request(body, max_tool_timeout_s: float = MAX_TOOL_TIMEOUT_S) -> AgentRequest:
    """A request body (parsed JSON) -> ``AgentRequest``; raises ``RequestError`` naming the field.
    ``max_tool_timeout_s``: the server's ceiling on the ``tool_timeout_s`` a client may ask for."""
    if not isinstance(body, dict):
        raise RequestError("body", 'must be a JSON object like {"task_type": "coding", "input": {}}')
    unknown = set(body) - {"task_type", "input", "request_id", "tool_timeout_s", "max_steps"}
    if unknown:
        raise RequestError(
            sorted(unknown)[0], "unknown field; valid: task_type, input, request_id, tool_timeout_s, max_steps"
        )
    tt = body.get("task_type")
    if tt is None:
        raise RequestError("task_type", f"required; one of {', '.join(TASK_TYPES)}")
    if not isinstance(tt, str):
        raise RequestError("task_type", f"must be a string, one of {', '.join(TASK_TYPES)}")
    if tt not in TASK_TYPES:
        raise RequestError("task_type", f"unknown task type {tt!r}; one of {', '.join(TASK_TYPES)}", status=422)
    inp = _check_input(tt, body.get("input", {}))
    to = body.get("tool_timeout_s")
    if to is not None and (
        isinstance(to, bool) or not isinstance(to, (int, float)) or not 0 < to <= max_tool_timeout_s
    ):
        raise RequestError(
            "tool_timeout_s", f"must be a number of seconds in (0, {max_tool_timeout_s:g}] (this server's ceiling)"
        )
    ms = body.get("max_steps", 12)
    if isinstance(ms, bool) or not isinstance(ms, int) or not 1 <= ms <= 100:
        raise RequestError("max_steps", "must be an integer in [1, 100]")
    rid = body.get("request_id", None)
    if rid is None:
        rid = uuid.uuid4().hex[:12]
    if not (
        isinstance(rid, str)
        and 0 < len(rid) <= 64
        and rid.isascii()
        and rid.replace("-", "").replace("_", "").isalnum()
    ):
        raise RequestError("request_id", "must be 1 to 64 ASCII letters, digits, '-' or '_'")
    return AgentRequest(tt, inp, rid, to, ms)


@dataclass
class AgentResult:
    request_id: str
    task_type: str
    ok: bool
    answer: str | None
    error: str | None
    latency_s: float
    timeline: list[dict]
    usage: RequestUsage
    policy: str

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "task_type": self.task_type,
            "ok": self.ok,
            "answer": self.answer,
            "error": self.error,
            "latency_s": round(self.latency_s, 4),
            "policy": self.policy,
            "usage": self.usage.to_dict(),
            "timeline": self.timeline,
        }


def _tool_failure(failed: list[str]) -> str | None:
    """The request's error when tool calls failed (the model may answer anyway): the first, and how many."""
    if not failed:
        return None
    more = f" (and {len(failed) - 1} more failed tool call(s))" if len(failed) > 1 else ""
    return failed[0] + more


class Runtime:
    """Runs agent requests against an LLM endpoint with sandboxed tools under a scheduling policy."""

    def __init__(
        self,
        llm: LLMConfig | LLMClient,
        policy: Policy | None = None,
        site_url: str | None = None,
        workroot: str | None = None,
        tool_timeout_s: float = 120.0,
        sampler: SystemSampler | None = None,
        keep_workdirs: bool = False,
        tool_threads: int | str | None = None,
        isolation: str = "auto",
    ):
        self.llm = llm if isinstance(llm, LLMClient) else LLMClient(llm)
        self.policy = policy or NativePolicy()
        self.site_url = site_url
        self._own_root = workroot is None
        self.workroot = workroot or tempfile.mkdtemp(prefix="agentdyn-")
        self.tool_timeout_s = tool_timeout_s
        self.sampler = sampler
        self.keep_workdirs = keep_workdirs
        self.watcher = GroupWatcher()
        # web_search reaches the fixture site and nothing else
        net = {"web_search": [site_url]} if site_url else {}
        self.sandbox = Sandbox(self.watcher, tool_threads=tool_threads, isolation=isolation, net=net)
        self.inflight = 0
        self.completed = 0
        self.failed = 0

    def _system(self, task_type: str) -> str:
        return f"You are a tool-using agent. task_type: {task_type}. Call tools, then answer briefly."

    def _tool_args(self, name: str, args: dict) -> dict:
        if name == "web_search" and self.site_url:
            args = {**args, "base_url": self.site_url}
        return args

    async def run(self, req: AgentRequest, on_tool=None) -> AgentResult:
        """Run one request to completion; never raises for LLM or tool failures (see ``error``)."""
        if req.task_type not in TASK_TYPES:
            raise RequestError("task_type", f"unknown task type {req.task_type!r}; one of {', '.join(TASK_TYPES)}", 422)
        t0 = time.monotonic()
        usage = RequestUsage()
        timeline: list[dict] = []
        answer = error = None

        def ev(kind: str, a: float, b: float, **kw) -> None:
            timeline.append({"phase": kind, "start": round(a - t0, 4), "end": round(b - t0, 4), **kw})

        workdir = self.sandbox.workdir(self.workroot)  # named by the server, never by the client
        self.inflight += 1
        try:
            tq = time.monotonic()
            async with self.policy.request_slot(req.request_id, req.task_type):
                if time.monotonic() - tq > 1e-3:
                    ev("queue", tq, time.monotonic())
                    usage.queue_wait_s += time.monotonic() - tq
                answer, error = await self._loop(req, workdir, usage, ev, on_tool)
        finally:
            self.inflight -= 1
            self.sandbox.release(workdir, remove=not self.keep_workdirs)
        ok = error is None
        self.completed += ok
        self.failed += not ok
        return AgentResult(
            req.request_id, req.task_type, ok, answer, error, time.monotonic() - t0, timeline, usage, self.policy.name
        )

    async def _loop(self, req, workdir, usage, ev, on_tool) -> tuple[str | None, str | None]:
        allowed = TASK_TYPES[req.task_type]
        tools = [TOOL_SCHEMAS[t] for t in allowed]
        messages: list[dict] = [
            {"role": "system", "content": self._system(req.task_type)},
            {"role": "user", "content": json.dumps(req.input)},
        ]
        limits = SandboxLimits(timeout_s=req.tool_timeout_s or self.tool_timeout_s)
        failed: list[str] = []  # each failed tool call: the request is not ok, whatever the model says
        for _ in range(req.max_steps):
            a = time.monotonic()
            try:
                msg, info = await self.llm.chat(messages, tools)
            except LLMError as e:
                ev("llm", a, time.monotonic(), error=str(e))
                usage.llm_wait_s += time.monotonic() - a
                return None, str(e)
            b = time.monotonic()
            ev("llm", a, b, attempts=info["attempts"])
            usage.llm_wait_s += b - a
            calls = msg.get("tool_calls") or []
            messages.append(
                {"role": "assistant", "content": msg.get("content"), **({"tool_calls": calls} if calls else {})}
            )
            if not calls:
                return msg.get("content") or "", _tool_failure(failed)
            for call in calls:
                fn = call.get("function") or {}
                name = fn.get("name", "")
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                    if not isinstance(args, dict):
                        raise ValueError("arguments must be a JSON object")
                except ValueError as e:
                    content = json.dumps({"error": f"bad arguments for {name!r}: {e}"})
                else:
                    if name not in allowed:
                        content = json.dumps(
                            {"error": f"tool {name!r} is not available; available: {', '.join(allowed)}"}
                        )
                    else:
                        content, err = await self._tool(
                            req, name, self._tool_args(name, args), workdir, limits, usage, ev, on_tool
                        )
                        if err:
                            failed.append(f"tool {name!r} failed: {err}")
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        return None, f"max_steps: the agent did not answer within {req.max_steps} LLM calls"

    async def _tool(self, req, name, args, workdir, limits, usage, ev, on_tool) -> tuple[str, str | None]:
        """Run one tool call: (what the model is told, the tool's error or None)."""
        q0 = time.monotonic()
        async with self.policy.tool_slot(req.request_id, req.task_type, name) as group:
            q1 = time.monotonic()
            res = await self.sandbox.run(name, args, workdir, limits, group)
            # inside the slot: the policy reads what it saw while this run held its admission
            self.policy.observe(req.task_type, name, res.usage)
        if q1 - q0 > 1e-3:
            ev("tool_queue", q0, q1, tool=name)
            usage.queue_wait_s += q1 - q0
        usage.tools.add(res.usage)
        usage.tool_calls += 1
        ev(
            "tool",
            res.start,
            res.end,
            tool=name,
            ok=res.ok,
            killed=res.killed,
            error=res.error,
            group=res.group,
            usage=res.usage.to_dict(),
        )
        if on_tool is not None:
            on_tool(req, name, res)
        body = {"ok": res.ok, "result": res.output} if res.ok else {"ok": False, "error": res.error}
        return json.dumps(body, default=str)[:4000], None if res.ok else (res.error or "failed")

    async def close(self) -> None:
        await self.sandbox.close()
        await self.llm.close()
        self.policy.close()
        if self._own_root:
            shutil.rmtree(self.workroot, ignore_errors=True)


class Harness:
    """Offline stack: LLM emulator + fixture site + runtime (``async with Harness() as h``)."""

    def __init__(
        self,
        policy: Policy | None = None,
        emulator: EmulatorConfig | None = None,
        llm: LLMConfig | None = None,
        site_pages: int = 300,
        site_latency_s: float = 0.05,
        tool_timeout_s: float = 120.0,
        sampler: SystemSampler | None = None,
        tool_threads: int | str | None = None,
        isolation: str = "auto",
    ):
        self.emulator = LLMEmulator(emulator) if llm is None else None
        self.llm_config = llm
        self.site = FixtureSite(n_pages=site_pages, latency_s=site_latency_s)
        self.policy = policy
        self.tool_timeout_s = tool_timeout_s
        self.sampler = sampler
        self.tool_threads = tool_threads
        self.isolation = isolation  # the tool sandbox: strict, auto or off (see agentdyn.sandbox)
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        """The runtime serving requests, once :meth:`start` has built it."""
        if self._runtime is None:
            raise RuntimeError("start() the harness first")
        return self._runtime

    async def start(self) -> Harness:
        if self.emulator is not None:
            url = await self.emulator.start()
            self.llm_config = LLMConfig(base_url=url, timeout_s=60, retries=2)
        assert self.llm_config is not None  # given, or the emulator's just set
        await self.site.start()
        try:
            self._runtime = Runtime(
                self.llm_config,
                self.policy,
                self.site.url,
                tool_timeout_s=self.tool_timeout_s,
                sampler=self.sampler,
                tool_threads=self.tool_threads,
                isolation=self.isolation,
            )
        except BaseException:  # e.g. SandboxUnavailable: nothing keeps running
            await self.stop()
            raise
        return self

    def set_policy(self, policy: Policy) -> None:
        self.runtime.policy.close()
        self.runtime.policy = policy

    async def run(self, task_type: str, input: dict | None = None, **kw) -> AgentResult:
        return await self.runtime.run(AgentRequest(task_type, input or {}, **kw))

    async def stop(self) -> None:
        if self._runtime is not None:
            await self._runtime.close()
        await self.site.stop()
        if self.emulator is not None:
            await self.emulator.stop()

    async def __aenter__(self) -> Harness:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
        await asyncio.sleep(0)
