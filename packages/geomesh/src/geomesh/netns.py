"""Real WAN bandwidth on one machine: a network namespace per rank, shaped with the ``tbf`` qdisc.

Layout (needs root and iproute2's ``ip`` and ``tc``)::

    ns <tag>-0 ──veth── ┐
    ns <tag>-1 ──veth── ┤ bridge in ns <tag>-c
    ns <tag>-2 ──veth── ┘

Every rank's namespace has one interface ``gmeth0`` with its own address. Its egress is classified by
destination address (``htb`` + ``u32`` filter, used only to pick a class) into one ``tbf`` qdisc per
peer at the bandwidth of the cluster spec's route between the two machines, so each direction of
each pair of regions gets its own shaped link. A worker enters its namespace (``enter``) before
``init_process_group``; gloo then talks over the shaped veths for real. ``netem`` is not available
on every kernel (not here), so the links' latency is still added in-process by ``WanEmulator``
(``latency_only=True``); every description says which part is real and which is emulated.

``wan_mode(requested)`` decides between this and the in-process ``WanEmulator`` and says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import hwtopo

__all__ = ["NetnsWan", "NetnsError", "WAN_MODES", "WanDecision", "wan_mode", "netns_support", "netns_prerequisites"]

log = logging.getLogger(__name__)
WAN_MODES = ("auto", "netns", "inprocess")
IFNAME = "gmeth0"
_CLONE_NEWNET = 0x40000000
_HTB_SLOT = ("htb", "rate", "10gbit", "quantum", "60000")


class NetnsError(RuntimeError):
    """The namespace path cannot be set up here; the message says why."""


def _run(args: Sequence[str]) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}")


def netns_prerequisites() -> tuple[bool, str]:
    """(True, "") when Linux, root, ``ip`` and ``tc`` are there, else (False, why). Cheap: builds
    nothing; a caller that then builds its namespaces must handle NetnsError itself."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, f"network namespaces and tc need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not on PATH"
    return True, ""


def netns_support() -> tuple[bool, str]:
    """(True, "") when namespaces, veths, a bridge and tbf can be made here, else (False, why)."""
    ok, why = netns_prerequisites()
    if not ok:
        return ok, why
    try:
        probe = NetnsWan.__new__(NetnsWan)
        probe._init(["a", "b"], [[None, 1e6], [1e6, None]], tag=f"gmp{os.getpid() % 100000}")
        try:
            probe.setup()
        finally:
            probe.close()
    except (NetnsError, OSError, subprocess.SubprocessError) as e:
        return False, f"could not build a test namespace pair with tbf: {e}"
    return True, ""


@dataclass(frozen=True)
class WanDecision:
    mode: str  # "netns" or "inprocess"
    reason: str


def wan_mode(requested: str = "auto", support: Callable[[], tuple[bool, str]] = netns_support) -> WanDecision:
    """Which WAN emulation to use: ``netns`` (real tbf shaping) when requested or available under
    ``auto``, else the in-process one. ``requested="netns"`` where it cannot work is an error."""
    if requested not in WAN_MODES:
        raise ValueError(f"wan: {requested!r} is not valid; choose from {list(WAN_MODES)}")
    if requested == "inprocess":
        return WanDecision("inprocess", "requested")
    ok, why = support()
    if ok:
        return WanDecision("netns", "root, ip and tc available; tbf qdiscs in network namespaces")
    if requested == "netns":
        raise NetnsError(f"wan: 'netns' is not possible here: {why}")
    return WanDecision("inprocess", f"fallback: {why}")


def _route_bandwidth(cluster: hwtopo.Cluster, a: str, b: str) -> float | None:
    if a == b:
        return None
    route = cluster.route(a, b)
    return min(lk.bandwidth_bytes_per_s for lk in route) if route else None


