"""Faults and races: nothing wrong returned, no acknowledged write lost, no space leaked."""

import errno
import json
import logging
import os
import shutil
import threading
import zlib

import pytest
import torch

from kvpool import ChunkConflict, KVLayout, KVPool, MemoryStore, PassthroughStore
from kvpool.faults import kill9_puts, leaked_bytes, payload, race_pool
from kvpool.passthrough import _FRAME, JOURNAL, SLAB, SNAPSHOT

MB = 1 << 20
LAY = KVLayout(3, 2, 8, chunk_tokens=16)  # unit 2 KiB, chunk 6 KiB


def rand_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def chunk_of(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAY.num_layers, 2, LAY.kv_heads, LAY.chunk_tokens, LAY.head_dim, generator=g)


def key(i):
    return f"{i:032x}"


@pytest.fixture
def live(tmp_path):
    """The directory of the store under test (``crash_image`` copies it next to it)."""
    d = tmp_path / "live"
    d.mkdir()
    return d


def crash_image(src, dst):
    """The files a kill -9 at this moment would leave (copied while the store is still open)."""
    dst.mkdir()
    for name in (SLAB, JOURNAL, SNAPSHOT):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


class Gate:
    """A write throttle that holds a unit's write open until released (and records what it saw)."""

    def __init__(self, store, hold_after: int = 1):
        self.store, self.hold_after, self.writes = store, hold_after, 0
        self.entered, self.release = threading.Event(), threading.Event()
        self.read_bandwidth_bytes_per_s = self.write_bytes_per_s = None

    def after_write(self, nbytes, started):
        self.writes += 1
        if self.writes == self.hold_after:
            self.entered.set()
            assert self.release.wait(60)

    def after_read(self, nbytes, started):
        pass

    def describe(self):
        return {"emulated": True}


# --- a chunk is visible only once written ------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "ssd"])
def test_unit_is_not_readable_until_its_write_finished(tmp_path, kind):
    store = MemoryStore("mem0", MB) if kind == "memory" else PassthroughStore("ssd0", tmp_path, MB)
    seen = []

    class Probe(Gate):
        def after_write(self, nbytes, started):
            seen.append(store.read("u"))  # the copy is done, the write is not acknowledged yet

    store.throttle = Probe(store)
    data = rand_bytes(5000)
    assert store.put("u", data)
    assert seen == [None]
    assert torch.equal(store.read("u"), data)
    store.close()


@pytest.mark.parametrize("kind", ["memory", "ssd"])
def test_readers_never_see_or_delete_a_chunk_being_written(tmp_path, kind):
    store = MemoryStore("mem0", 8 * LAY.chunk_bytes) if kind == "memory" else PassthroughStore("ssd0", tmp_path, MB)
    # memory: hold after layer 1 of 3 is stored; an SSD writes a chunk's layers in one write: hold that
    gate = store.throttle = Gate(store, hold_after=2 if kind == "memory" else 1)
    with KVPool([store], LAY, "m", {store.name: 1e9}) as pool:
        c = chunk_of(1)
        writer = threading.Thread(target=lambda: results.append(pool.put_chunk(key(1), c)))
        second = threading.Thread(target=lambda: results.append(pool.put_chunk(key(1), c.clone())))
        results = []
        writer.start()
        assert gate.entered.wait(60)
        assert pool.get_chunk(key(1)) is None and pool.cached_chunks([key(1)]) == 0
        assert pool.placement.state(key(1)) == "writing"
        # memory: layer 0 is stored, layer 1 not yet acknowledged; SSD: no layer acknowledged yet.
        # Either way the miss deleted nothing
        assert len(store.names()) == (1 if kind == "memory" else 0)
        second.start()  # same key, same bytes: waits for the first writer, then agrees
        gate.release.set()
        writer.join(60)
        second.join(60)
        assert results == [True, True]
        assert torch.equal(pool.get_chunk(key(1)), c)
        assert len(store.names()) == LAY.num_layers and leaked_bytes(pool) == 0


def test_reader_dropping_a_corrupt_copy_never_removes_a_newer_one(tmp_path):
    with KVPool([PassthroughStore("ssd0", tmp_path, MB)], LAY, "m", {"ssd0": 1e9}) as pool:
        assert pool.put_chunk(key(1), chunk_of(1))
        assert pool.placement.remove(key(1), device="ssd0", ready=False) is None  # it is ready
        assert pool.placement.remove(key(1), device="mem9") is None
        assert pool.get_chunk(key(1)) is not None


