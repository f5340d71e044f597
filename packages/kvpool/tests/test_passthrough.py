import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kvpool import DeviceUnavailable, ExtentAllocator, PassthroughStore
from kvpool.passthrough import HEADER_BYTES, JOURNAL, SLAB
from kvpool.uring import IoUring

MB = 1 << 20


@pytest.fixture(autouse=True, params=["preadv", "io_uring"])
def io_backend(request, monkeypatch):
    """Every store test runs on both read backends (io_uring where the kernel allows it)."""
    if request.param == "io_uring" and IoUring.available() is not None:
        pytest.skip(f"io_uring unavailable: {IoUring.available()}")
    monkeypatch.setattr(PassthroughStore, "default_io_backend", request.param)
    return request.param


def rand_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_round_trip_bit_exact_for_float_tensors(tmp_path):
    with PassthroughStore("ssd0", tmp_path, 4 * MB) as s:
        x = torch.randn(2, 4, 32, 16)
        x[0, 0, 0, 0] = float("nan")
        x[0, 0, 0, 1] = -0.0
        assert s.put("a.0", x)
        got = s.read("a.0", s.staging(x.numel() * 4))
        assert torch.equal(got, x.reshape(-1).view(torch.uint8))
        if s.direct:
            assert s.page_cache_bytes() == 0  # O_DIRECT: nothing of the slab in the page cache


@pytest.mark.parametrize("n", [1, 63, 4095, 4096 - HEADER_BYTES, 4097, 10001, 3 * 4096 + 5])
def test_unaligned_sizes(tmp_path, n):
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        data = rand_bytes(n, n)
        assert s.put("u", data)
        assert torch.equal(s.read("u"), data)
        assert s.alloc.used % 4096 == 0


def test_full_slab_refuses_then_accepts_after_delete(tmp_path):
    with PassthroughStore("ssd0", tmp_path, 64 * 1024) as s:
        stored = [f"k{i}" for i in range(100) if s.put(f"k{i}", rand_bytes(8000, i))]
        assert 0 < len(stored) < 100
        assert not s.put("extra", rand_bytes(8000, 99))
        for k in stored:  # nothing stored was damaged by the refusals
            assert torch.equal(s.read(k), rand_bytes(8000, int(k[1:])))
        assert s.delete(stored[0])
        assert s.put("extra", rand_bytes(8000, 99))
        assert torch.equal(s.read("extra"), rand_bytes(8000, 99))


def test_disk_full_or_missing_device_is_unavailable(tmp_path):
    with pytest.raises(DeviceUnavailable, match="cannot reserve"):
        PassthroughStore("huge", tmp_path, 1 << 60)  # more than any disk here: ENOSPC/EFBIG from fallocate
    with pytest.raises(DeviceUnavailable, match="not a directory"):
        PassthroughStore("gone", tmp_path / "missing", MB)


def test_corrupted_chunk_is_a_miss_never_wrong_data(tmp_path, caplog):
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        s.put("good", rand_bytes(5000, 1))
        s.put("bad", rand_bytes(5000, 2))
        off = s.index["bad"][0]
    with open(tmp_path / SLAB, "r+b") as f:  # flip one payload byte behind the store's back
        f.seek(off + HEADER_BYTES + 1234)
        b = f.read(1)
        f.seek(off + HEADER_BYTES + 1234)
        f.write(bytes([b[0] ^ 0xFF]))
    with PassthroughStore("ssd0", tmp_path, MB) as s, caplog.at_level(logging.WARNING):
        assert s.read("bad") is None
        assert s.stats.corrupt == 1 and "checksum" in caplog.text
        assert "bad" not in s  # dropped, so it will be recomputed and rewritten
        assert torch.equal(s.read("good"), rand_bytes(5000, 1))


def test_truncated_slab_keeps_what_is_intact(tmp_path):
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        for i in range(20):
            s.put(f"k{i}", rand_bytes(8000, i))
        offs = {k: v[0] for k, v in s.index.items()}
    cut = 16 * 4096
    os.truncate(tmp_path / SLAB, cut)
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        assert s.dropped_on_open > 0
        for k, off in offs.items():
            got = s.read(k)
            if off + 2 * 4096 <= cut:  # 8000 + header bytes take two blocks
                assert torch.equal(got, rand_bytes(8000, int(k[1:])))
            else:
                assert got is None
        assert os.path.getsize(tmp_path / SLAB) >= MB  # re-extended
        assert s.put("new", rand_bytes(8000, 77)) and torch.equal(s.read("new"), rand_bytes(8000, 77))


