import logging
import threading

import pytest
import torch

from kvpool import KVLayout, KVPool, MemoryStore, PassthroughStore, build_devices, unit_name
from kvpool.passthrough import HEADER_BYTES, SLAB

LAY = KVLayout(3, 2, 8, chunk_tokens=16)  # unit 2 KiB, chunk 6 KiB


def make_kv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)) for _ in range(3)]


def make_pool(dirs, mem_chunks=2, ssd_bytes=1 << 20, **kw):
    stores = [MemoryStore(f"mem{i}", mem_chunks * LAY.chunk_bytes) for i in range(2)]
    stores += [PassthroughStore(f"ssd{i}", d, ssd_bytes) for i, d in enumerate(dirs)]
    bw = {"mem0": 8e9, "mem1": 8e9, "ssd0": 1e9, "ssd1": 1e9}
    return KVPool(stores, LAY, "model-a", bw, **kw)


def check_prefix(load, kv, n):
    assert load.tokens == n
    for layer in range(3):
        assert torch.equal(load.k[layer], kv[layer][0][:, :, :n])
        assert torch.equal(load.v[layer], kv[layer][1][:, :, :n])


def test_put_lookup_retrieve_bit_exact_across_all_devices(ssd_dirs):
    kv = make_kv(200)
    toks = list(range(200))
    with make_pool(ssd_dirs) as pool:
        assert pool.put(toks, kv) == 12
        assert pool.lookup(toks) == 192
        used = {d: v["chunks"] for d, v in pool.placement.snapshot().items()}
        assert all(c > 0 for c in used.values()) and sum(used.values()) == 12
        load = pool.retrieve(toks).join()
        check_prefix(load, kv, 192)
        assert set(load.describe()["per_device"]) == {"mem0", "mem1", "ssd0", "ssd1"}
        # a longer request sharing the prefix hits exactly the shared chunks
        assert pool.lookup(toks[:100] + [7] * 100) == 96
        assert pool.put(toks, kv) == 0  # already there
        st = pool.stats()
        assert st["counters"]["hit_tokens"] == 192 and st["page_cache_bytes"] >= 0


def test_layers_become_ready_in_order_and_waiting_counts_as_blocked(ssd_dirs):
    kv = make_kv(64)
    with make_pool(ssd_dirs) as pool:
        pool.put(list(range(64)), kv)
        load = pool.retrieve(list(range(64)))
        k0, v0 = load.wait(0)
        assert torch.equal(k0, kv[0][0])
        load.join()
        assert load.blocked_s >= 0 and load.t_done is not None


def test_key_from_another_model_misses(ssd_dirs):
    kv = make_kv(64)
    with make_pool(ssd_dirs) as pool:
        pool.put(list(range(64)), kv)
        other = KVPool(list(pool.stores.values()), LAY, "model-b", {n: 1e9 for n in pool.stores})
        assert other.lookup(list(range(64))) == 0
        assert other.retrieve(list(range(64))).join().tokens == 0


def test_corrupt_unit_truncates_the_usable_prefix(ssd_dirs):
    kv = make_kv(160)
    toks = list(range(160))
    with make_pool(ssd_dirs, mem_chunks=1) as pool:
        pool.put(toks, kv)
        keys = pool.keys(toks)
        victim = next(k for k in keys[3:] if pool.placement.location(k.hex).startswith("ssd"))
        store = pool.stores[pool.placement.location(victim.hex)]
        off = store.index[unit_name(victim, 2)][0]
        with open(store.slab_path, "r+b") as f:
            f.seek(off + HEADER_BYTES + 10)
            f.write(b"\x00\x01\x02")
        load = pool.retrieve(toks).join()
        assert victim.index in load.lost
        assert load.valid_tokens == victim.index * 16
        check_prefix_part = load.valid_tokens
        for layer in range(3):
            assert torch.equal(load.k[layer][:, :, :check_prefix_part], kv[layer][0][:, :, :check_prefix_part])
        pool.forget_lost(load)
        assert pool.lookup(toks) == victim.index * 16
        assert pool.put(toks, kv) >= 1  # rewritten
        check_prefix(pool.retrieve(toks).join(), kv, 160)


