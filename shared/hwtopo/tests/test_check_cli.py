"""`hwtopo check` on malformed specs: exit 2, the file and the field named, a hint of what is valid."""

import json
import subprocess
import sys

import pytest

import hwtopo
from hwtopo.cli import main


def _spec(**machine) -> str:
    m = {"name": "a", "cores": 4, "memory": "8GiB"}
    m.update(machine)
    spec = {"machines": [m, {"name": "b", "cores": 2}], "links": [{"a": "a", "b": "b", "bandwidth": "1Gbps"}]}
    return json.dumps(spec)


def _link(**link) -> str:
    base = {"a": "a", "b": "b", "bandwidth": "1Gbps", "latency": "1ms"}
    base.update(link)
    return json.dumps({"machines": [{"name": "a"}, {"name": "b"}], "links": [base]})


def _numa(*nodes, **machine) -> str:
    return _spec(numa_nodes=list(nodes), **machine)


# (case id, spec text, the field the error must name, a fragment of the hint saying what is valid)
MALFORMED = [
    ("cores-1e26-float", _spec(cores=1e26), "machines[0].cores", "between 1 and 65536"),
    ("cores-1e26-int", _spec(cores=10**26), "machines[0].cores", "between 1 and 65536"),
    ("cores-zero", _spec(cores=0), "machines[0].cores", "between 1 and"),
    ("cores-bool", _spec(cores=True), "machines[0].cores", "integer"),
    ("threads-below-cores", _spec(cores=4, threads=2), "machines[0].threads", "at least one thread per core"),
    ("threads-zero", _spec(threads=0), "machines[0].threads", "between 1 and"),
    ("memory-inf", _spec(memory="1e400GiB"), "machines[0].memory", "e.g. '16GiB'"),
    ("memory-zero-bytes", _spec(memory="0 B"), "machines[0].memory", "greater than zero"),
    ("memory-zero", _spec(memory=0), "machines[0].memory", "greater than zero"),
    ("memory-absurd", _spec(memory="1e30TiB"), "machines[0].memory", "at most 1e+24"),
    ("memory-negative", _spec(memory=-5), "machines[0].memory", ">= 0"),
    ("speed-infinity", _spec(speed=float("inf")), "machines[0].speed", "use e.g. 1.0"),
    ("speed-nan", _spec(speed=float("nan")), "machines[0].speed", "use e.g. 1.0"),
    ("speed-zero", _spec(speed=0), "machines[0].speed", "> 0"),
    ("compute-zero", _spec(compute=0), "machines[0].compute", "greater than zero"),
    ("numa-cpu-99", _numa({"id": 0, "cpus": "0-3,99"}), "machines[0].numa_nodes[0].cpus", "valid CPU ids are 0-3"),
    ("numa-cpu-beyond-threads", _numa({"id": 0, "cpus": [8]}, threads=8), "numa_nodes[0].cpus", "0-7"),
    (
        "numa-cpu-in-two-nodes",
        _numa({"id": 0, "cpus": [0, 1]}, {"id": 1, "cpus": "1-2"}),
        "numa_nodes[1].cpus",
        "one node",
    ),
    ("numa-huge-range", _numa({"id": 0, "cpus": "0-99999999999"}), "numa_nodes[0].cpus", "e.g. '0-3,8'"),
    (
        "numa-cpu-outside-listed-cpus",
        _numa({"id": 0, "cpus": "8-10,99"}, cpus="8-11"),
        "numa_nodes[0].cpus",
        "valid CPU ids are 8-11",
    ),
    ("machine-cpus-too-few", _spec(cpus="0-2"), "machines[0].cpus", "one CPU id per hardware thread"),
    ("numa-cpu-twice", _numa({"id": 0, "cpus": [1, 1]}), "numa_nodes[0].cpus", "once"),
    ("numa-negative-cpu", _numa({"id": 0, "cpus": [-1]}), "numa_nodes[0].cpus", "0-65535"),
    ("numa-id-huge", _numa({"id": 70000}), "numa_nodes[0].id", "between 0 and 65535"),
    ("numa-bandwidth-zero", _numa({"id": 0, "bandwidth": "0GB/s"}), "numa_nodes[0].bandwidth", "greater than zero"),
    ("disk-capacity-zero", _spec(disks=[{"name": "d", "capacity": "0B"}]), "disks[0].capacity", "greater than zero"),
    ("disk-read-nan", _spec(disks=[{"name": "d", "read_bandwidth": float("nan")}]), "disks[0].read_bandwidth", "e.g."),
    (
        "gpu-memory-zero",
        _spec(accelerators=[{"kind": "cuda", "name": "g", "memory": "0GiB"}]),
        "accelerators[0].memory",
        "greater than zero",
    ),
    (
        "gpu-peak-inf",
        _spec(accelerators=[{"kind": "cuda", "name": "g", "peak": "1e309TFLOPS"}]),
        "accelerators[0].peak",
        "finite",
    ),
    ("link-bandwidth-inf", _link(bandwidth="1e400Gbps"), "links[0].bandwidth", "e.g. '10Gbps'"),
    ("link-bandwidth-zero", _link(bandwidth=0), "links[0].bandwidth", "greater than zero"),
    ("link-latency-negative", _link(latency=-0.5), "links[0].latency", ">= 0"),
    ("link-latency-inf", _link(latency="1e999s"), "links[0].latency", "e.g. '25ms'"),
    ("duplicate-key", '{"machines": [{"name": "a", "cores": 2, "cores": 4}]}', "cores", "keep one"),
    ("regions-twice", '{"regions": ["r", "r"], "machines": [{"name": "a", "region": "r"}]}', "regions", "unique"),
]


