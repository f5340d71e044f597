"""Real WAN bandwidth on one machine: a network namespace per rank, shaped with the ``tbf`` qdisc.

Layout (needs root and iproute2's ``ip`` and ``tc``)::

    rank 0's ns ──veth── ┐
    rank 1's ns ──veth── ┤ bridge in a core ns
    rank 2's ns ──veth── ┘

Every rank's namespace has one interface ``gmeth0`` with its own address. Its egress is classified by
destination address (``htb`` + ``u32`` filter, used only to pick a class) into one ``tbf`` qdisc per
peer at the bandwidth of the cluster spec's route between the two machines, so each direction of
each pair of regions gets its own shaped link. A worker enters its namespace (``enter``) before
``init_process_group``; gloo then talks over the shaped veths for real. ``netem`` is not available
on every kernel (not here), so the links' latency is still added in-process by ``WanEmulator``
(``latency_only=True``); every description says which part is real and which is emulated.

The namespaces have no names (nothing under ``/var/run/netns``): each is held by a descriptor of the
process that built it and by the ranks inside it, so the kernel removes it, its veths and its qdiscs
as soon as those are gone, whether ``close()`` ran or the process was killed with -9.

``wan_mode(requested)`` decides between this and the in-process ``WanEmulator`` and says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import hwtopo

__all__ = ["NetnsWan", "NetnsError", "WAN_MODES", "WanDecision", "wan_mode", "netns_support", "netns_prerequisites"]

log = logging.getLogger(__name__)
WAN_MODES = ("auto", "netns", "inprocess")
IFNAME = "gmeth0"
_CLONE_NEWNET = 0x40000000
_HTB_SLOT = "htb rate 10gbit quantum 60000"


class NetnsError(RuntimeError):
    """The namespace path cannot be set up here; the message says why."""


def _setns(fd: int, what: str) -> None:
    """Move the calling thread into the network namespace behind ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise NetnsError(f"setns into {what} failed: {os.strerror(ctypes.get_errno())}")


_T = TypeVar("_T")


def _in_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a short-lived thread of its own: a namespace change there leaves this thread's alone,
    and processes it starts are born in the namespace it is in."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            box["error"] = e

    t = threading.Thread(target=run, name="geomesh-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # run() stored either this or the error


def _new_netns() -> int:
    """A new, unnamed network namespace: a descriptor that (with any process inside) keeps it alive."""

    def make() -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) != 0:
            raise NetnsError(f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
        return os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)

    return _in_thread(make)


def _run(args: Sequence[str], ns: int | None = None) -> str:
    """Run a command (in the namespace behind descriptor ``ns``, if given); its output, or NetnsError."""

    def run() -> subprocess.CompletedProcess:
        if ns is not None:
            _setns(ns, f"namespace descriptor {ns}")
        return subprocess.run(list(args), capture_output=True, text=True, timeout=30)

    r = _in_thread(run) if ns is not None else run()
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}")
    return r.stdout


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
        probe._init(["a", "b"], [[None, 1e6], [1e6, None]])
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
    """Namespaces, veths, bridge and tbf qdiscs for the ranks of ``machines``; ``close()`` removes all,
    and so does the death of this process and of the ranks inside them."""

    def __init__(self, cluster: hwtopo.Cluster | str, machines: Sequence[str]):
        if isinstance(cluster, str):
            cluster = hwtopo.load(cluster)
        known = set(cluster.names)
        for i, m in enumerate(machines):
            if m not in known:
                raise ValueError(f"machines[{i}]: {m!r} is not a machine of cluster {cluster.name!r}")
        bw = [[_route_bandwidth(cluster, a, b) for b in machines] for a in machines]
        self._init(list(machines), bw)
        self.cluster_name = cluster.name

    def _init(self, machines: list[str], bandwidth: list[list[float | None]]) -> None:
        if len(machines) > 200:
            raise ValueError("at most 200 ranks fit the namespace address plan")
        self.machines = machines
        self.bandwidth = bandwidth
        self.subnet = "10.213.0"  # behind a bridge of its own: no other NetnsWan shares the subnet
        self.cluster_name = ""
        self.owner = os.getpid()
        self._core: int | None = None
        self._ranks: list[int] = []

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def namespace(self, rank: int) -> str:
        """A path to ``rank``'s namespace, valid while this process holds it (for setns or ``ip ... netns``)."""
        return f"/proc/{self.owner}/fd/{self._ranks[rank]}"

    def setup(self) -> NetnsWan:
        """Create everything; on any failure, remove what was made and raise NetnsError."""
        try:
            self._core = _new_netns()
            for _ in self.machines:
                self._ranks.append(_new_netns())
            core = f"/proc/{self.owner}/fd/{self._core}"
            _run(["ip", "link", "add", "gmbr", "type", "bridge"], self._core)
            _run(["ip", "link", "set", "gmbr", "up"], self._core)
            for i, ns in enumerate(self._ranks):
                peer = f"gmv{i}"
                ends = f"{peer} netns {core} type veth peer name {IFNAME} netns {self.namespace(i)}"
                _run(["ip", "link", "add", *ends.split()])
                _run(["ip", "link", "set", peer, "master", "gmbr"], self._core)
                _run(["ip", "link", "set", peer, "up"], self._core)
                _run(["ip", "addr", "add", f"{self.address(i)}/24", "dev", IFNAME], ns)
                _run(["ip", "link", "set", IFNAME, "up"], ns)
                _run(["ip", "link", "set", "lo", "up"], ns)
                self._shape(i, ns)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, i: int, ns: int) -> None:
        dev = f"dev {IFNAME} parent"

        def tc(command: str) -> None:
            _run(["tc", *command.split()], ns)

        tc(f"qdisc add dev {IFNAME} root handle 1: htb default 1")
        # htb classes are classifier slots only: 10 Gbit/s never limits here; 1:1 takes everything not
        # addressed to a peer (ARP...), unshaped
        tc(f"class add {dev} 1: classid 1:1 {_HTB_SLOT}")
        for j, bw in enumerate(self.bandwidth[i]):
            if j == i or bw is None:
                continue
            cls = f"1:{10 + j}"
            rate_bit = max(8000, int(bw * 8))
            burst = max(16 << 10, int(bw * 0.01))
            tc(f"class add {dev} 1: classid {cls} {_HTB_SLOT}")
            tc(f"qdisc add {dev} {cls} handle {100 + j}: tbf rate {rate_bit}bit burst {burst} latency 2s")
            tc(f"filter add {dev} 1: protocol ip prio 1 u32 match ip dst {self.address(j)}/32 flowid {cls}")

    def enter(self, rank: int) -> None:
        """Move the calling process (a rank, from its main thread before it opens any socket) into
        rank's namespace and point gloo at its shaped interface."""
        fd = os.open(self.namespace(rank), os.O_RDONLY)
        try:
            _setns(fd, f"rank {rank}'s namespace")
        finally:
            os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = IFNAME

    def tbf_bytes(self, rank: int) -> dict[int, int]:
        """Bytes each peer's tbf qdisc on ``rank``'s interface has sent (from ``tc -s``): peer -> bytes."""
        stdout = _run(["tc", "-s", "qdisc", "show", "dev", IFNAME], self._ranks[rank])
        out: dict[int, int] = {}
        peer = None
        for line in stdout.splitlines():
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
        """Let go of the namespaces: the kernel removes each (veths, qdiscs, bridge) once no rank is inside."""
        for fd in [*self._ranks, *([] if self._core is None else [self._core])]:
            os.close(fd)
        self._ranks, self._core = [], None

    def __enter__(self) -> NetnsWan:
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.close()
