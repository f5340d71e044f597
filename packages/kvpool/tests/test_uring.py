import mmap
import os

import pytest
import torch

import kvpool.uring as uring
from kvpool import DeviceUnavailable, KVLayout, KVPool, MemoryStore, PassthroughStore
from kvpool.uring import IoUring, buffer_address, iovec_array

needs_uring = pytest.mark.skipif(IoUring.available() is not None, reason=f"io_uring: {IoUring.available()}")


@needs_uring
def test_ring_reads_more_requests_than_it_has_entries(tmp_path):
    data = os.urandom(64 * 4096)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    ring = IoUring(2)  # 2 entries, 16 requests: submitted in waves, results in request order
    try:
        bufs = [mmap.mmap(-1, 4 * 4096) for _ in range(16)]
        iovs = [iovec_array([(buffer_address(b), 4096 * 2), (buffer_address(b) + 8192, 8192)]) for b in bufs]
        order = list(range(15, -1, -1))
        got = ring.readv([(fd, i * 4 * 4096, iovs[i], 2) for i in order])
        assert got == [4 * 4096] * 16
        assert all(bytes(bufs[i]) == data[i * 16384 : (i + 1) * 16384] for i in range(16))
        # past the end: 0 bytes; a bad descriptor: -EBADF, neither raises
        assert ring.readv([(fd, len(data), iovs[0], 1), (987654, 0, iovs[1], 1)]) == [0, -9]
    finally:
        ring.close()
        os.close(fd)


def test_auto_falls_back_to_preadv_and_forced_io_uring_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(IoUring, "available", staticmethod(lambda: "io_uring_setup: Operation not permitted"))
    with PassthroughStore("ssd0", tmp_path, 1 << 20, io_backend="auto") as s:
        assert s.io_backend == "preadv" and "not permitted" in s.describe()["io_backend_fallback"]
        assert s.put("u", torch.arange(10)) and torch.equal(s.read("u").view(torch.int64), torch.arange(10))
    with pytest.raises(DeviceUnavailable, match="io_uring backend unavailable"):
        PassthroughStore("ssd0", tmp_path, 1 << 20, io_backend="io_uring")
    with pytest.raises(ValueError, match="io_backend must be"):
        PassthroughStore("ssd0", tmp_path, 1 << 20, io_backend="spdk")


@needs_uring
def test_pool_on_io_uring_stores_is_bit_exact_and_reuses_rings(ssd_dirs, monkeypatch):
    made = []
    real_init = IoUring.__init__

    def counting_init(self, *a, **kw):
        made.append(1)
        real_init(self, *a, **kw)

    monkeypatch.setattr(uring.IoUring, "__init__", counting_init)
    lay = KVLayout(3, 2, 8, chunk_tokens=16)
    stores = [MemoryStore("mem0", 2 * lay.chunk_bytes)]
    stores += [PassthroughStore(f"ssd{i}", d, 1 << 20, io_backend="io_uring") for i, d in enumerate(ssd_dirs)]
    g = torch.Generator().manual_seed(3)
    kv = [(torch.randn(1, 2, 160, 8, generator=g), torch.randn(1, 2, 160, 8, generator=g)) for _ in range(3)]
    with KVPool(stores, lay, "m", {"mem0": 8e9, "ssd0": 1e9, "ssd1": 1e9}) as pool:
        assert pool.put(list(range(160)), kv) == 10
        for _ in range(3):
            load = pool.retrieve(list(range(160))).join()
            for layer in range(3):
                assert torch.equal(load.k[layer], kv[layer][0]) and torch.equal(load.v[layer], kv[layer][1])
        per = load.describe()["per_device"]
        assert per["ssd0"]["bytes"] > 0 and per["ssd1"]["bytes"] > 0
        assert all(s.describe()["io_backend"] == "io_uring" for s in stores[1:])
        # rings are kept per store and reused: at most one per concurrent read (each of the 2 SSDs'
        # readers keeps two layers in flight), not one per read (3 requests x 3 layers x 2 SSDs)
        assert 0 < len(made) <= 2 * 2 * pool.readers["ssd"]