# --- first writer wins -------------------------------------------------------------------------
def test_first_writer_wins_same_bytes_idempotent_other_bytes_conflict(tmp_path):
    with KVPool(
        [MemoryStore("mem0", MB), PassthroughStore("ssd0", tmp_path, MB)], LAY, "m", {"mem0": 1, "ssd0": 1}
    ) as pool:
        c = chunk_of(1)
        c[0, 0, 0, 0, 0] = float("nan")  # bitwise comparison: NaN bytes equal themselves
        assert pool.put_chunk(key(1), c) and pool.put_chunk(key(1), c.clone())
        other = c.clone()
        other[2, 1, 1, 15, 7] += 1
        with pytest.raises(ChunkConflict, match=key(1)):
            pool.put_chunk(key(1), other)
        got = pool.get_chunk(key(1))
        assert got.view(torch.uint8).equal(c.view(torch.uint8))
        assert pool.counters["conflicts"] == 1 and leaked_bytes(pool) == 0


# --- lost acknowledged writes ------------------------------------------------------------------
def test_record_numbered_earlier_but_journaled_later_survives(tmp_path, live):
    """A put that took its number first but finished last must not be dropped by replay."""
    store = PassthroughStore("ssd0", live, MB)
    gate = store.throttle = Gate(store, hold_after=1)
    slow = threading.Thread(target=store.put, args=("slow", rand_bytes(3000, 1)))
    slow.start()
    assert gate.entered.wait(60)  # "slow" is written but not yet journaled
    store.throttle = None
    assert store.put("fast", rand_bytes(3000, 2))
    gate.release.set()
    slow.join(60)
    image = crash_image(live, tmp_path / "crash")
    store.close()
    with PassthroughStore("ssd0", image, MB) as again:
        assert torch.equal(again.read("slow"), rand_bytes(3000, 1))
        assert torch.equal(again.read("fast"), rand_bytes(3000, 2))


def test_kill9_during_puts_from_four_threads_loses_no_acknowledged_put(tmp_path):
    counts = kill9_puts(tmp_path, iterations=20, threads=4, acks_per_kill=60, capacity_bytes=16 * MB)
    assert counts["child_errors"] == 0
    assert counts["acked"] >= 20 * 60
    assert counts["lost_acked_writes"] == 0 and counts["wrong_bytes"] == 0, counts


