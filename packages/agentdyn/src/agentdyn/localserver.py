"""The start/stop lifecycle the offline stack's emulated services (LLM, fixture site) share."""

from __future__ import annotations

from abc import ABC, abstractmethod

from aiohttp import web


class LocalServer(ABC):
    """Serves :meth:`app` on ``host:port`` (port 0: a free one, read back once bound) until :meth:`stop`."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.runner: web.AppRunner | None = None

    @abstractmethod
    def app(self) -> web.Application:
        """The aiohttp application this server answers with."""

    async def _serve(self) -> None:
        """Bind and start serving; ``self.port`` becomes the bound port so callers can build URLs."""
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listener and every open connection; a second call does nothing."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
