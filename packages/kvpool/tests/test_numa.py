import logging
import os
import threading

import pytest
import torch

import kvpool.numa as numa
from kvpool import KVLayout, KVPool, MemoryStore, build_devices

needs_numa = pytest.mark.skipif(numa.supported() is not None, reason=f"no NUMA syscalls: {numa.supported()}")


def fake_sysfs(tmp_path, nodes: dict[int, str]):
    """A /sys/devices/system/node look-alike with the given node -> cpulist."""
    root = tmp_path / "node"
    root.mkdir(parents=True)
    (root / "online").write_text(",".join(str(n) for n in sorted(nodes)) + "\n")
    for n, cpus in nodes.items():
        (root / f"node{n}").mkdir()
        (root / f"node{n}" / "cpulist").write_text(cpus + "\n")
    return root


def test_cpulist_and_node_topology_parsing(tmp_path):
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []
    root = fake_sysfs(tmp_path, {0: "0-1", 2: "4-5"})
    assert numa.online_nodes(root) == [0, 2]
    assert numa.node_cpus(2, root) == [4, 5]
    assert numa.node_cpus(7, root) == []
    assert numa.online_nodes(tmp_path / "missing") == [0]  # no sysfs: one node


@needs_numa
def test_module_is_bound_to_its_node_with_mbind():
    node = numa.online_nodes()[0]
    store = MemoryStore("mem0", 4 << 20, numa_node=node)
    assert store.describe()["numa"] == {"node": node, "bound": True, "why_unbound": None}
    assert store.numa_node == node
    assert numa.policy_of(store.arena) == (numa.MPOL_BIND, [node])  # the policy really is set
    assert set(numa.page_nodes(store.arena)) == {node}  # and the touched pages live there
    data = torch.arange(1000, dtype=torch.float32)
    assert store.put("u", data) and torch.equal(store.read("u").view(torch.float32), data)


@needs_numa
def test_unbound_module_keeps_the_default_policy():
    store = MemoryStore("mem0", 1 << 20)
    assert store.describe()["numa"]["bound"] is False and store.numa_node is None
    assert numa.policy_of(store.arena) == (0, [])


def test_node_not_online_falls_back_to_an_unbound_arena(caplog):
    missing = max(numa.online_nodes()) + 5
    with caplog.at_level(logging.WARNING, logger="kvpool.stores"):
        store = MemoryStore("mem1", 1 << 20, numa_node=missing)
    info = store.describe()["numa"]
    assert info["bound"] is False and "not online" in info["why_unbound"] and store.numa_node is None
    assert "not bound to a NUMA node" in caplog.text
    data = torch.arange(100, dtype=torch.int64)
    assert store.put("u", data) and torch.equal(store.read("u").view(torch.int64), data)


@needs_numa
def test_mbind_refused_by_the_kernel_falls_back(tmp_path, monkeypatch):
    # sysfs says node 1 exists, the kernel has no such node: mbind fails, the arena stays usable
    if 1 in numa.online_nodes():
        pytest.skip("this host really has a node 1")
    monkeypatch.setattr(numa, "NODE_ROOT", fake_sysfs(tmp_path, {0: "0", 1: "1"}))
    store = MemoryStore("mem1", 1 << 20, numa_node=1)
    assert store.describe()["numa"]["bound"] is False
    assert "mbind to NUMA node 1 failed" in store.describe()["numa"]["why_unbound"]
    assert store.put("u", b"x" * 100) and bytes(store.read("u").numpy()) == b"x" * 100


def test_devices_spread_memory_modules_over_nodes(tmp_path):
    devs = build_devices([], memory_modules=3, memory_bytes=1 << 20, measure=False, numa_nodes=[0, 9])
    try:
        got = [s.describe()["numa"]["node"] for s in devs.stores]
        assert got == [0, 9, 0]
        assert devs.stores[1].describe()["numa"]["bound"] is False  # node 9 is not online here
    finally:
        devs.close()
    devs = build_devices([], memory_modules=2, memory_bytes=1 << 20, measure=False, numa=False)
    assert [s.describe()["numa"]["node"] for s in devs.stores] == [None, None]
    devs = build_devices([], memory_modules=2, memory_bytes=1 << 20, measure=False)  # this host's nodes
    assert [s.describe()["numa"]["node"] for s in devs.stores] == [
        numa.online_nodes()[i % len(numa.online_nodes())] for i in range(2)
    ]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_reader_thread_is_pinned_to_its_node_only_on_multi_node_hosts(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    seen = {}

    def probe(node):
        seen["pinned"] = numa.pin_thread_to_node(node)
        seen["cpus"] = os.sched_getaffinity(0)

    # one node: nothing changes
    monkeypatch.setattr(numa, "NODE_ROOT", fake_sysfs(tmp_path / "one", {0: f"{allowed[0]}-{allowed[-1]}"}))
    t = threading.Thread(target=probe, args=(0,))
    t.start()
    t.join()
    assert seen == {"pinned": False, "cpus": set(allowed)}
    # two nodes: the thread (not the process) is restricted to its node's CPUs
    monkeypatch.setattr(numa, "NODE_ROOT", fake_sysfs(tmp_path / "two", {0: str(allowed[0]), 1: str(allowed[1])}))
    t = threading.Thread(target=probe, args=(1,))
    t.start()
    t.join()
    assert seen == {"pinned": True, "cpus": {allowed[1]}}
    assert os.sched_getaffinity(0) == set(allowed)


def test_pool_retrieval_with_node_bound_modules_is_bit_exact(tmp_path, monkeypatch):
    lay = KVLayout(2, 2, 8, chunk_tokens=16)
    stores = [MemoryStore(f"mem{i}", 8 * lay.chunk_bytes, numa_node=numa.online_nodes()[0]) for i in range(2)]
    pool = KVPool(stores, lay, "m", {"mem0": 1e9, "mem1": 1e9})
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)) for _ in range(2)]
    assert pool.put(list(range(64)), kv) == 4
    load = pool.retrieve(list(range(64))).join()
    for layer in range(2):
        assert torch.equal(load.k[layer], kv[layer][0]) and torch.equal(load.v[layer], kv[layer][1])
    assert set(load.describe()["per_device"]) == {"mem0", "mem1"}