# --- a slab that does not fit ------------------------------------------------------------------
def test_slab_that_does_not_fit_leaves_no_file(tmp_path, monkeypatch):
    def partial_then_full(fd, off, length):
        os.ftruncate(fd, length // 2)  # some blocks reserved before the disk ran out
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", partial_then_full)
    with pytest.raises(OSError, match="cannot reserve"):
        PassthroughStore("ssd0", tmp_path, 4 * MB)
    assert os.listdir(tmp_path) == []


def test_growing_an_existing_slab_that_does_not_fit_keeps_it_as_it_was(tmp_path, monkeypatch):
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        assert s.put("u", rand_bytes(5000))
    real = os.posix_fallocate

    def full(fd, off, length):
        os.ftruncate(fd, length - 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot reserve"):
        PassthroughStore("ssd0", tmp_path, 8 * MB)
    assert os.path.getsize(tmp_path / SLAB) == MB
    monkeypatch.setattr(os, "posix_fallocate", real)
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        assert torch.equal(s.read("u"), rand_bytes(5000))


# --- ENOSPC / EIO: the device fails, the pool degrades, nothing raises ------------------------
def failing(monkeypatch, fn_name, fd_of, err=errno.ENOSPC):
    """Make ``os.<fn_name>`` fail with ``err`` on the fd ``fd_of()`` (others pass through)."""
    real = getattr(os, fn_name)

    def fake(fd, *a, **kw):
        if fd == fd_of():
            raise OSError(err, os.strerror(err))
        return real(fd, *a, **kw)

    monkeypatch.setattr(os, fn_name, fake)


def replayed_names(store):
    entries, *_ = store._replay()
    return set(entries)


def test_full_journal_fails_the_store_and_keeps_its_index_equal_to_disk(tmp_path, monkeypatch, caplog):
    s = PassthroughStore("ssd0", tmp_path, MB)
    for i in range(5):
        assert s.put(f"u{i}", rand_bytes(3000, i))
    failing(monkeypatch, "write", lambda: s.jfd)
    with caplog.at_level(logging.WARNING):
        assert not s.put("late", rand_bytes(3000, 9))  # no exception, not stored
        assert not s.delete("u0")  # cannot be recorded: stays
    assert isinstance(s.failed, OSError) and "journal" in caplog.text
    assert set(s.index) == replayed_names(s) == {f"u{i}" for i in range(5)}
    assert torch.equal(s.read("u0"), rand_bytes(3000, 0))
    assert not s.put("later", rand_bytes(10))  # a failed device takes no more writes
    monkeypatch.undo()
    s.close()


def test_failed_snapshot_is_not_fatal(tmp_path, monkeypatch):
    import kvpool.passthrough as pt

    def no_room(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pt, "atomic_write_text", no_room)
    s = PassthroughStore("ssd0", tmp_path, MB, snapshot_every=5)
    for i in range(20):
        assert s.put(f"u{i}", rand_bytes(3000, i))
    assert s.failed is None
    s.close()  # warns, the journal keeps the index
    monkeypatch.undo()
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        assert all(torch.equal(s.read(f"u{i}"), rand_bytes(3000, i)) for i in range(20))


def three_device_pool(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir(exist_ok=True)
    stores = [MemoryStore("mem0", 20 * LAY.chunk_bytes)]
    stores += [PassthroughStore(f"ssd{i}", d, 2 * MB) for i, d in enumerate(dirs)]
    return KVPool(stores, LAY, "m", {"mem0": 4e9, "ssd0": 1e9, "ssd1": 1e9})


@pytest.mark.parametrize(
    "fault",
    [("write", "jfd", errno.ENOSPC), ("write", "jfd", errno.EIO), ("pwrite", "fd", errno.EIO)],
    ids=["journal-ENOSPC", "journal-EIO", "slab-EIO"],
)
def test_device_fault_on_write_degrades_to_the_others(tmp_path, monkeypatch, caplog, fault):
    fn, attr, err = fault
    pool = three_device_pool(tmp_path)
    for i in range(30):
        assert pool.put_chunk(key(i), chunk_of(i))
    bad = pool.stores["ssd0"]
    on_bad = {hx for hx, r in pool.placement.records.items() if r.device == "ssd0"}
    assert on_bad
    failing(monkeypatch, fn, lambda: getattr(bad, attr), err)
    with caplog.at_level(logging.WARNING):
        for i in range(30, 60):
            assert pool.put_chunk(key(i), chunk_of(i))  # placed elsewhere after ssd0 fails
    assert "ssd0" in pool.placement.disabled and "ssd0 failed" in caplog.text
    for i in range(60):
        got = pool.get_chunk(key(i))  # never raises
        if key(i) in on_bad:
            assert got is None  # said lost in the warning; recomputed by the caller
        else:
            assert torch.equal(got, chunk_of(i))
    assert set(bad.index) == replayed_names(bad)
    assert leaked_bytes(pool) == 0
    monkeypatch.undo()
    pool.close()
    with three_device_pool(tmp_path) as again:  # what ssd0 acknowledged is still on its disk
        for hx in on_bad:
            assert torch.equal(again.get_chunk(hx), chunk_of(int(hx, 16)))


def test_read_eio_is_a_miss_and_fails_the_device(tmp_path, monkeypatch, caplog):
    pool = three_device_pool(tmp_path)
    for i in range(30):  # memory holds 20: the rest go to the SSDs
        assert pool.put_chunk(key(i), chunk_of(i))
    bad = pool.stores["ssd1"]
    victim = next(hx for hx, r in pool.placement.records.items() if r.device == "ssd1")
    failing(monkeypatch, "preadv", lambda: bad.fd, errno.EIO)
    with caplog.at_level(logging.WARNING):
        assert pool.get_chunk(victim) is None
    assert "ssd1" in pool.placement.disabled
    monkeypatch.undo()
    pool.close()


# --- malformed snapshot or journal: set aside, reopen from what is valid -----------------------
BAD_SNAPSHOTS = {
    "list": b"[]",
    "entries-list": b'{"seq": 3, "entries": [1, 2]}',
    "short-entry": b'{"seq": 3, "entries": {"a.0": [1]}}',
    "string-offset": b'{"seq": 3, "entries": {"a.0": ["0", 1, 2, 3]}}',
    "seq-string": b'{"seq": "x", "entries": {}}',
    "negative": b'{"seq": 3, "entries": {"a.0": [-4096, 1, 2, 3]}}',
    "truncated": b'{"seq": 3, "entr',
    "garbage": bytes(range(256)),
}


@pytest.mark.parametrize("bad", list(BAD_SNAPSHOTS), ids=list(BAD_SNAPSHOTS))
def test_malformed_snapshot_is_set_aside(tmp_path, live, caplog, bad):
    with PassthroughStore("ssd0", live, MB) as s:
        s.put("old", rand_bytes(3000, 1))
    s = PassthroughStore("ssd0", live, MB)
    s.put("new", rand_bytes(3000, 2))  # in the journal only
    image = crash_image(live, tmp_path / "crash")
    s.close()
    (image / SNAPSHOT).write_bytes(BAD_SNAPSHOTS[bad])
    with caplog.at_level(logging.WARNING), PassthroughStore("ssd0", image, MB) as s:
        assert "set aside" in caplog.text
        assert (image / f"{SNAPSHOT}.bad").read_bytes() == BAD_SNAPSHOTS[bad]
        assert torch.equal(s.read("new"), rand_bytes(3000, 2))
        assert s.read("old") is None  # only the bad snapshot knew it
        assert s.put("after", rand_bytes(100, 3))
    with PassthroughStore("ssd0", image, MB) as s:
        assert set(s.index) == {"new", "after"}


def frame(rec) -> bytes:
    body = rec if isinstance(rec, bytes) else json.dumps(rec).encode()
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


BAD_RECORDS = {
    "not-a-dict": frame([1, 2]),
    "no-seq": frame({"o": "p", "n": "x"}),
    "seq-string": frame({"s": "9", "o": "d", "n": "x"}),
    "put-missing-fields": frame({"s": 99, "o": "p", "n": "x"}),
    "unknown-op": frame({"s": 99, "o": "z", "n": "x"}),
    "not-json": frame(b"\xff\xfe{"),
    "bad-crc": _FRAME.pack(12, 1234) + b"x" * 12,
}


@pytest.mark.parametrize("bad", list(BAD_RECORDS), ids=list(BAD_RECORDS))
def test_malformed_journal_is_set_aside_and_its_valid_prefix_kept(tmp_path, live, caplog, bad):
    with PassthroughStore("ssd0", live, MB) as s:
        s.put("a", rand_bytes(3000, 1))
        s.put("b", rand_bytes(3000, 2))
        os.write(s.jfd, BAD_RECORDS[bad])
        s.put("c", rand_bytes(3000, 3))  # after the bad record: not trusted
        image = crash_image(live, tmp_path / "crash")
    with caplog.at_level(logging.WARNING), PassthroughStore("ssd0", image, MB) as s:
        assert "set aside" in caplog.text and (image / f"{JOURNAL}.bad").exists()
        assert torch.equal(s.read("a"), rand_bytes(3000, 1)) and torch.equal(s.read("b"), rand_bytes(3000, 2))
        assert s.read("c") is None
        assert s.put("d", rand_bytes(100, 4))
    with PassthroughStore("ssd0", image, MB) as s:
        assert set(s.index) == {"a", "b", "d"}


# --- 2,000 concurrent same-key PUT/GET pairs over kvpool serve ---------------------------------
@pytest.mark.parametrize("kind", ["memory", "ssd"])
def test_concurrent_same_key_put_get_pairs_over_http(tmp_path, kind):
    pytest.importorskip("aiohttp")
    from kvpool.faults import same_key_race

    with race_pool(kind, tmp_path) as pool:
        c = same_key_race(pool, pairs=2000, shared_keys=50, conflict_every=7)
        assert c["wrong_bytes"] == 0 and c["lost_acked_writes"] == 0 and c["double_acks"] == 0, c
        assert c["dropped_chunks"] == 0 and c["leaked_bytes"] == 0, c
        assert c["other_status"] == 0 and c["no_room"] == 0, c
        assert c["puts_acked"] + c["conflicts"] == 2000 and c["conflicts"] > 0 and c["gets_hit"] > 0, c


def test_the_race_counts_wrong_bytes_when_a_pool_returns_them(tmp_path):
    """The harness itself can fail: a pool that flips a byte is caught."""
    pytest.importorskip("aiohttp")
    from kvpool.faults import same_key_race

    with race_pool("memory", tmp_path) as pool:
        from kvpool.pool import ChunkBytes

        real = pool.read_chunk

        def flipped(hx):
            got = real(hx)
            if got is None:
                return None
            parts = [p.clone() for p in got.parts]
            got.release()
            parts[0][0] ^= 1
            return ChunkBytes(parts, lambda: None)

        pool.read_chunk = flipped  # the server sends what read_chunk returns
        c = same_key_race(pool, pairs=100, shared_keys=10, conflict_every=0)
        assert c["wrong_bytes"] == c["gets_hit"] > 0


def test_payload_variants_differ_everywhere():
    a, b = payload("k", 4096, 0), payload("k", 4096, 1)
    assert len(a) == 4096 and all(a[i : i + 64] != b[i : i + 64] for i in range(0, 4096, 64))


def test_safety_block_of_the_bench(tmp_path):
    pytest.importorskip("aiohttp")
    from kvpool.faults import safety_counts

    out = safety_counts(pairs=200, kills=2, directory=tmp_path)
    assert set(out["runs"]) == {"race_memory", "race_ssd", "kill9"} and not out["skipped"]
    assert out["runs"]["kill9"]["acked"] >= 2 * 60 and out["runs"]["race_ssd"]["pairs"] == 200
    assert out["wrong_bytes"] == out["lost_acked_writes"] == out["dropped_chunks"] == out["leaked_bytes"] == 0, out
    assert os.listdir(tmp_path) == []  # its slabs are gone
