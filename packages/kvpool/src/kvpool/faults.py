"""Fault-injection runs that count what a user of the pool must never see.

``same_key_race``: PUT/GET pairs of the same keys, all in flight at once, against ``kvpool serve``
on 127.0.0.1; counts GETs that returned bytes no acknowledged PUT sent (wrong bytes), GETs that
missed a key whose PUT had already been acknowledged (lost acknowledged writes), keys for which two
different byte strings were both acknowledged, and device space no chunk accounts for (leaked).

``kill9_puts``: a child process puts from several threads into one SSD slab and reports every
acknowledged put through a pipe; it is killed with SIGKILL mid-stream, the slab is reopened and
every acknowledged unit must be there with its bytes. Repeated on the same slab.

The tests assert that every count is zero; ``kvpool bench`` reports them under ``safety``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch

from .keys import KVLayout, unit_name
from .passthrough import ALIGN, HEADER_BYTES, PassthroughStore
from .pool import KVPool
from .stores import MemoryStore

__all__ = ["payload", "leaked_bytes", "same_key_race", "kill9_puts", "SlowWrites", "race_pool", "safety_counts"]

RACE_LAYOUT = KVLayout(3, 2, 8, chunk_tokens=16)  # 2 KiB units, 6 KiB chunks: many keys, fast


class SlowWrites:
    """A store throttle under which every unit write takes ``delay_s`` longer, so that concurrent
    requests often land in the middle of a chunk's write (the window the races are about)."""

    read_bandwidth_bytes_per_s = write_bytes_per_s = None

    def __init__(self, delay_s: float = 0.001):
        self.delay_s = delay_s

    def after_write(self, nbytes: int, started: float) -> None:
        time.sleep(self.delay_s)

    def after_read(self, nbytes: int, started: float) -> None:
        pass

    def describe(self) -> dict:
        return {"emulated": True, "write_delay_s": self.delay_s}


