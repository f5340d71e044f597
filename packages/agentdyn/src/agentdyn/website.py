"""The fixture web site the web-search tool crawls: many linked HTML pages served by aiohttp.

Pages are made from the Python standard library's sources on disk (module docstrings, comments and
names), so they are real text of real size; each page links to ``links`` others. ``/search?q=``
ranks pages by BM25. Responses pass through an emulated network link (``hwtopo.LinkShaper``:
latency + shared bandwidth), labelled emulated in ``describe()``.
"""

from __future__ import annotations

import asyncio
import html
import os
import re

from aiohttp import web

import hwtopo

from .localserver import LocalServer
from .tools.rag import BM25, corpus_files, corpus_root, read_texts, tokenize

__all__ = ["FixtureSite", "build_pages"]

_DOC = re.compile(r'"""(.*?)"""', re.S)
_COMMENT = re.compile(r"^\s*#\s?(.*)$", re.M)
_NAMES = re.compile(r"^\s*(?:def|class)\s+(\w+)", re.M)


def build_pages(n_pages: int = 300, links: int = 8, max_chars: int = 40_000) -> list[dict]:
    """Deterministic pages {title, body, links} from the first ``n_pages`` stdlib files."""
    files = corpus_files()
    step = max(1, len(files) // max(1, n_pages))
    files = files[::step][:n_pages]
    pages = []
    for path, src in read_texts(files):
        parts = [d.strip() for d in _DOC.findall(src)] + _COMMENT.findall(src)
        names = _NAMES.findall(src)
        body = "\n\n".join(p for p in parts if p)[:max_chars]
        title = os.path.relpath(path, corpus_root())
        pages.append({"title": title, "body": body, "names": names[:200]})
    n = len(pages)
    for i, p in enumerate(pages):
        p["links"] = sorted({(i * 7 + j * 13 + j * j) % n for j in range(1, links + 1)} - {i})
    return pages


def _render(i: int, p: dict) -> str:
    paras = "".join(f"<p>{html.escape(x)}</p>" for x in p["body"].split("\n\n") if x.strip())
    links = "".join(f'<li><a href="/page/{j}">page {j}</a></li>' for j in p["links"])
    names = ", ".join(html.escape(x) for x in p["names"])
    return (
        f"<html><head><title>{html.escape(p['title'])}</title><style>p{{margin:0}}</style></head>"
        f"<body><h1>{html.escape(p['title'])}</h1>{paras}<p>Defines: {names}.</p><ul>{links}</ul></body></html>"
    )


class FixtureSite(LocalServer):
    """aiohttp site of linked pages; ``await start()`` binds 127.0.0.1 on a free port."""

    def __init__(
        self,
        n_pages: int = 300,
        latency_s: float = 0.02,
        bandwidth_bytes_per_s: float = 50e6,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.pages = build_pages(n_pages)
        self.rendered = [_render(i, p).encode() for i, p in enumerate(self.pages)]
        self.index = BM25.from_docs(
            [tokenize(p["title"] + " " + p["body"][:4000] + " " + " ".join(p["names"])) for p in self.pages]
        )
        self.shaper = hwtopo.LinkShaper(bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)
        super().__init__(host, port)
        self.requests = 0

    def describe(self) -> dict:
        return {"pages": len(self.pages), "link": self.shaper.describe()}

    async def _delay(self, nbytes: int) -> None:
        d = self.shaper.delay_s(nbytes)
        if d > 0:
            await asyncio.sleep(d)

    async def _page(self, request: web.Request) -> web.Response:
        self.requests += 1
        try:
            i = int(request.match_info["i"])
            body = self.rendered[i]
        except (ValueError, IndexError):
            raise web.HTTPNotFound() from None
        await self._delay(len(body))
        return web.Response(body=body, content_type="text/html")

    async def _search(self, request: web.Request) -> web.Response:
        self.requests += 1
        q = tokenize(request.query.get("q", ""))
        hits = self.index.top(q, 10)
        items = "".join(f'<li><a href="/page/{d}">{html.escape(self.pages[d]["title"])}</a></li>' for d, _ in hits)
        body = f"<html><head><title>search</title></head><body><ol>{items}</ol></body></html>".encode()
        await self._delay(len(body))
        return web.Response(body=body, content_type="text/html")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/page/{i}", self._page)
        app.router.add_get("/search", self._search)
        return app