class NetnsWan:
    """Namespaces, veths, bridge and tbf qdiscs for the ranks of ``machines``; ``close()`` removes all."""

    def __init__(self, cluster: hwtopo.Cluster | str, machines: Sequence[str], tag: str | None = None):
        if isinstance(cluster, str):
            cluster = hwtopo.load(cluster)
        known = set(cluster.names)
        for i, m in enumerate(machines):
            if m not in known:
                raise ValueError(f"machines[{i}]: {m!r} is not a machine of cluster {cluster.name!r}")
        bw = [[_route_bandwidth(cluster, a, b) for b in machines] for a in machines]
        self._init(list(machines), bw, tag or f"gm{os.getpid() % 100000}")
        self.cluster_name = cluster.name

    def _init(self, machines: list[str], bandwidth: list[list[float | None]], tag: str) -> None:
        if len(machines) > 200:
            raise ValueError("at most 200 ranks fit the namespace address plan")
        self.machines = machines
        self.bandwidth = bandwidth
        self.tag = tag
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.namespaces = [f"{tag}-{i}" for i in range(len(machines))]
        self.core = f"{tag}-c"
        self.cluster_name = ""
        self._made: list[str] = []

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def setup(self) -> NetnsWan:
        """Create everything; on any failure, remove what was made and raise NetnsError."""
        try:
            for ns in [self.core, *self.namespaces]:
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
            _run(["ip", "-n", self.core, "link", "add", "gmbr", "type", "bridge"])
            _run(["ip", "-n", self.core, "link", "set", "gmbr", "up"])
            for i, ns in enumerate(self.namespaces):
                peer = f"gmv{i}"
                _run(
                    ["ip", "link", "add", peer, "netns", self.core, "type", "veth", "peer", "name", IFNAME, "netns", ns]
                )
                _run(["ip", "-n", self.core, "link", "set", peer, "master", "gmbr"])
                _run(["ip", "-n", self.core, "link", "set", peer, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME])
                _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                self._shape(i, ns)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, i: int, ns: str) -> None:
        tc = ["tc", "-n", ns]

        def htb_class(classid: str) -> None:  # a classifier slot only: 10 Gbit/s never limits here
            _run([*tc, "class", "add", "dev", IFNAME, "parent", "1:", "classid", classid, *_HTB_SLOT])

        _run([*tc, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1"])
        htb_class("1:1")  # everything not addressed to a peer (ARP...), unshaped
        for j, bw in enumerate(self.bandwidth[i]):
            if j == i or bw is None:
                continue
            cls = f"1:{10 + j}"
            rate_bit = max(8000, int(bw * 8))
            burst = max(16 << 10, int(bw * 0.01))
            htb_class(cls)
            _run([*tc, "qdisc", "add", "dev", IFNAME, "parent", cls, "handle", f"{100 + j}:", "tbf",
                  "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "2s"])  # fmt: skip
            _run([*tc, "filter", "add", "dev", IFNAME, "parent", "1:", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", "dst", f"{self.address(j)}/32", "flowid", cls])  # fmt: skip

    def enter(self, rank: int) -> None:
        """Move the calling (single-threaded, freshly forked) process into rank's namespace and point
        gloo at its shaped interface."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.namespaces[rank]}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise NetnsError(f"rank {rank}: setns into {self.namespaces[rank]} failed: {os.strerror(err)}")
        finally:
            os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = IFNAME

    def tbf_bytes(self, rank: int) -> dict[int, int]:
        """Bytes each peer's tbf qdisc on ``rank``'s interface has sent (from ``tc -s``): peer -> bytes."""
        r = subprocess.run(
            ["tc", "-s", "-n", self.namespaces[rank], "qdisc", "show", "dev", IFNAME],
            capture_output=True,
            text=True,
            timeout=30,
        )
        out: dict[int, int] = {}
        peer = None
        for line in r.stdout.splitlines():
            words = line.split()
            if line.startswith("qdisc tbf") and len(words) > 2:
                peer = int(words[2].rstrip(":")) - 100
            elif peer is not None and words[:1] == ["Sent"]:
                out[peer] = int(words[1])
                peer = None
        return out

    def describe(self) -> dict:
        links = []
        for i, a in enumerate(self.machines):
            for j, b in enumerate(self.machines):
                bw = self.bandwidth[i][j]
                if i != j and bw is not None:
                    links.append({"from": a, "to": b, "bandwidth_bytes_per_s": bw})
        return {
            "emulated": True,
            "mode": "netns-tbf",
            "bandwidth": "real: tbf qdisc per peer on veths between network namespaces (one per rank)",
            "latency": "emulated in-process (netem unavailable): ring steps x route latency",
            "cluster": self.cluster_name,
            "links": links,
        }

    def close(self) -> None:
        """Delete the namespaces (their veths, qdiscs and the bridge go with them)."""
        for ns in reversed(self._made):
            try:
                _run(["ip", "netns", "del", ns])
            except NetnsError as e:
                log.warning("could not delete namespace %s: %s", ns, e)
        self._made = []

    def __enter__(self) -> NetnsWan:
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.close()
