import torch

from kvpool import KVLayout, Throttle
from kvpool.baselines import SerialTiers

LAY = KVLayout(2, 2, 8, chunk_tokens=16)


def make_kv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)) for _ in range(2)]


def test_serial_tiers_memory_first_then_one_file_per_chunk(tmp_path):
    kv = make_kv(100)
    toks = list(range(100))
    s = SerialTiers(LAY, "m", memory_bytes=2 * LAY.chunk_bytes, disk_dir=tmp_path)
    assert s.put(toks, kv) == 6
    assert len(s.files()) == 6 and len(s.memory) == 2
    assert s.lookup(toks) == 96
    load = s.retrieve(toks, extra_tokens=None)
    assert load.tokens == 96 and load.kbuf[0].shape[2] == 100
    for layer in range(2):
        assert torch.equal(load.k[layer], kv[layer][0][:, :, :96])
        assert torch.equal(load.v[layer], kv[layer][1][:, :, :96])
    assert load.bytes["memory"] == 2 * LAY.chunk_bytes and load.bytes["disk"] > 4 * LAY.chunk_bytes
    t = load.timing
    assert t["open_s"] > 0 and t["stat_s"] > 0 and t["close_s"] > 0 and t["read_s"] > 0
    assert 0 < load.fs_time_frac < 1
    assert load.kernel_time_frac is not None and load.kernel_time_frac >= 0
    assert load.blocked_s == load.elapsed_s


def test_serial_tiers_stop_at_first_miss_and_other_requests_evict_lru(tmp_path):
    s = SerialTiers(LAY, "m", memory_bytes=2 * LAY.chunk_bytes, disk_dir=tmp_path, throttle=Throttle(1e9))
    a, b = list(range(64)), list(range(1000, 1064))
    s.put(a, make_kv(64, 1))
    s.put(b, make_kv(64, 2))
    assert len(s.memory) == 2 and s.memory_used <= 2 * LAY.chunk_bytes
    # b's head is in memory, a's chunks only on disk: losing a's second file cuts a's prefix to one chunk
    from kvpool import chunk_keys

    ka = chunk_keys(a, "m", LAY)
    assert all(k.hex not in s.memory for k in ka)
    s._file(ka[1].hex).unlink()
    assert s.lookup(a) == 16 and s.lookup(b) == 64
    assert s.retrieve(a).tokens == 16
    s.drop_page_cache()
    assert s.page_cache_bytes() >= 0 and s.disk_bytes() > 0


def test_drop_evicts_freshly_written_files(tmp_path):
    from kvpool.pagecache import drop, resident_bytes

    p = tmp_path / "x.pt"
    torch.save(torch.randn(1 << 18), p)
    drop(p)
    assert resident_bytes(p) == 0
    torch.load(p)
    assert resident_bytes(p) > 0  # buffered reads go through the page cache
