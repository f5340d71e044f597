import pytest
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


def spread(tmp_path, n=3, **kw):
    dirs = [tmp_path / f"disk{i}" for i in range(n)]
    return dirs, SerialTiers(LAY, "m", memory_bytes=2 * LAY.chunk_bytes, disk_dirs=dirs, **kw)


@pytest.mark.parametrize("fmt,loader", [("torch", "serial"), ("raw", "serial"), ("raw", "layerwise")])
def test_tiers_over_every_disk_spread_chunks_and_load_them_bit_exact(tmp_path, fmt, loader):
    kv = make_kv(100)
    toks = list(range(100))
    caps = [Throttle(1e9), Throttle(1e9), None]
    dirs, s = spread(tmp_path, throttles=caps, fmt=fmt, loader=loader)
    assert s.put(toks, kv) == 6
    # chunk i on disk i mod 3: two files each, the first two chunks also in memory
    assert [len(list(d.iterdir())) for d in dirs] == [2, 2, 2] and len(s.memory) == 2
    assert s.lookup(toks) == 96
    s.drop_page_cache()
    load = s.retrieve(toks, extra_tokens=None)
    for layer in range(2):
        k, v = load.wait(layer)
        assert torch.equal(k, kv[layer][0][:, :, :96]) and torch.equal(v, kv[layer][1][:, :, :96])
    load.join()
    assert load.tokens == 96 and load.kbuf[0].shape[2] == 100 and load.elapsed_s > 0
    assert load.bytes["memory"] == 2 * LAY.chunk_bytes and load.bytes["disk"] >= 4 * LAY.chunk_bytes
    t = load.timing
    assert t["open_s"] > 0 and t["stat_s"] > 0 and t["close_s"] > 0 and t["read_s"] > 0
    assert 0 < load.fs_time_frac < 1
    assert caps[0].read is not None  # the capped disks were read through their throttles
    if loader == "layerwise":
        assert 0 <= load.blocked_s <= load.elapsed_s + 1.0
    else:
        assert load.blocked_s == load.elapsed_s


def test_a_layerwise_load_with_a_missing_file_fails_loudly_instead_of_hanging(tmp_path):
    kv = make_kv(64)
    toks = list(range(64))
    dirs, s = spread(tmp_path, n=2, fmt="raw", loader="layerwise")
    s.memory_bytes = 0
    s.memory.clear()
    s.put(toks, kv)
    for p in s.files():
        with open(p, "r+b") as f:
            f.truncate(100)  # every file cut short: the first layer read fails
    load = s.retrieve(toks)
    with pytest.raises(RuntimeError, match="short read"):
        load.join(timeout=60)


def test_tiers_reject_inconsistent_settings(tmp_path):
    with pytest.raises(ValueError, match="needs fmt='raw'"):
        spread(tmp_path, loader="layerwise")
    with pytest.raises(ValueError, match="throttles has 1 entries for 3"):
        spread(tmp_path, throttles=[None])
    with pytest.raises(ValueError, match="fmt must be"):
        spread(tmp_path, fmt="pickle")
    with pytest.raises(ValueError, match="exactly one of disk_dir and disk_dirs"):
        SerialTiers(LAY, "m", 0)


def test_throttle_measures_achieved_rate_with_overlapping_reads_counted_once():
    import time

    th = Throttle(None)  # no cap: the reads' own intervals are the busy time
    now = time.perf_counter()
    th.after_read(1000, now - 2.0)
    th.after_read(3000, now - 1.0)  # inside the first read's interval: no extra busy time
    a = th.achieved()
    assert a["read_bytes"] == 4000 and 2.0 <= a["read_busy_s"] < 2.5
    assert a["achieved_read_bytes_per_s"] == pytest.approx(4000 / a["read_busy_s"])
    th.reset_achieved()
    assert th.achieved() == {"read_bytes": 0, "read_busy_s": 0.0, "achieved_read_bytes_per_s": None}
    assert Throttle(1e6).describe()["emulated"] is True
