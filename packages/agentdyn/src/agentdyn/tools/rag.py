"""RAG QA tools: build a BM25 index over a real corpus on disk (the Python standard library's
sources) and answer queries from it, reading the matching passages back from disk.

``rag_index`` reads one shard of the corpus, chunks files into passages, writes the inverted index
to the request's working directory (fsync'd: a real disk write) and reports its size.
``rag_query`` loads that index from disk, scores passages with BM25 (k1=1.2, b=0.75), and reads
the top passages from their source files.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator

__all__ = ["corpus_files", "read_texts", "tokenize", "BM25", "rag_index", "rag_query"]

_TOKEN = re.compile(r"[a-z][a-z0-9]+")
STOP = frozenset(
    "the and for that this with from are not you can def self return none true false if else elif import "
    "is in of to a an be as by or it on at".split()
)
CHUNK_LINES = 40


def corpus_root() -> str:
    return os.path.dirname(os.__file__)


def corpus_files(root: str | None = None) -> list[str]:
    """Sorted .py files of the standard library (tests, idlelib, lib2to3, site-packages left out)."""
    root = root or corpus_root()
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__", "dist-packages"}
    out: list[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        out.extend(os.path.join(d, f) for f in files if f.endswith(".py"))
    return sorted(out)


def read_texts(paths: list[str]) -> Iterator[tuple[str, str]]:
    """``(path, text)`` of each file of ``paths`` that can be read, bytes that are not UTF-8 replaced:
    one unreadable file of the corpus skips that file, not the index or the site built from it."""
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        yield path, text


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOP]


class BM25:
    """Okapi BM25 over an inverted index {term: [[doc, tf], ...]} with document lengths."""

    def __init__(self, postings: dict[str, list[list[int]]], doc_len: list[int], k1: float = 1.2, b: float = 0.75):
        self.postings = postings
        self.doc_len = doc_len
        self.n = len(doc_len)
        self.avgdl = (sum(doc_len) / self.n) if self.n else 1.0
        self.k1, self.b = k1, b

    @classmethod
    def from_docs(cls, docs: list[list[str]]) -> BM25:
        postings: dict[str, list[list[int]]] = {}
        for i, toks in enumerate(docs):
            for term, tf in Counter(toks).items():
                postings.setdefault(term, []).append([i, tf])
        return cls(postings, [len(d) for d in docs])

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1 + (self.n - df + 0.5) / (df + 0.5))

    def scores(self, query: list[str]) -> dict[int, float]:
        out: dict[int, float] = {}
        for term in set(query):
            idf = self.idf(term)
            for doc, tf in self.postings.get(term, ()):
                norm = self.k1 * (1 - self.b + self.b * self.doc_len[doc] / self.avgdl)
                out[doc] = out.get(doc, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        return out

    def top(self, query: list[str], k: int) -> list[tuple[int, float]]:
        s = self.scores(query)
        return sorted(s.items(), key=lambda x: (-x[1], x[0]))[:k]


def _shard(files: list[str], shard: int, shards: int) -> list[str]:
    return [f for i, f in enumerate(files) if i % shards == shard]


def _index_path(workdir: str, shard: int, shards: int) -> str:
    return os.path.join(workdir, f"rag-index-{shard}-of-{shards}.json")


def rag_index(args: dict, workdir: str) -> dict:
    """Build the BM25 index of corpus shard ``shard`` of ``shards`` and write it to disk."""
    shards = int(args.get("shards", 16))
    shard = int(args.get("shard", 0)) % shards
    files = _shard(corpus_files(args.get("root")), shard, shards)
    docs: list[list[str]] = []
    meta: list[list] = []
    nbytes = 0
    for path, text in read_texts(files):
        lines = io.StringIO(text).readlines()  # split at newlines only, as reading the file by lines does
        nbytes += sum(len(x) for x in lines)
        for start in range(0, len(lines), CHUNK_LINES):
            chunk = "".join(lines[start : start + CHUNK_LINES])
            docs.append(tokenize(chunk))
            meta.append([path, start, min(len(lines), start + CHUNK_LINES)])
    bm = BM25.from_docs(docs)
    out = _index_path(workdir, shard, shards)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "doc_len": bm.doc_len, "postings": bm.postings}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return {
        "index": os.path.basename(out),
        "files": len(files),
        "passages": len(docs),
        "terms": len(bm.postings),
        "corpus_bytes": nbytes,
        "index_bytes": os.path.getsize(out),
    }


def rag_query(args: dict, workdir: str) -> dict:
    """Answer ``query`` from the on-disk index: top-``k`` passages with their text."""
    query = str(args.get("query", "")).strip()
    if not query:
        raise ValueError("args.query: required, a non-empty question")
    shards = int(args.get("shards", 16))
    shard = int(args.get("shard", 0)) % shards
    path = _index_path(workdir, shard, shards)
    if not os.path.exists(path):
        rag_index({"shard": shard, "shards": shards, "root": args.get("root")}, workdir)
    with open(path) as f:
        data = json.load(f)
    bm = BM25(data["postings"], data["doc_len"])
    hits = []
    for doc, score in bm.top(tokenize(query), int(args.get("k", 3))):
        src, a, b = data["meta"][doc]
        with open(src, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()[a:b]
        hits.append(
            {
                "source": os.path.relpath(src, corpus_root()),
                "lines": [a + 1, b],
                "score": round(score, 3),
                "text": "".join(lines)[:600],
            }
        )
    return {"query": query, "hits": hits}
