"""Web search tool: query the fixture site's search page, fetch result pages and the pages they link
to (concurrently, over real HTTP), parse the HTML, rank pages with BM25 and extract the sentences
that best answer the query. Network- and parse-bound.
"""

from __future__ import annotations

import re
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser

from .rag import BM25, tokenize

__all__ = ["web_search", "parse_html"]


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.text: list[str] = []
        self.title = ""
        self._in_title = False
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)
        elif tag == "title":
            self._in_title = True
        elif tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif not self._skip:
            self.text.append(data)


def parse_html(html: str) -> tuple[str, str, list[str]]:
    """(title, visible text, links) of an HTML page."""
    p = _Page()
    p.feed(html)
    p.close()
    return p.title.strip(), " ".join(" ".join(p.text).split()), p.links


def _fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


def web_search(args: dict, workdir: str) -> dict:
    """Search ``base_url`` for ``query``; fetch up to ``pages`` pages (results, then their links)."""
    base = str(args.get("base_url", "")).rstrip("/")
    query = str(args.get("query", "")).strip()
    if not base.startswith("http"):
        raise ValueError("args.base_url: required, the http URL of the site to search")
    if not query:
        raise ValueError("args.query: required, a non-empty search query")
    budget = int(args.get("pages", 12))
    timeout = float(args.get("timeout_s", 10))
    threads = int(args.get("threads", 4))
    _, _, links = parse_html(_fetch(f"{base}/search?q={urllib.parse.quote(query)}", timeout))
    frontier = [urllib.parse.urljoin(base + "/", u) for u in links if "/page/" in u]
    seen: set[str] = set()
    pages: list[tuple[str, str, str]] = []
    nbytes = 0
    with ThreadPoolExecutor(threads) as pool:
        while frontier and len(pages) < budget:
            batch: list[str] = []
            for u in frontier:
                if u not in seen and len(batch) + len(pages) < budget:
                    seen.add(u)
                    batch.append(u)
            frontier = []
            for u, html in zip(batch, pool.map(lambda u: _fetch(u, timeout), batch)):
                nbytes += len(html)
                title, text, out = parse_html(html)
                pages.append((u, title, text))
                frontier.extend(urllib.parse.urljoin(u, x) for x in out if "/page/" in x)
    if not pages:
        return {"query": query, "results": [], "pages_fetched": 0, "bytes": nbytes}
    q = tokenize(query)
    bm = BM25.from_docs([tokenize(t + " " + x) for _, t, x in pages])
    results = []
    for doc, score in bm.top(q, int(args.get("k", 3))):
        url, title, text = pages[doc]
        sentences = re.split(r"(?<=[.!?])\s+", text)
        best = sorted(sentences, key=lambda s: -sum(s.lower().count(t) for t in q))[:2]
        results.append({"url": url, "title": title, "score": round(score, 3), "extract": " ".join(best)[:400]})
    return {"query": query, "results": results, "pages_fetched": len(pages), "bytes": nbytes}