def test_header_from_another_unit_is_rejected(tmp_path):
    # an index entry whose extent holds a different unit's data (e.g. KV of another model) is a miss
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        s.put("model-a.0", rand_bytes(5000, 1))
        s.put("model-b.0", rand_bytes(5000, 2))
        s.index["model-a.0"] = s.index["model-b.0"]
        assert s.read("model-a.0") is None
        assert s.read("never-stored.0") is None


def test_concurrent_writers_lose_nothing(tmp_path):
    with PassthroughStore("ssd0", tmp_path, 8 * MB) as s:
        errors = []

        def writer(t):
            try:
                for i in range(25):
                    assert s.put(f"t{t}.{i}", rand_bytes(3000 + 1000 * t + i, 100 * t + i))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        for t in range(4):
            for i in range(25):
                assert torch.equal(s.read(f"t{t}.{i}"), rand_bytes(3000 + 1000 * t + i, 100 * t + i))
        offs = sorted(v[0] for v in s.index.values())
        assert len(set(offs)) == 100
    with PassthroughStore("ssd0", tmp_path, 8 * MB) as s:  # and the index reopens with all 100
        assert len(s.index) == 100


def test_second_process_gets_a_clear_error(tmp_path):
    with PassthroughStore("ssd0", tmp_path, MB):
        code = f"from kvpool import PassthroughStore\nPassthroughStore('x', {str(tmp_path)!r}, 1 << 20)"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "in use by another process" in r.stderr


def test_killed_process_leaves_an_index_that_reopens(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from kvpool import PassthroughStore
        s = PassthroughStore("ssd0", {str(tmp_path)!r}, 1 << 20, snapshot_every=7)
        for i in range(30):
            g = torch.Generator().manual_seed(i)
            s.put(f"k{{i}}", torch.randint(0, 256, (5000 + i,), dtype=torch.uint8, generator=g))
            if i % 4 == 3:
                s.delete(f"k{{i - 1}}")
        # a torn journal record, as if killed in the middle of an append
        os.write(s.jfd, b"\\x40\\x00\\x00\\x00garbage")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -9
    assert os.path.getsize(tmp_path / JOURNAL) > 0
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        deleted = {f"k{i - 1}" for i in range(30) if i % 4 == 3}
        assert set(s.index) == {f"k{i}" for i in range(30)} - deleted
        for i in range(30):
            if f"k{i}" in deleted:
                continue
            g = torch.Generator().manual_seed(i)
            assert torch.equal(s.read(f"k{i}"), torch.randint(0, 256, (5000 + i,), dtype=torch.uint8, generator=g))
        assert s.put("after", rand_bytes(100)) and torch.equal(s.read("after"), rand_bytes(100))
    with PassthroughStore("ssd0", tmp_path, MB) as s:
        assert "after" in s


def test_extent_allocator_coalesces_and_reserves():
    a = ExtentAllocator(10 * 4096)
    x, y, z = a.alloc(4096), a.alloc(5000), a.alloc(1)
    assert (x, y, z) == (0, 4096, 3 * 4096) and a.used == 4 * 4096
    a.free(y, 5000)
    a.free(x, 4096)
    assert a.largest_free() == 6 * 4096 and a.alloc(3 * 4096) == 0
    b = ExtentAllocator(10 * 4096)
    assert b.reserve(4096, 4096) and not b.reserve(4096, 10) and not b.reserve(9 * 4096, 8192)
    assert b.alloc(4096) == 0 and b.alloc(4096) == 2 * 4096


def test_read_many_coalesces_adjacent_units_and_checks_each(tmp_path, monkeypatch, io_backend):
    with PassthroughStore("ssd0", tmp_path, 4 * MB) as s:
        for i in range(6):
            assert s.put(f"u{i}", rand_bytes(9000, i))
        s.put("far", rand_bytes(100, 50))
        s.delete("u4")  # a hole: u3 and u5 are no longer adjacent
        off = s.index["u1"][0]
        with open(s.slab_path, "r+b") as f:
            f.seek(off + HEADER_BYTES + 7)
            f.write(b"\x00\x00\x00\x00")
        calls = []
        if io_backend == "io_uring":  # one submission with a vectored read per run
            real_ring = IoUring.readv
            monkeypatch.setattr(
                IoUring, "readv", lambda ring, reqs: calls.extend(r[3] for r in reqs) or real_ring(ring, reqs)
            )
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
        names = ["u3", "u0", "missing", "u1", "u2", "u5"]
        got = s.read_many(names, [None] * len(names))
        assert calls == [4, 1]  # u0..u3 in one call, u5 alone
        for nm, g in zip(names, got):
            if nm in ("missing", "u1"):
                assert g is None
            else:
                assert torch.equal(g, rand_bytes(9000, int(nm[1:])))
        assert s.stats.corrupt == 1 and "u1" not in s
