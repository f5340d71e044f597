"""LLM access through any OpenAI-compatible chat-completions endpoint (base URL, key, model).

Timeouts per attempt, bounded retries with exponential backoff on connection errors, timeouts,
429 and 5xx; after the last attempt an ``LLMError`` says which endpoint failed, how often, and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp

__all__ = ["LLMConfig", "LLMClient", "LLMError"]

log = logging.getLogger(__name__)


class LLMError(RuntimeError):
    """The LLM endpoint could not answer within the bounded retries."""


@dataclass
class LLMConfig:
    base_url: str
    model: str = "agentdyn-emulated"
    api_key: str = "none"
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.25

    def __post_init__(self) -> None:
        if not str(self.base_url).startswith(("http://", "https://")):
            raise ValueError(f"llm base_url must be an http(s) URL, not {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"llm timeout_s must be > 0, not {self.timeout_s!r}")
        if self.retries < 0:
            raise ValueError(f"llm retries must be >= 0, not {self.retries!r}")


class LLMClient:
    """``await client.chat(messages, tools)`` -> (assistant message dict, info dict)."""

    def __init__(self, config: LLMConfig):
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self.calls = 0
        self.retried = 0

    @property
    def url(self) -> str:
        return self.config.base_url.rstrip("/") + "/chat/completions"

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def chat(self, messages: list[dict], tools: list[dict] | None = None, **extra) -> tuple[dict, dict]:
        body = {"model": self.config.model, "messages": messages, **extra}
        if tools:
            body["tools"] = tools
        headers = {"Authorization": f"Bearer {self.config.api_key}"}
        sess = await self._sess()
        attempts = self.config.retries + 1
        last = "no attempt made"
        t0 = time.monotonic()
        for attempt in range(attempts):
            if attempt:
                self.retried += 1
                await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
                async with sess.post(self.url, json=body, headers=headers, timeout=timeout) as r:
                    if r.status == 429 or r.status >= 500:
                        last = f"HTTP {r.status}: {(await r.text())[:200]}"
                        continue
                    if r.status >= 400:
                        raise LLMError(
                            f"llm: {self.url} rejected the request with HTTP {r.status}: {(await r.text())[:300]}"
                        )
                    data = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if isinstance(e, asyncio.TimeoutError):
                    last = f"no answer within {self.config.timeout_s:g}s"
                continue
            try:
                msg = data["choices"][0]["message"]
            except (KeyError, IndexError, TypeError):
                raise LLMError(f"llm: {self.url} answered without choices[0].message") from None
            self.calls += 1
            return msg, {"latency_s": time.monotonic() - t0, "attempts": attempt + 1, "usage": data.get("usage", {})}
        raise LLMError(f"llm: {self.url} failed after {attempts} attempt(s): {last}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