@pytest.mark.parametrize("text,field,hint", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_check_rejects_malformed_spec(tmp_path, capsys, text, field, hint):
    path = tmp_path / "spec.json"
    path.write_text(text)
    assert main(["check", str(path)]) == 2  # an uncaught exception would fail the test, not return
    err = capsys.readouterr().err
    assert err.startswith(f"hwtopo: error: {path}: ")
    assert field in err and hint in err, err
    assert "Traceback" not in err
    with pytest.raises(hwtopo.SpecError) as e:
        hwtopo.load(path)
    assert field in e.value.field and e.value.source == str(path)


def test_table_is_large_enough():
    assert len(MALFORMED) >= 20


def _run_check(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hwtopo", "check", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "name,data,says",
    [
        ("png.json", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not UTF-8 text (byte 0x89 at offset 0)"),
        ("nul.json", b'{"machines": []}\x00\x00', "binary data (a NUL character at offset 16)"),
        ("latin1.toml", 'name = "caf\xe9"\n'.encode("latin-1"), "not UTF-8 text (byte 0xe9"),
        ("utf16.json", '{"machines": []}'.encode("utf-16"), "not UTF-8"),
        ("empty.json", b"", "not valid JSON"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        ("bigint.json", b'{"machines": [{"name": "a", "cores": ' + b"9" * 5000 + b"}]}", "not valid JSON"),
        ("array.json", b"[1, 2]", "expected a table/object"),
    ],
)
def test_unreadable_spec_files_exit_2_naming_the_file(tmp_path, name, data, says):
    path = tmp_path / name
    path.write_bytes(data)
    out = _run_check(path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"hwtopo: error: {path}: ") and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_valid_spec_and_probe_output_pass_check(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(_numa({"id": 0, "cpus": "0-1", "memory": 0}, {"id": 1, "cpus": [2, 3]}, threads=4))
    assert main(["check", str(path)]) == 0
    # a container's share of a larger host: its CPU ids are listed, its NUMA node names only those
    path.write_text(_numa({"id": 1, "cpus": "8-11"}, cpus="8-11"))
    assert main(["check", str(path)]) == 0
    assert hwtopo.load(path).machines[0].cpu_ids == (8, 9, 10, 11)
    probed = hwtopo.save(hwtopo.probe_cluster(), tmp_path / "probed.json")
    assert hwtopo.load(probed) == hwtopo.probe_cluster()


def test_unknown_memory_round_trips_as_absent():
    c = hwtopo.Cluster(machines=(hwtopo.Machine("a", accelerators=(hwtopo.Accelerator("cuda", "g"),)),))
    d = hwtopo.to_dict(c)
    assert "memory_bytes" not in d["machines"][0] and "memory_bytes" not in d["machines"][0]["accelerators"][0]
    assert hwtopo.from_dict(d) == c
