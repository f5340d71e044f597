import pytest

import hwtopo
from hwtopo import Cluster, Link, Machine


def test_relative_speeds_and_totals():
    c = hwtopo.load("edge-home")
    sp = c.relative_speeds()
    assert sp["desktop"] == 1.0 and sp["sbc-2"] == pytest.approx(0.2)
    assert c.total_memory_bytes == pytest.approx((32 + 16 + 8 + 4) * 2**30)
    assert c.total_cores == 20


def test_relative_speeds_prefer_measured_flops():
    c = Cluster(machines=(Machine("a", speed=1.0, flops=1e9), Machine("b", speed=1.0, flops=4e9)))
    assert c.relative_speeds() == {"a": 0.25, "b": 1.0}


def test_region_links_and_bottleneck():
    c = hwtopo.load("geo-3region")
    link = c.link("use-a100", "aps-t4")
    assert link is not None and {link.a, link.b} == {"us-east", "ap-south"}
    assert c.bottleneck_bandwidth_bytes_per_s("use-a100", "euw-v100") == pytest.approx(40e6 / 8)
    assert c.route_latency_s("euw-v100", "aps-t4") == pytest.approx(0.065)


def test_multi_hop_route_picks_lowest_latency():
    c = Cluster(
        machines=(Machine("a"), Machine("b"), Machine("c"), Machine("d")),
        links=(
            Link("a", "b", 100.0, 0.010),
            Link("b", "d", 10.0, 0.010),
            Link("a", "c", 1000.0, 0.001),
            Link("c", "d", 1000.0, 0.050),
        ),
    )
    route = c.route("a", "d")
    assert [(x.a, x.b) for x in route] == [("a", "b"), ("b", "d")]
    assert c.bottleneck_bandwidth_bytes_per_s("a", "d") == 10.0
    assert c.transfer_time_s("a", "d", 100) == pytest.approx(0.02 + 10.0)
    with pytest.raises(LookupError):
        Cluster(machines=(Machine("x"), Machine("y"))).route("x", "y")


def test_colocated_in_region():
    c = Cluster(machines=(Machine("a", region="r"), Machine("b", region="r")), regions=("r",))
    assert c.route("a", "b") == []
    assert c.bottleneck_bandwidth_bytes_per_s("a", "b") == float("inf")


def test_frozen():
    m = Machine("a")
    with pytest.raises(AttributeError):
        m.cores = 3
    assert m.with_(cores=3).cores == 3


def test_accelerator_interconnect():
    m = hwtopo.load("gpu-node-8").machines[0]
    assert m.accelerator_interconnect_bytes_per_s == pytest.approx(450e9)
    assert hwtopo.load("geo-3region").machines[0].accelerator_interconnect_bytes_per_s is None
