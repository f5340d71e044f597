"""The real tools: BM25 RAG over the stdlib, web search over the fixture site, the coding repository."""

import asyncio

import pytest

from agentdyn.tools.coding import BUGGY_LINE, FIXED_LINE, apply_patch, repo_init, run_tests
from agentdyn.tools.rag import BM25, corpus_files, rag_index, rag_query, tokenize
from agentdyn.tools.websearch import parse_html, web_search
from agentdyn.website import FixtureSite


def test_bm25_ranks_matching_document_first():
    docs = [
        tokenize("socket timeout connection refused"),
        tokenize("json decoder error"),
        tokenize("socket socket buffer"),
    ]
    bm = BM25.from_docs(docs)
    top = bm.top(tokenize("json error"), 2)
    assert top[0][0] == 1
    assert bm.scores(tokenize("socket"))[2] > bm.scores(tokenize("socket"))[0]  # tf and length


def test_rag_index_and_query_on_the_stdlib(tmp_path):
    files = corpus_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    shards = 8
    shard = next(i for i, f in enumerate(files) if f.endswith("json/decoder.py")) % shards
    info = rag_index({"shard": shard, "shards": shards}, str(tmp_path))
    assert info["files"] > 10 and info["index_bytes"] > 10_000
    res = rag_query({"query": "JSONDecodeError lineno colno", "shard": shard, "shards": shards, "k": 3}, str(tmp_path))
    assert any("json" in h["source"] for h in res["hits"])
    assert res["hits"][0]["score"] >= res["hits"][-1]["score"]


def test_web_search_crawls_the_fixture_site(tmp_path):
    async def go():
        site = FixtureSite(n_pages=60, latency_s=0.0)
        url = await site.start()
        try:
            res = await asyncio.to_thread(
                web_search, {"base_url": url, "query": "socket timeout", "pages": 8}, str(tmp_path)
            )
        finally:
            await site.stop()
        return res, site

    res, site = asyncio.run(go())
    assert res["pages_fetched"] == 8 and res["bytes"] > 1000
    assert res["results"] and res["results"][0]["score"] > 0
    assert site.requests == 9  # the search page + 8 pages, each fetched once
    assert site.describe()["link"]["emulated"] is True


def test_parse_html_extracts_text_links_title():
    title, text, links = parse_html(
        "<html><head><title>T</title><script>x=1</script></head><body><p>Hello <a href='/page/2'>w</a></p></body></html>"
    )
    assert title == "T" and "Hello" in text and "x=1" not in text and links == ["/page/2"]


def test_web_search_needs_base_url(tmp_path):
    with pytest.raises(ValueError, match="args.base_url"):
        web_search({"query": "x"}, str(tmp_path))


@pytest.mark.slow
def test_coding_repo_fails_then_passes_after_the_patch(tmp_path):
    repo_init({"work": 2000}, str(tmp_path))
    before = run_tests({}, str(tmp_path))
    assert before["exit_code"] != 0 and before["failed"] >= 1
    with pytest.raises(ValueError, match=r"edits\[0\].old occurs 0 times"):
        apply_patch({"edits": [{"path": "mathlib/primes.py", "old": "nope", "new": "x"}]}, str(tmp_path))
    apply_patch({"edits": [{"path": "mathlib/primes.py", "old": BUGGY_LINE, "new": FIXED_LINE}]}, str(tmp_path))
    after = run_tests({}, str(tmp_path))
    assert after["exit_code"] == 0 and after["failed"] == 0 and after["passed"] == 11


def test_patch_cannot_leave_the_repository(tmp_path):
    repo_init({"work": 200}, str(tmp_path))
    with pytest.raises(ValueError, match="leaves the repository"):
        apply_patch({"edits": [{"path": "../../etc/passwd", "old": "a", "new": "b"}]}, str(tmp_path))
