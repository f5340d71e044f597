"""Whole-chunk reads: a chunk stored by put_chunk sits in one extent and comes back in one preadv."""

import os

import pytest
import torch

import kvpool.passthrough as passthrough
from kvpool import KVLayout, KVPool, MemoryStore, PassthroughStore, unit_name
from kvpool.passthrough import HEADER_BYTES

LAY = KVLayout(6, 2, 8, chunk_tokens=64)  # unit 8 KiB, chunk 48 KiB


def chunk_of(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 2, 2, 64, 8, generator=g)


def key(i: int) -> str:
    return f"{i:032x}"


def ssd_pool(path, capacity=1 << 20, **kw) -> KVPool:
    return KVPool([PassthroughStore("ssd0", path, capacity, **kw)], LAY, "m", {"ssd0": 1e9}, promote=False)


@pytest.fixture
def preadv_calls(monkeypatch):
    calls = []
    real = os.preadv

    def counting(fd, bufs, off):
        calls.append((off, sum(len(b) for b in bufs)))
        return real(fd, bufs, off)

    monkeypatch.setattr(passthrough.os, "preadv", counting)
    return calls


def test_put_chunk_places_layers_contiguously_and_get_chunk_reads_them_in_one_preadv(tmp_path, preadv_calls):
    with ssd_pool(tmp_path) as pool:
        assert pool.put_chunk(key(1), chunk_of(1)) and pool.put_chunk(key(2), chunk_of(2))
        store = pool.stores["ssd0"]
        offs = [store.index[unit_name(key(2), layer)][0] for layer in range(6)]
        ext = store.alloc.round(HEADER_BYTES + LAY.unit_bytes)
        assert offs == [offs[0] + i * ext for i in range(6)]
        preadv_calls.clear()
        assert torch.equal(pool.get_chunk(key(2)), chunk_of(2))
        assert preadv_calls == [(offs[0], 6 * ext)]


def test_large_chunk_reads_go_in_pieces_and_stay_byte_exact(tmp_path, preadv_calls):
    with ssd_pool(tmp_path) as pool:
        store = pool.stores["ssd0"]
        store.pipeline_bytes = 16 << 10  # two units a piece: three pieces in flight for one chunk
        for i in range(4):
            assert pool.put_chunk(key(i), chunk_of(i))
        preadv_calls.clear()
        for i in range(4):
            assert torch.equal(pool.get_chunk(key(i)), chunk_of(i))
        assert len(preadv_calls) == 4 * 3
        assert pool.pinned() == set()


