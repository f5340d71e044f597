import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


def test_latency_only_wait_adds_the_hops_latency_after_the_real_transfer(monkeypatch):
    import geomesh.wan

    slept = []
    monkeypatch.setattr(geomesh.wan.time, "sleep", slept.append)
    c = hwtopo.load("geo-3region")
    lat = WanEmulator(c, c.names, latency_only=True)
    slow = c.link("use-a100", "aps-t4").latency_s
    # the bytes took 10 s through the tbf links: the 2 hops' latency still follows them
    lat.wait("all_gather", 1000, time.perf_counter() - 10)
    assert slept == [pytest.approx(2 * slow)]
    full = WanEmulator(c, c.names)  # in-process: bytes and latency are both in the model, minus what passed
    full.wait("all_gather", 1000, time.perf_counter() - 10)
    assert len(slept) == 1


def _gather(rank, world, nbytes):
    from geomesh.bench import tx_bytes

    x = torch.full((nbytes,), rank, dtype=torch.uint8)
    got = [torch.empty_like(x) for _ in range(world)]
    before = tx_bytes()
    dist.all_gather(got, x)
    dist.barrier()  # every rank done with the gather: all of its bytes are on the wire (not in buffers)
    return [int(g[0]) for g in got], tx_bytes() - before


def test_tx_bytes_outside_a_namespace_is_none():
    from geomesh.bench import tx_bytes

    # this test process is in no rank's namespace: its interfaces have no geomesh link
    assert tx_bytes("no-such-if0") is None


def _net_namespaces() -> set[str]:
    """Every network namespace a process on this machine is in or holds a descriptor to ('net:[inode]')."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        links = [proc / "ns" / "net", *proc.glob("task/*/ns/net"), *proc.glob("fd/*")]
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:  # the process or descriptor went away while we looked
                continue
            if target.startswith("net:["):
                found.add(target)
    return found


def _needs_netns() -> None:
    ok, why = netns_support()
    if not ok:
        pytest.skip(f"namespace path unavailable: {why}")


@pytest.mark.slow
def test_netns_tbf_path_carries_the_collective():
    _needs_netns()
    c = hwtopo.load("geo-3region")
    machines = c.names[:2]
    with NetnsWan(c, machines) as net:
        assert net.describe()["mode"] == "netns-tbf"
        ours = {os.readlink(net.namespace(r)) for r in range(2)}
        assert ours <= _net_namespaces()
        nbytes = 300_000
        got = spawn(_gather, 2, (nbytes,), timeout_s=120, start_method="fork", setup=net.enter)
        assert [g[0] for g in got] == [[0, 1], [0, 1]]
        # each rank's own interface counter saw its payload leave, plus TCP/IP headers (< 10% here)
        for _, sent in got:
            assert nbytes <= sent < 1.1 * nbytes
        # the bytes really went through each rank's tbf qdisc towards its peer
        assert net.tbf_bytes(0).get(1, 0) >= nbytes
        assert net.tbf_bytes(1).get(0, 0) >= nbytes
    # close() let go of the namespaces: nothing on the machine holds them any more
    assert not ours & _net_namespaces()


LAUNCHER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed as dist
    import hwtopo
    from geomesh import NetnsWan, spawn

    def park(rank, world, out):
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            json.dump({"pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net")}, f)
        if rank == 1:
            time.sleep(600)
        dist.barrier()  # rank 0 waits here for rank 1, as a rank waits in a collective for a slow peer

    if __name__ == "__main__":
        cluster = hwtopo.load("geo-3region")
        net = NetnsWan(cluster, cluster.names[:2]).setup()
        spawn(park, 2, (sys.argv[1],), setup=net.enter, start_method="fork", timeout_s=600, pg_timeout_s=600)
    """
)


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie not yet reaped by its new parent has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_namespace_and_no_rank(tmp_path):
    _needs_netns()
    named_before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert launcher.poll() is None, "the launcher exited before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.2)
        time.sleep(0.5)  # both ranks past their first write, rank 0 inside the barrier
        ranks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        ours = {r["netns"] for r in ranks}
        held = {os.readlink(f) for f in Path(f"/proc/{launcher.pid}/fd").iterdir() if "net:[" in os.readlink(f)}
        assert len(ours) == 2 and ours < held and len(held) == 3  # the core namespace and one per rank
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while any(_alive(r["pid"]) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r["pid"] for r in ranks if _alive(r["pid"])], "a rank outlived its SIGKILLed launcher"
    # a rank whose main thread is a zombie may still have threads (gloo's) finishing their exit
    while held & _net_namespaces() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not held & _net_namespaces(), "a namespace of the killed launcher is still reachable"
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == named_before
