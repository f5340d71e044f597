import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import hwtopo
from hwtopo import cli
from hwtopo.probe import _meminfo_bytes, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_meminfo_parsing_handles_node_prefix():
    assert _meminfo_bytes("Node 0 MemTotal:  1024 kB\nNode 0 MemFree: 1 kB", "MemTotal") == 1024 * 1024
    assert _meminfo_bytes("MemTotal:       2048 kB\n", "MemTotal") == 2048 * 1024


def test_probe_this_machine():
    m = hwtopo.probe()
    assert m.hardware_threads == len(os.sched_getaffinity(0))
    assert 1 <= m.cores <= m.hardware_threads
    assert m.total_memory_bytes > 0
    # spec round trip of a probed machine
    c = hwtopo.probe_cluster()
    assert hwtopo.from_dict(json.loads(hwtopo.dumps(c))) == c


def test_probe_missing_sysfs_knows_less(monkeypatch, tmp_path):
    p = importlib.import_module("hwtopo.probe")

    monkeypatch.setattr(p, "SYS", tmp_path / "nosys")
    monkeypatch.setattr(p, "PROC", tmp_path / "noproc")
    m = p.probe(gpus=False)
    assert m.cores >= 1 and m.numa_nodes == () and m.disks == ()
    assert any("NUMA" in n for n in m.notes) and any("memory unknown" in n for n in m.notes)


def test_probe_records_the_matmul_extensions_cpuinfo_lists(monkeypatch, tmp_path):
    p = importlib.import_module("hwtopo.probe")
    (tmp_path / "proc").mkdir()
    flags = "fpu sse avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 unrelated"
    (tmp_path / "proc" / "cpuinfo").write_text(
        f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t: {flags}\n"
    )
    monkeypatch.setattr(p, "PROC", tmp_path / "proc")
    m = p.probe(gpus=False)
    assert m.isa == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
    assert hwtopo.from_dict(json.loads(hwtopo.dumps(hwtopo.Cluster(machines=(m,))))).machines[0].isa == m.isa
    monkeypatch.setattr(p, "PROC", tmp_path / "noproc")
    m = p.probe(gpus=False)
    assert m.isa == () and any("instruction-set" in n for n in m.notes)
    with pytest.raises(hwtopo.SpecError, match=r"machines\[0\]\.isa"):
        hwtopo.from_dict({"machines": [{"name": "a", "isa": "avx2"}]})


def test_cli_probe_json_lists_cores(capsys):
    assert cli.main(["probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["machines"][0]["threads"] == len(os.sched_getaffinity(0))


def test_cli_check_bad_spec_exits_2(tmp_path, capsys):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"machines": [{"name": "a"}], "links": [{"a": "a", "b": "q", "bandwidth": "1Gbps"}]}))
    assert cli.main(["check", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "links[0].b" in err[0]
    assert cli.main(["check", "edge-home"]) == 0


def test_measure_small(tmp_path):
    r = hwtopo.matmul_flops(64, threads=1, seconds=0.01)
    assert r.flops > 0 and r.backend in ("torch", "numpy")
    assert hwtopo.memcpy_bandwidth(1 << 20, 0.01) > 0
    for direct in (False, True):
        d = hwtopo.disk_bandwidth(tmp_path, 4 << 20, direct=direct, block=1 << 20)
        assert d.read_bytes_per_s > 0 and d.write_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []
    m = hwtopo.attach(hwtopo.Machine("x", disks=(hwtopo.Disk("d"),)), r, {"d": d})
    assert m.flops == r.flops and m.disks[0].read_bandwidth_bytes_per_s == d.read_bytes_per_s


def test_measure_emulation_reports_asked_and_achieved():
    res = cli.measure_emulation(quick=True)
    assert res["emulated"] is True
    methods = [c["method"] for c in res["cpu"]]
    assert "duty-cycle" in methods
    for c in res["cpu"]:
        assert c["asked_speed"] == 0.5 and c["achieved_speed"] > 0
    assert res["link"]["asked_bandwidth_bytes_per_s"] == 10e6 and res["link"]["achieved_bandwidth_bytes_per_s"] > 0


@pytest.mark.skipif(
    shutil.which("taskset") is None or 1 not in os.sched_getaffinity(0), reason="needs taskset and CPU 1"
)
def test_probe_under_a_cpu_mask_lists_only_usable_cpus_and_passes_check(tmp_path):
    """A process pinned to CPU 1 probes a machine of one thread whose CPU id is 1, in node and machine."""
    code = "import hwtopo; hwtopo.save(hwtopo.probe_cluster(), __import__('sys').argv[1])"
    path = tmp_path / "masked.json"
    subprocess.run(["taskset", "-c", "1", sys.executable, "-c", code, str(path)], check=True)
    m = hwtopo.load(path).machines[0]
    assert m.threads == 1 and m.cpu_ids == (1,)
    assert all(set(n.cpus) <= {1} for n in m.numa_nodes)