def test_pool_wide_lru_eviction_when_full(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    stores = [MemoryStore("mem0", 4 * LAY.chunk_bytes), PassthroughStore("ssd0", d, 4 * (LAY.chunk_bytes + 3 * 4096))]
    with KVPool(stores, LAY, "m", {"mem0": 8e9, "ssd0": 1e9}) as pool:
        a, b = list(range(96)), list(range(1000, 1096))
        ka, kb = make_kv(96, 1), make_kv(96, 2)
        pool.put(a, ka)
        pool.retrieve(a).join()  # a is used again: b's chunks will be the LRU ones
        assert pool.put(b, kb) == 6
        assert pool.counters["evictions"] > 0
        assert pool.lookup(b) == 96
        assert pool.lookup(a) > 0  # a's head survived (tails are evicted first)
        check_prefix(pool.retrieve(b).join(), kb, 96)


def test_restart_adopts_chunks_from_ssd_indexes(ssd_dirs):
    kv = make_kv(128)
    toks = list(range(128))
    with make_pool(ssd_dirs) as pool:
        pool.put(toks, kv)
        on_ssd = sum(1 for r in pool.placement.records.values() if r.device.startswith("ssd"))
    with make_pool(ssd_dirs) as pool:  # memory is gone, the SSD chunks are back
        assert len(pool.placement.records) == on_ssd
        n = pool.lookup(toks)
        load = pool.retrieve(toks).join()
        check_prefix(load, kv, n)
        pool.put(toks, kv)
        check_prefix(pool.retrieve(toks).join(), kv, 128)


def test_failed_device_is_skipped_with_a_warning(ssd_dirs, caplog):
    kv = make_kv(200)
    with make_pool(ssd_dirs) as pool, caplog.at_level(logging.WARNING):
        ssd1 = pool.stores["ssd1"]
        real_put = ssd1.put

        def broken(name, data):
            ssd1.failed = OSError(28, "No space left on device")
            return False

        ssd1.put = broken
        stored = pool.put(list(range(200)), kv)
        ssd1.put = real_put
        assert "ssd1" in pool.placement.disabled and "ssd1 failed" in caplog.text
        n = pool.lookup(list(range(200)))
        check_prefix(pool.retrieve(list(range(200))).join(), kv, n)
        assert stored * 16 >= n
        pool.put(list(range(200)), kv)
        check_prefix(pool.retrieve(list(range(200))).join(), kv, 192)


def test_build_devices_skips_missing_paths(tmp_path, caplog):
    ok = tmp_path / "ok"
    ok.mkdir()
    with caplog.at_level(logging.WARNING):
        ds = build_devices([ok, tmp_path / "nope"], memory_modules=1, memory_bytes=1 << 20, ssd_bytes=1 << 20)
    try:
        assert [s.name for s in ds.stores] == ["mem0", "ssd0"] and "ssd1" in ds.skipped
        assert "skipping ssd1" in caplog.text
        assert all(bw > 0 for bw in ds.bandwidths.values())
    finally:
        ds.close()
    assert (ok / SLAB).exists()


def test_promotion_moves_hot_ssd_chunks_to_memory(ssd_dirs):
    kv, other = make_kv(128), make_kv(32, 5)
    toks = list(range(128))
    with make_pool(ssd_dirs, mem_chunks=1, promote_after=2) as pool:
        pool.put(list(range(500, 532)), other)  # fills both memory modules
        pool.put(toks, kv)  # memory is full, so this request lands on the SSDs
        assert all(
            r.device.startswith("ssd")
            for r in pool.placement.records.values()
            if r.key in {k.hex for k in pool.keys(toks)}
        )
        assert pool.promote_hot(pool.keys(toks)) == 0  # not hot yet, and no colder memory chunk to swap
        pool.retrieve(toks).join()
        pool.retrieve(toks).join()
        moved = pool.promote_hot(pool.keys(toks))
        assert moved >= 2  # swapped with the other request's colder memory chunks
        hot = {k.hex for k in pool.keys(toks)}
        assert sum(1 for r in pool.placement.records.values() if r.key in hot and r.device.startswith("mem")) >= 1
        check_prefix(pool.retrieve(toks).join(), kv, 128)
        check_prefix(pool.retrieve(list(range(500, 532))).join(), other, 32)  # the demoted chunks still read back


def test_concurrent_puts_from_threads(ssd_dirs):
    with make_pool(ssd_dirs, mem_chunks=4, ssd_bytes=4 << 20) as pool:
        reqs = [(list(range(i * 1000, i * 1000 + 64)), make_kv(64, i)) for i in range(4)]
        ts = [threading.Thread(target=pool.put, args=r) for r in reqs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for toks, kv in reqs:
            check_prefix(pool.retrieve(toks).join(), kv, 64)


def test_bad_kv_shapes_are_rejected(ssd_dirs):
    with make_pool(ssd_dirs) as pool:
        with pytest.raises(ValueError, match="expected 3 layers"):
            pool.put(list(range(32)), make_kv(32)[:2])
        bad = [(k.double(), v.double()) for k, v in make_kv(32)]
        with pytest.raises(ValueError, match="dtype"):
            pool.put(list(range(32)), bad)


def test_reused_destination_buffers(ssd_dirs):
    from kvpool import KVBuffers

    kv1, kv2 = make_kv(64, 1), make_kv(64, 2)
    a, b = list(range(64)), list(range(100, 164))
    out = KVBuffers(LAY, 80)
    with make_pool(ssd_dirs, mem_chunks=4) as pool:
        pool.put(a, kv1)
        pool.put(b, kv2)
        la = pool.retrieve(a, out=out).join()
        assert la.kbuf is out.k
        check_prefix(la, kv1, 64)
        check_prefix(pool.retrieve(b, out=out).join(), kv2, 64)  # same memory, new contents
        too_small = KVBuffers(LAY, 32)
        lc = pool.retrieve(a, out=too_small).join()
        assert lc.kbuf is not too_small.k
        check_prefix(lc, kv1, 64)


def test_chunks_being_read_are_never_evicted(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    gate = threading.Event()
    ssd = PassthroughStore("ssd0", d, 6 * 3 * 4096)  # six chunks: 3 units of 2 KiB + header, 4 KiB each
    real_read, real_read_many = ssd.read, ssd.read_many

    def slow_read(name, staging=None):
        gate.wait(60)  # hold the retrieval in flight until the test lets it go
        return real_read(name, staging)

    def slow_read_many(names, stagings, *args, **kwargs):
        gate.wait(60)  # retrieval reads coalesced runs through read_many
        return real_read_many(names, stagings, *args, **kwargs)

    ssd.read, ssd.read_many = slow_read, slow_read_many
    with KVPool([ssd], LAY, "m", {"ssd0": 1e9}) as pool:
        a, ka = list(range(96)), make_kv(96, 1)
        pool.put(a, ka)
        load = pool.retrieve(a)
        assert pool.pinned() == {k.hex for k in pool.keys(a)}
        assert pool.put(list(range(500, 596)), make_kv(96, 2)) == 0  # everything evictable is pinned
        gate.set()
        load.join()
        check_prefix(load, ka, 96)
        assert pool.pinned() == set()
        assert pool.put(list(range(500, 596)), make_kv(96, 2)) == 6  # now a's chunks can go


def test_devices_from_an_hwtopo_spec(tmp_path, caplog):
    import hwtopo
    from kvpool import from_machine

    (tmp_path / "nvme0").mkdir()
    spec = {
        "name": "box",
        "machines": [
            {
                "name": "kv",
                "memory": "4GiB",
                "numa_nodes": [{"id": 0, "memory": "2GiB", "bandwidth": "20GB/s"}, {"id": 1, "memory": "2GiB"}],
                "disks": [
                    {"name": "nvme0", "path": str(tmp_path / "nvme0"), "read_bandwidth": "3GB/s"},
                    {"name": "nvme1", "path": str(tmp_path / "absent")},
                ],
            }
        ],
    }
    m = hwtopo.from_dict(spec).machines[0]
    with caplog.at_level(logging.WARNING):
        ds = from_machine(m, memory_fraction=0.005, ssd_bytes=1 << 20)
    try:
        assert [s.name for s in ds.stores] == ["mem0", "mem1", "ssd0"] and "ssd1" in ds.skipped
        assert ds.bandwidths["mem0"] == 20e9 and ds.bandwidths["ssd0"] == 3e9  # from the spec
        assert ds.bandwidths["mem1"] > 0  # measured
        pool = KVPool(ds.stores, LAY, "m", ds.bandwidths)
        kv = make_kv(64)
        pool.put(list(range(64)), kv)
        check_prefix(pool.retrieve(list(range(64))).join(), kv, 64)
    finally:
        ds.close()


def test_layerwise_reads_reuse_the_ssds_staging_buffers(ssd_dirs, monkeypatch):
    """A second retrieval maps no new staging buffer: the SSDs lend the ones the first handed back."""
    import kvpool.passthrough as passthrough

    kv = make_kv(200)
    toks = list(range(200))
    with make_pool(ssd_dirs) as pool:
        pool.put(toks, kv)
        check_prefix(pool.retrieve(toks).join(), kv, 192)
        ssds = [s for s in pool.stores.values() if s.kind == "ssd"]
        idle = {s.name: {id(b) for b in s._idle_bufs} for s in ssds}
        assert all(len(v) == 2 for v in idle.values())  # two sets per reader: read-ahead and copy-out
        made = []
        real = passthrough.AlignedBuffer

        class Counting(real):  # type: ignore[misc, valid-type]
            def __init__(self, nbytes):
                made.append(nbytes)
                super().__init__(nbytes)

        monkeypatch.setattr(passthrough, "AlignedBuffer", Counting)
        check_prefix(pool.retrieve(toks).join(), kv, 192)
        assert made == []
        assert {s.name: {id(b) for b in s._idle_bufs} for s in ssds} == idle


def test_ssd_reader_has_the_next_layer_queued_while_a_layer_is_in_flight(ssd_dirs):
    """Layer 1's read is issued before layer 0's has landed, so the disk never waits on the reader."""
    from concurrent.futures import ThreadPoolExecutor

    kv = make_kv(200)
    toks = list(range(200))
    with make_pool(ssd_dirs) as pool, ThreadPoolExecutor(2) as ex:
        pool.put(toks, kv)
        ssd = pool.stores["ssd0"]
        issued: list[int] = []
        second = threading.Event()
        layer1_queued_during_layer0 = []

        def gated(names, stagings):
            layer = int(names[0].rpartition(".")[2])
            issued.append(layer)
            if layer == 1:
                second.set()

            def read():
                if layer == 0:  # layer 0 stays in flight until layer 1 is queued (or 5 s pass)
                    layer1_queued_during_layer0.append(second.wait(5.0))
                return ssd.read_many(names, stagings)

            return ex.submit(read)

        ssd.read_many_later = gated
        check_prefix(pool.retrieve(toks).join(), kv, 192)
        assert layer1_queued_during_layer0 == [True]
        assert issued == [0, 1, 2]
