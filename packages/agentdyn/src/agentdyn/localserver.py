"""The start/stop lifecycle the offline stack's emulated services (LLM, fixture site) share."""

from __future__ import annotations

from abc import ABC, abstractmethod

from aiohttp import web


class LocalServer(ABC):
    """Serves :meth:`app` on ``host:port`` (port 0: a free one, read back once bound) until :meth:`stop`."""

    path = ""  # what :attr:`url` adds after host and port (e.g. an API's version prefix)

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.runner: web.AppRunner | None = None

    @abstractmethod
    def app(self) -> web.Application:
        """The aiohttp application this server answers with."""

    @property
    def url(self) -> str:
        """Where clients reach the app; the bound port once :meth:`start` has returned."""
        return f"http://{self.host}:{self.port}{self.path}"

    async def start(self) -> str:
        """Bind and start serving; returns :attr:`url` with the port actually bound."""
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        self.port = self.runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        """Close the listener and every open connection; a second call does nothing."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