def test_a_corrupt_unit_in_a_whole_chunk_read_is_a_miss_never_wrong_bytes(tmp_path):
    with ssd_pool(tmp_path) as pool:
        assert pool.put_chunk(key(1), chunk_of(1))
        store = pool.stores["ssd0"]
        off = store.index[unit_name(key(1), 3)][0]
        with open(store.slab_path, "r+b") as f:
            f.seek(off + HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(off + HEADER_BYTES + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        assert pool.get_chunk(key(1)) is None
        assert pool.counters["lost_chunks"] == 1 and pool.cached_chunks([key(1)]) == 0
        assert not any(n.startswith(key(1)) for n in store.names())  # every layer of it is gone
        assert pool.pinned() == set()


def test_read_chunk_pins_until_released_and_parts_are_the_layers(tmp_path):
    stores = [MemoryStore("mem0", 4 * LAY.chunk_bytes), PassthroughStore("ssd0", tmp_path, 1 << 20)]
    with KVPool(stores, LAY, "m", {"mem0": 8e9, "ssd0": 1e9}, promote=False) as pool:
        for i in range(3):
            assert pool.put_chunk(key(i), chunk_of(i))
        for i in range(3):
            got = pool.read_chunk(key(i))
            assert got is not None and pool.pinned() == {key(i)}
            assert got.nbytes == LAY.chunk_bytes and len(got.parts) == 6
            want = chunk_of(i).view(6, -1).view(torch.uint8)
            assert all(torch.equal(p, want[layer]) for layer, p in enumerate(got.parts))
            got.release()
            got.release()  # a second release does nothing
            assert pool.pinned() == set()
        assert pool.read_chunk(key(9)) is None and pool.pinned() == set()


def test_put_many_falls_back_to_single_units_when_no_extent_holds_them_all(tmp_path):
    ext = 4096 + 8192  # header page + an 8 KiB unit
    with PassthroughStore("ssd0", tmp_path, 8 * ext) as store:
        fill = [(f"f{i}", torch.full((8192,), i, dtype=torch.uint8)) for i in range(8)]
        assert store.put_many(fill)
        for i in (1, 3, 5):
            store.delete(f"f{i}")  # three free holes of one unit each, none adjacent
        units = [(f"c.{i}", torch.full((8192,), 100 + i, dtype=torch.uint8)) for i in range(3)]
        assert store.put_many(units)
        assert not store.put_many([("x.0", torch.zeros(8192, dtype=torch.uint8))])  # full
        for nm, t in units + [fill[0], fill[7]]:
            assert torch.equal(store.read(nm), t)


def test_units_of_put_many_survive_a_reopen(tmp_path):
    units = [(f"c.{i}", torch.randint(0, 255, (5000,), dtype=torch.uint8)) for i in range(4)]
    with PassthroughStore("ssd0", tmp_path, 1 << 20) as store:
        assert store.put_many(units)
        assert store.put_many(units[:2])  # already stored: kept, still True
    with PassthroughStore("ssd0", tmp_path, 1 << 20) as store:
        assert store.names() == {nm: 5000 for nm, _ in units}
        got = store.read_many([nm for nm, _ in units], [None] * 4)
        assert all(g is not None and torch.equal(g, t) for g, (_, t) in zip(got, units))


def test_http_get_streams_a_chunk_read_from_an_ssd_byte_exact(tmp_path):
    pytest.importorskip("aiohttp")
    from kvpool.serve import BackgroundServer, PoolClient

    with ssd_pool(tmp_path) as pool, BackgroundServer(pool) as srv:
        client = PoolClient(srv.url, model_id="m", layout=LAY)
        for i in range(3):
            assert client.put_chunk(key(i), chunk_of(i))
        for i in range(3):
            assert torch.equal(client.get_chunk(key(i)), chunk_of(i))
        assert client.get_chunk(key(7)) is None
        assert pool.pinned() == set()


def test_chunk_read_bench_reads_cold_files_and_checks_bytes(tmp_path):
    from kvpool.iobench import chunk_read_bandwidth

    r = chunk_read_bandwidth(LAY, tmp_path / "w", chunks=3, reps=2, seed=5)
    assert r["torch_load_resident_bytes_after_drop"] == 0
    assert set(r["bytes_per_s_median"]) >= {"get_chunk", "read_chunk", "torch_load"}
    assert r["get_chunk_bw_ratio_vs_torch_load"] > 0 and len(r["seconds"]["torch_load"]) == 2
    assert list((tmp_path / "w").glob("*.pt")) == []


def test_syscall_timer_counts_metadata_calls_and_restores_os(tmp_path):
    from kvpool.iobench import _SyscallTimer

    real_stat = os.stat
    with _SyscallTimer() as sc:
        os.stat(tmp_path)
        with open(tmp_path / "f", "w"):
            pass
    assert sc.calls == 2 and sc.seconds > 0
    assert os.stat is real_stat


def test_load_chunk_into_fills_a_given_tensor_and_rejects_a_wrong_one(tmp_path):
    stores = [MemoryStore("mem0", LAY.chunk_bytes), PassthroughStore("ssd0", tmp_path, 1 << 20)]
    with KVPool(stores, LAY, "m", {"mem0": 8e9, "ssd0": 1e9}, promote=False) as pool:
        for i in range(3):  # the first in memory, the others on the SSD
            assert pool.put_chunk(key(i), chunk_of(i))
        out = torch.empty(6, 2, 2, 64, 8)
        for i in range(3):
            assert pool.load_chunk_into(key(i), out) and torch.equal(out, chunk_of(i))
        assert not pool.load_chunk_into(key(9), out)
        with pytest.raises(ValueError, match=r"out: expected a contiguous \(6, 2, 2, 64, 8\)"):
            pool.load_chunk_into(key(1), torch.empty(6, 2, 2, 64, 4))
        with pytest.raises(ValueError, match="of float32"):
            pool.load_chunk_into(key(1), torch.empty(6, 2, 2, 64, 8, dtype=torch.float16))
        assert pool.pinned() == set()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_chunk_into_a_cuda_tensor_through_pinned_staging(tmp_path):
    with ssd_pool(tmp_path) as pool:
        pool.stores["ssd0"].pipeline_bytes = 16 << 10  # pieces on two threads: the sender takes turns
        for i in range(2):
            assert pool.put_chunk(key(i), chunk_of(i))
        out = torch.empty(6, 2, 2, 64, 8, device="cuda")
        for i in range(2):
            assert pool.load_chunk_into(key(i), out) and torch.equal(out.cpu(), chunk_of(i))