def race_pool(kind: str, directory: str | os.PathLike | None = None, chunks: int = 1100) -> KVPool:
    """A one-device pool (``"memory"``, or ``"ssd"`` in ``directory``) with room for ``chunks``
    chunks of ``RACE_LAYOUT`` and slow writes. With room for every key, a miss after an
    acknowledged put is a lost write, not an eviction."""
    store: MemoryStore | PassthroughStore
    if kind == "memory":
        store = MemoryStore("mem0", chunks * RACE_LAYOUT.chunk_bytes, throttle=SlowWrites())
    elif kind == "ssd":
        if directory is None:
            raise ValueError("directory: kind 'ssd' needs a directory for its slab")
        unit = -(-(RACE_LAYOUT.unit_bytes + HEADER_BYTES) // ALIGN) * ALIGN
        store = PassthroughStore("ssd0", directory, chunks * RACE_LAYOUT.num_layers * unit, throttle=SlowWrites())
    else:
        raise ValueError(f"kind must be 'memory' or 'ssd', not {kind!r}")
    return KVPool([store], RACE_LAYOUT, "race", {store.name: 1e9})


def payload(name: str, nbytes: int, variant: int = 0) -> bytes:
    """Deterministic bytes for ``name`` (each variant differs from the others in every block)."""
    seed = hashlib.blake2b(f"{name}/{variant}".encode(), digest_size=64).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def leaked_bytes(pool: KVPool) -> int:
    """Bytes allocated on the pool's live devices beyond what their visible chunks occupy.

    Call it with no write in flight. A unit no chunk record accounts for (an orphan of a failed or
    overtaken write) or a chunk missing units both show up here.
    """
    leaked = 0
    for name, store in pool.stores.items():
        if name in pool.placement.disabled:
            continue
        want = {
            unit_name(r.key, layer)
            for r in pool.placement.records.values()
            if r.device == name and r.ready
            for layer in range(r.units)
        }
        have = store.names()
        info = pool.placement.devices[name]
        per_unit = info.charge(pool.layout.unit_bytes, 1)
        leaked += per_unit * len(set(have) - want) + per_unit * len(want - set(have))
    return leaked


def _race_key(i: int, pairs: int, shared: int) -> str:
    """Even pairs share ``shared`` keys (consecutive ones the same key, so they are in flight
    together); odd pairs have a key of their own (PUT once: no later PUT can mask a lost one)."""
    name = f"shared{i * shared // pairs}" if i % 2 == 0 else f"solo{i}"
    return hashlib.blake2b(name.encode(), digest_size=16).hexdigest()


async def _race(url: str, chunk_bytes: int, pairs: int, shared: int, conflict_every: int, clients: int) -> dict:
    import aiohttp

    keys = sorted({_race_key(i, pairs, shared) for i in range(pairs)})
    winner: dict[str, bytes] = {}
    acked: dict[str, set[bytes]] = {k: set() for k in keys}
    counts = {"pairs": pairs, "clients": clients, "puts_acked": 0, "conflicts": 0, "no_room": 0}
    counts.update({"gets_hit": 0, "gets_miss": 0, "other_status": 0})
    counts.update({"wrong_bytes": 0, "lost_acked_writes": 0, "double_acks": 0})
    gets: list[tuple[str, bool, int, bytes]] = []
    conn = aiohttp.TCPConnector(limit=2 * clients)  # every client's PUT and GET in flight at once
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def put(key: str, variant: int) -> bool:
            data = payload(key, chunk_bytes, variant)
            async with http.put(f"{url}/v1/chunks/{key}", data=data) as r:
                await r.read()
                if r.status == 201:
                    counts["puts_acked"] += 1
                    acked[key].add(data)
                    winner.setdefault(key, data)
                elif r.status == 409:
                    counts["conflicts"] += 1
                elif r.status == 507:
                    counts["no_room"] += 1
                else:
                    counts["other_status"] += 1
                return r.status == 201

        async def get(key: str) -> None:
            was_acked = key in winner  # a PUT of this key was acknowledged before this GET was sent
            async with http.get(f"{url}/v1/chunks/{key}") as r:
                body = await r.read()
                gets.append((key, was_acked, r.status, body))

        async def pair(i: int) -> None:
            key = _race_key(i, pairs, shared)
            variant = 1 if conflict_every and i % conflict_every == conflict_every - 1 else 0
            writing = asyncio.ensure_future(put(key, variant))
            await asyncio.sleep(0)  # the PUT goes out first
            for _ in range(3):  # a few reads while the write is in flight: some land mid-write
                await get(key)
                if writing.done():
                    break
            if await writing:
                await get(key)  # read after acknowledgement: must hit while the others still race

        todo = iter(range(pairs))

        async def client() -> None:
            for i in todo:
                await pair(i)

        await asyncio.gather(*(client() for _ in range(clients)))
        for key in keys:  # afterwards every acknowledged key must read back
            await get(key)
    for key, was_acked, status, body in gets:
        if status == 200:
            counts["gets_hit"] += 1
            counts["wrong_bytes"] += int(body != winner.get(key))
        elif status == 404:
            counts["gets_miss"] += 1
            counts["lost_acked_writes"] += int(was_acked)
        else:
            counts["other_status"] += 1
    counts["double_acks"] = sum(1 for v in acked.values() if len(v) > 1)
    return counts


def same_key_race(
    pool: KVPool, pairs: int = 2000, shared_keys: int = 50, conflict_every: int = 7, clients: int = 32
) -> dict:
    """``pairs`` PUT/GET pairs of one key each, ``clients`` pairs at a time, against ``kvpool serve`` on ``pool``.

    A pair sends its PUT, then GETs the key up to three times while the PUT is in flight, then once
    more after a 201. Half the pairs share ``shared_keys`` keys, the other half have one key each.
    Every ``conflict_every``-th PUT sends other bytes for its key (only one byte string per key may
    ever be acknowledged). The pool must hold every key's chunk without evicting: a miss after an
    acknowledged PUT is then a lost write. Besides the client's counts, ``dropped_chunks``: chunks
    the pool dropped as unreadable (none may be, with no fault injected). Returns the counts.
    """
    from .serve import BackgroundServer

    dropped = pool.counters["lost_chunks"]
    with BackgroundServer(pool) as srv:
        assert srv.url is not None  # entering waited for the server to start
        counts = asyncio.run(_race(srv.url, pool.layout.chunk_bytes, pairs, shared_keys, conflict_every, clients))
    counts["dropped_chunks"] = pool.counters["lost_chunks"] - dropped
    counts["leaked_bytes"] = leaked_bytes(pool)
    return counts


def _unit_bytes(name: str) -> bytes:
    return payload(name, 500 + zlib.crc32(name.encode()) % 3000)


def _child_puts(directory: Path, capacity: int, snapshot_every: int, threads: int, tag: str, w: int) -> None:
    """In the forked child: put from ``threads`` threads until killed; one line per acknowledged put."""
    store = PassthroughStore("ssd0", directory, capacity, snapshot_every=snapshot_every)

    def worker(t: int) -> None:
        j = 0
        while True:
            name = f"{tag}.t{t}.{j}"
            if not store.put(name, torch.frombuffer(bytearray(_unit_bytes(name)), dtype=torch.uint8)):
                os.write(w, b"!\n")  # full or failed: nothing more to acknowledge
                return
            os.write(w, f"{name}\n".encode())  # one short write: atomic on a pipe
            j += 1

    ts = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()


def _kill_after(pid: int, r: int, acks: int) -> tuple[list[str], bool]:
    """Read acknowledgements until ``acks`` arrived, SIGKILL the child, then drain the pipe.

    Returns the acknowledged names and whether the child failed on its own (exit status not 0).
    """
    buf, seen = b"", 0
    with os.fdopen(r, "rb", buffering=0) as f:
        while seen < acks:
            got = f.read(65536)
            if not got:
                break
            buf += got
            seen = buf.count(b"\n")
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        while got := f.read(65536):
            buf += got
    failed = os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0
    return [ln for ln in buf.decode().splitlines() if ln and ln != "!"], failed


def kill9_puts(
    directory: str | os.PathLike,
    iterations: int = 20,
    threads: int = 4,
    acks_per_kill: int = 100,
    capacity_bytes: int = 64 << 20,
) -> dict:
    """Kill a process putting from ``threads`` threads into one slab, ``iterations`` times; count losses.

    Every reopen checks every unit acknowledged so far (all iterations). Alternate iterations
    snapshot the index every 50 records, so kills also land around snapshots. Linux only (fork).
    """
    directory = Path(directory)
    acked: list[str] = []
    lost: set[str] = set()
    wrong: set[str] = set()
    child_errors = 0
    for it in range(iterations):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.close(r)
                _child_puts(directory, capacity_bytes, 50 if it % 2 else 4096, threads, f"i{it}", w)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        names, failed = _kill_after(pid, r, acks_per_kill)
        acked += names
        child_errors += failed
        with PassthroughStore("ssd0", directory, capacity_bytes) as store:
            for name in acked:
                got = store.read(name)
                if got is None:
                    lost.add(name)
                elif got.numpy().tobytes() != _unit_bytes(name):
                    wrong.add(name)
    return {
        "iterations": iterations,
        "threads": threads,
        "acked": len(acked),
        "lost_acked_writes": len(lost),
        "wrong_bytes": len(wrong),
        "child_errors": child_errors,
    }


def safety_counts(pairs: int = 2000, kills: int = 20, directory: str | os.PathLike | None = None) -> dict:
    """The bench's ``safety`` block: ``same_key_race`` on a memory and an SSD pool, ``kill9_puts``.

    Totals of wrong bytes returned, acknowledged writes lost, chunks dropped as unreadable and
    bytes leaked, with each run's own counts. A race needs aiohttp; without it the race is skipped
    and says so. ``directory``: where the SSD slabs go (a temporary directory by default).
    """
    runs: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-safety-", dir=directory) as tmp:
        for kind in ("memory", "ssd"):
            try:
                import aiohttp  # noqa: F401
            except ImportError:
                skipped[f"race_{kind}"] = "aiohttp not installed (pip install 'mlsyskit-kvpool[serve]')"
                continue
            d = Path(tmp) / f"race_{kind}"
            d.mkdir()
            with race_pool(kind, d, chunks=pairs // 2 + 100) as pool:
                runs[f"race_{kind}"] = same_key_race(pool, pairs=pairs)
        if kills:
            d = Path(tmp) / "kill9"
            d.mkdir()
            runs["kill9"] = kill9_puts(d, iterations=kills, acks_per_kill=60, capacity_bytes=max(16, kills) << 20)
    total = {k: sum(r.get(k, 0) for r in runs.values()) for k in ("wrong_bytes", "lost_acked_writes")}
    total.update({k: sum(r.get(k, 0) for r in runs.values()) for k in ("dropped_chunks", "leaked_bytes")})
    return {**total, "runs": runs, "skipped": skipped}
