import json

import pytest

import hwtopo
from hwtopo import SpecError
from hwtopo.examples import EXAMPLES


def base_spec():
    return {
        "name": "t",
        "machines": [
            {"name": "a", "cores": 4, "memory": "8GiB", "speed": 1.0},
            {"name": "b", "cores": 2, "memory": "4GiB", "speed": 0.5},
        ],
        "links": [{"a": "a", "b": "b", "bandwidth": "1Gbps", "latency": "1ms"}],
    }


def test_examples_present_and_valid():
    assert set(EXAMPLES) >= {"edge-home", "geo-3region", "gpu-node-8", "storage-server"}
    for name in EXAMPLES:
        c = hwtopo.load(name)
        assert c.machines
    assert len(hwtopo.load("storage-server").machines[0].disks) == 4
    assert len(hwtopo.load("storage-server").machines[0].numa_nodes) == 2
    assert len(hwtopo.load("gpu-node-8").machines[0].accelerators) == 8


@pytest.mark.parametrize("name", ["edge-home", "geo-3region", "gpu-node-8", "storage-server"])
def test_json_round_trip(tmp_path, name):
    c = hwtopo.load(name)
    path = hwtopo.save(c, tmp_path / "c.json")
    again = hwtopo.load(path)
    assert again == c
    assert hwtopo.from_dict(json.loads(hwtopo.dumps(c))) == c


def test_toml_and_json_agree(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        'name = "t"\n[[machines]]\nname = "a"\ncores = 4\nmemory = "8GiB"\n'
        '[[machines]]\nname = "b"\ncores = 2\nmemory = "4GiB"\nspeed = 0.5\n'
        '[[links]]\nendpoints = ["a", "b"]\nbandwidth = "1Gbps"\nlatency = "1ms"\n'
    )
    assert hwtopo.load(toml) == hwtopo.from_dict(base_spec())


def _err(spec):
    with pytest.raises(SpecError) as e:
        hwtopo.from_dict(spec)
    return e.value


def test_bad_link_bandwidth_names_field():
    s = base_spec()
    s["links"][0]["bandwidth"] = "10 Gbs"
    e = _err(s)
    assert str(e) == "links[0].bandwidth: '10 Gbs' is not a bandwidth; use e.g. '10Gbps'"


def test_unknown_field():
    s = base_spec()
    s["machines"][1]["ram"] = "4GiB"
    e = _err(s)
    assert e.field == "machines[1].ram" and "unknown field" in str(e) and "memory" in str(e)


def test_unknown_top_level_field():
    s = base_spec()
    s["hosts"] = []
    assert _err(s).field == "hosts"


def test_duplicate_machine_names():
    s = base_spec()
    s["machines"][1]["name"] = "a"
    e = _err(s)
    assert e.field == "machines[1].name" and "duplicate" in str(e)


def test_dangling_link_endpoint():
    s = base_spec()
    s["links"][0]["b"] = "zzz"
    e = _err(s)
    assert e.field == "links[0].b" and "'zzz'" in str(e)


def test_negative_values():
    s = base_spec()
    s["machines"][0]["memory"] = -5
    assert _err(s).field == "machines[0].memory"
    s = base_spec()
    s["machines"][0]["speed"] = -1
    assert _err(s).field == "machines[0].speed"
    s = base_spec()
    s["machines"][0]["cores"] = 0
    assert _err(s).field == "machines[0].cores"


def test_zero_bandwidth_rejected():
    s = base_spec()
    s["links"][0]["bandwidth"] = 0
    assert _err(s).field == "links[0].bandwidth"


def test_missing_required():
    s = base_spec()
    del s["links"][0]["bandwidth"]
    assert _err(s).field == "links[0].bandwidth_bytes_per_s"
    s = base_spec()
    del s["machines"][0]["name"]
    assert _err(s).field == "machines[0].name"
    assert _err({"name": "x"}).field == "machines"


def test_self_link_and_bad_endpoints():
    s = base_spec()
    s["links"][0]["b"] = "a"
    assert _err(s).field == "links[0].b"
    s = base_spec()
    s["links"][0] = {"endpoints": ["a"], "bandwidth": "1Gbps"}
    assert _err(s).field == "links[0].endpoints"


def test_field_given_twice():
    s = base_spec()
    s["machines"][0]["memory_bytes"] = 5
    assert "given twice" in str(_err(s))


def test_duplicate_numa_and_disk():
    s = base_spec()
    s["machines"][0]["numa_nodes"] = [{"id": 0}, {"id": 0}]
    assert _err(s).field == "machines[0].numa_nodes[1].id"
    s = base_spec()
    s["machines"][0]["disks"] = [{"name": "d"}, {"name": "d"}]
    assert _err(s).field == "machines[0].disks[1].name"


def test_bad_types():
    s = base_spec()
    s["machines"][0]["disks"] = [{"name": "d", "rotational": "yes"}]
    assert _err(s).field == "machines[0].disks[0].rotational"
    s = base_spec()
    s["machines"][0]["numa_nodes"] = [{"id": 0, "cpus": "0-x"}]
    assert _err(s).field == "machines[0].numa_nodes[0].cpus"
    s = base_spec()
    s["machines"] = {"a": 1}
    assert _err(s).field == "machines"


def test_unknown_region():
    s = base_spec()
    s["regions"] = ["r1"]
    s["machines"][0]["region"] = "r2"
    assert _err(s).field == "machines[0].region"


def test_bad_file_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        hwtopo.load(p)
    with pytest.raises(SpecError, match=r"\.json or \.toml"):
        hwtopo.load(tmp_path / "x.yaml")
    with pytest.raises(SpecError, match="examples are"):
        hwtopo.load("no-such-example")
    with pytest.raises(SpecError, match="cannot read"):
        hwtopo.load(tmp_path / "missing.json")
