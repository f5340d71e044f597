import pytest

from kvpool import build_devices
from kvpool.bench import BenchConfig, _emulation_check, _WarmReps


def test_emulation_check_judges_each_device_against_its_own_cap():
    acc = _WarmReps()
    mib = 1 << 20
    # fast device at its 200 MB/s cap, slow one at its 100 MB/s cap: valid
    acc.device_reads = {"kvpool.ssd0": [200 * mib, 200 * mib / 200e6], "kvpool.ssd1": [100 * mib, 100 * mib / 100e6]}
    acc.device_caps = {"kvpool.ssd0": 200e6, "kvpool.ssd1": 100e6}
    check = _emulation_check(acc, True)
    assert check["valid"] and check["cap_read_bytes_per_s"] is None
    assert check["devices"]["kvpool.ssd1"]["cap_read_bytes_per_s"] == 100e6
    # the slow device delivering the fast one's rate is off by 100%: invalid, and named
    acc.device_reads["kvpool.ssd1"] = [100 * mib, 100 * mib / 200e6]
    check = _emulation_check(acc, True)
    assert not check["valid"] and list(check["off_by_more_than_10pct"]) == ["kvpool.ssd1"]
    assert _emulation_check(acc, False) == {"emulated": False, "valid": True}


def test_build_devices_caps_each_ssd_on_its_own(tmp_path):
    paths = [tmp_path / f"s{i}" for i in range(2)]
    for p in paths:
        p.mkdir()
    ds = build_devices(paths, memory_modules=0, ssd_bytes=1 << 20, ssd_read_caps=[2e8, 1e8], measure=False)
    try:
        assert [s.throttle.read_bytes_per_s for s in ds.stores] == [2e8, 1e8]
        assert ds.bandwidths == {"ssd0": 2e8, "ssd1": 1e8}  # placement weighs them by their caps
    finally:
        ds.close()
    with pytest.raises(ValueError, match="ssd_read_caps must give one positive cap per SSD path"):
        build_devices(paths, memory_modules=0, ssd_read_caps=[2e8], measure=False)


def test_bench_config_rejects_bad_mixed_and_io_bound_caps():
    with pytest.raises(ValueError, match="mixed_ssd_read_caps"):
        BenchConfig(mixed_ssd_read_caps=(2e8, -1.0)).validate()
    with pytest.raises(ValueError, match="io_bound_ssd_read_cap"):
        BenchConfig(io_bound_ssd_read_cap=0.0).validate()
    BenchConfig(mixed_ssd_read_caps=None, io_bound_ssd_read_cap=None).validate()
