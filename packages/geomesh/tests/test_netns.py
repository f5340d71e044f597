import pytest
import torch
import torch.distributed as dist

import hwtopo
from geomesh import NetnsError, NetnsWan, WanEmulator, spawn, wan_mode
from geomesh.netns import netns_support


def test_wan_mode_decision_and_fallback():
    yes = lambda: (True, "")  # noqa: E731
    no = lambda: (False, "network namespaces and tc need root (running as uid 1000)")  # noqa: E731
    assert wan_mode("auto", yes).mode == "netns"
    d = wan_mode("auto", no)
    assert d.mode == "inprocess" and d.reason.startswith("fallback") and "root" in d.reason
    assert wan_mode("inprocess", yes).mode == "inprocess"
    assert wan_mode("netns", yes).mode == "netns"
    with pytest.raises(NetnsError, match="wan: 'netns' is not possible here: .*root"):
        wan_mode("netns", no)
    with pytest.raises(ValueError, match="wan: 'tbf' is not valid"):
        wan_mode("tbf", yes)


def test_latency_only_emulator_adds_latency_per_ring_step():
    c = hwtopo.load("geo-3region")
    full = WanEmulator(c, c.names)
    lat = WanEmulator(c, c.names, latency_only=True)
    slow = c.link("use-a100", "aps-t4")
    # 2 ring steps of the slowest-latency link, whatever the size: bytes are shaped elsewhere (tbf)
    assert lat.collective_time_s("all_gather", 10_000_000) == pytest.approx(2 * slow.latency_s)
    assert lat.collective_time_s("all_gather", 10_000_000) < full.collective_time_s("all_gather", 10_000_000)
    assert lat.describe()["mode"] == "inprocess-latency" and full.describe()["mode"] == "inprocess"


def _gather(rank, world, nbytes):
    x = torch.full((nbytes,), rank, dtype=torch.uint8)
    got = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(got, x)
    return [int(g[0]) for g in got]


@pytest.mark.slow
def test_netns_tbf_path_carries_the_collective():
    ok, why = netns_support()
    if not ok:
        pytest.skip(f"namespace path unavailable: {why}")
    c = hwtopo.load("geo-3region")
    machines = c.names[:2]
    with NetnsWan(c, machines) as net:
        assert net.describe()["mode"] == "netns-tbf"
        nbytes = 300_000
        got = spawn(
            _gather,
            2,
            (nbytes,),
            timeout_s=120,
            start_method="fork",
            setup=net.enter,
            master_addr=net.address(0),
        )
        assert got == [[0, 1], [0, 1]]
        # the bytes really went through each rank's tbf qdisc towards its peer
        assert net.tbf_bytes(0).get(1, 0) >= nbytes
        assert net.tbf_bytes(1).get(0, 0) >= nbytes
    # close() removed the namespaces
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.namespaces[0] not in listed and net.core not in listed
