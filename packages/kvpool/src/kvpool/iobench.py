"""Focused I/O measurements of the bench: whole-chunk reads against ``torch.load``, and the
per-file filesystem cost of many small chunks against one file per chunk.

Both run on this machine's real disk without bandwidth caps (nothing here is emulated) and read
cold: kvpool's slab through O_DIRECT (no page cache by construction), the files after
``posix_fadvise(POSIX_FADV_DONTNEED)`` of each (fsync first), checked with ``mincore``.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch

from .keys import KVLayout
from .pagecache import drop, resident_bytes
from .passthrough import PassthroughStore
from .pool import KVPool
from .retrieval import TORCH_DTYPES

__all__ = ["chunk_read_bandwidth"]

log = logging.getLogger(__name__)


def _chunks(layout: KVLayout, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L, H, n, D = layout.num_layers, layout.kv_heads, layout.chunk_tokens, layout.head_dim
    return [torch.randn(L, 2, H, n, D, generator=g).to(TORCH_DTYPES[layout.dtype]) for _ in range(count)]


def _drop_all(files: list[Path]) -> int:
    """Evict every file from the page cache; the bytes still resident afterwards (mincore)."""
    for p in files:
        drop(p)
    return sum(resident_bytes(p) for p in files)


def _http_reads(pool: KVPool, keys: list[str]):
    """A timer of HTTP GETs of ``keys`` through ``kvpool serve`` on loopback, or None without aiohttp."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return None, None
    from .serve import BackgroundServer, PoolClient

    srv = BackgroundServer(pool).start()
    assert srv.url is not None  # set once started
    client = PoolClient(srv.url, model_id=pool.model_id, layout=pool.layout)

    def timed() -> float:
        t0 = time.perf_counter()
        for k in keys:
            if client.get_chunk(k) is None:
                raise RuntimeError(f"chunk {k} vanished from the pool during the bench")
        return time.perf_counter() - t0

    return timed, srv


def chunk_read_bandwidth(layout: KVLayout, workdir: Path, chunks: int = 8, reps: int = 5, seed: int = 0) -> dict:
    """kvpool ``get_chunk`` (and ``read_chunk``, and HTTP GET) against ``torch.load`` of the same chunks.

    Chunks are stored with ``put_chunk`` on one slab of the real disk and saved with
    ``torch.save`` to one file each; every rep reads all chunks each way, the files evicted from
    the page cache before every ``torch.load`` pass. Bandwidth = chunk bytes / wall seconds.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    data = _chunks(layout, chunks, seed)
    keys = [f"{seed:08x}{i:024x}" for i in range(chunks)]
    files = [workdir / f"{k}.pt" for k in keys]
    for p, t in zip(files, data):
        torch.save(t, p)
    store = PassthroughStore("ssd0", workdir, int(chunks * layout.chunk_bytes * 1.2) + (8 << 20))
    pool = KVPool([store], layout, "bench-chunks", {"ssd0": 1e9}, promote=False)
    timed_http, srv = _http_reads(pool, keys)
    series: dict[str, list[float]] = {"get_chunk": [], "read_chunk": [], "torch_load": [], "http_get": []}
    resident_after_drop = 0
    try:
        for k, t in zip(keys, data):
            if not pool.put_chunk(k, t):
                raise RuntimeError("the bench's slab had no room for its chunks")
        for rep in range(reps):
            # alternate which side reads first, so neither always follows the other's disk activity
            order = ("torch_load", "get_chunk") if rep % 2 == 0 else ("get_chunk", "torch_load")
            for what in order:
                if what == "torch_load":
                    resident_after_drop = max(resident_after_drop, _drop_all(files))
                    t0 = time.perf_counter()
                    got = [torch.load(p, weights_only=True) for p in files]
                else:
                    t0 = time.perf_counter()
                    got = [pool.get_chunk(k) for k in keys]
                series[what].append(time.perf_counter() - t0)
                if rep == 0 and not all(g is not None and torch.equal(g, t) for g, t in zip(got, data)):
                    raise RuntimeError(f"{what} returned other bytes than were stored")
            t0 = time.perf_counter()
            for k in keys:
                held = pool.read_chunk(k)
                if held is None:
                    raise RuntimeError(f"chunk {k} vanished from the pool during the bench")
                held.release()
            series["read_chunk"].append(time.perf_counter() - t0)
            if timed_http is not None:
                series["http_get"].append(timed_http())
    finally:
        if srv is not None:
            srv.stop()
        pool.close()
        for p in files:
            p.unlink(missing_ok=True)
    total = chunks * layout.chunk_bytes
    bw = {k: total / statistics.median(v) for k, v in series.items() if v}
    return {
        "layout": layout.tag(),
        "chunks": chunks,
        "chunk_bytes": layout.chunk_bytes,
        "reps": reps,
        "seconds": series,
        "bytes_per_s_median": bw,
        "get_chunk_bw_ratio_vs_torch_load": bw["get_chunk"] / bw["torch_load"],
        "read_chunk_bw_ratio_vs_torch_load": bw["read_chunk"] / bw["torch_load"],
        "http_get_bw_ratio_vs_torch_load": bw["http_get"] / bw["torch_load"] if "http_get" in bw else None,
        "torch_load_resident_bytes_after_drop": resident_after_drop,
        "method": (
            "real disk, no caps. kvpool: chunks stored with put_chunk (one extent each), read with get_chunk "
            "(one tensor out), read_chunk (views into the staging buffer, no copy) and HTTP GET through kvpool "
            "serve on loopback (PoolClient reads into the tensor); O_DIRECT, so never from the page cache. "
            "torch.load: one torch.save file per chunk, each fsync'd and evicted with posix_fadvise(DONTNEED) "
            "before every pass (resident bytes after the drop measured with mincore: "
            "torch_load_resident_bytes_after_drop). Bandwidth = chunk bytes / median wall seconds of a pass."
        ),
    }
