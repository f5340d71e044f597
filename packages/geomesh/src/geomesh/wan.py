"""Emulated WAN for collectives on one machine: each rank sits in a cluster-spec machine's region.

Every collective runs for real over loopback (gloo), then each rank sleeps until the time the same
collective would take over the spec's links has passed: a ring algorithm whose steps are limited by
the slowest link of the ring (latency per step + bytes through a ``hwtopo.LinkShaper``). Wire-byte
counts follow the same ring algorithms. Everything here is labelled emulated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import hwtopo

__all__ = ["WanEmulator", "ring_wire_bytes"]


def ring_wire_bytes(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring collective: all_gather of nbytes per rank, or all_reduce of nbytes."""
    if world <= 1:
        return 0.0
    if kind == "all_gather":
        return float((world - 1) * nbytes)
    if kind == "all_reduce":
        return 2.0 * (world - 1) / world * nbytes
    raise ValueError(f"kind must be 'all_gather' or 'all_reduce', not {kind!r}")


class WanEmulator:
    """Per-collective delays from the links between the ranks' machines in a cluster spec."""

    def __init__(self, cluster: hwtopo.Cluster | str, machines: Sequence[str], latency_only: bool = False):
        """``latency_only``: the bandwidth is shaped for real elsewhere (``NetnsWan``'s tbf qdiscs);
        only the links' latency per ring step is added here."""
        self.latency_only = latency_only
        if isinstance(cluster, str):
            cluster = hwtopo.load(cluster)
        self.cluster = cluster
        self.machines = list(machines)
        if not self.machines:
            raise ValueError("machines: need one cluster machine name per rank")
        known = set(cluster.names)
        for i, m in enumerate(self.machines):
            if m not in known:
                raise ValueError(
                    f"machines[{i}]: {m!r} is not a machine of cluster {cluster.name!r}; choose from {sorted(known)}"
                )
        self.world = len(self.machines)
        self.shapers: list[hwtopo.LinkShaper | None] = []
        for i in range(self.world):
            a, b = self.machines[i], self.machines[(i + 1) % self.world]
            try:
                route = cluster.route(a, b) if a != b else []
            except LookupError:
                raise ValueError(f"cluster {cluster.name!r}: no link route between {a!r} and {b!r}") from None
            if not route:
                self.shapers.append(None)
            elif len(route) == 1:
                self.shapers.append(hwtopo.LinkShaper(route[0]))
            else:
                self.shapers.append(
                    hwtopo.LinkShaper(
                        bandwidth_bytes_per_s=min(lk.bandwidth_bytes_per_s for lk in route),
                        latency_s=sum(lk.latency_s for lk in route),
                    )
                )
        self.emulated_s = 0.0

    def _ring_time(self, steps: int, bytes_per_step: float) -> float:
        if self.world <= 1 or steps <= 0:
            return 0.0
        worst = 0.0
        for s in self.shapers:
            if s is None:
                continue
            if self.latency_only:
                t = steps * s.latency_s
            else:
                # the stream of all steps goes through the token bucket once; latency is paid per step
                t = s.delay_s(steps * bytes_per_step) + (steps - 1) * s.latency_s
            worst = max(worst, t)
        return worst

    def collective_time_s(self, kind: str, nbytes: int) -> float:
        """Emulated seconds for a ring all_gather (nbytes per rank) or all_reduce (nbytes total)."""
        n = self.world
        if kind == "all_gather":
            return self._ring_time(n - 1, nbytes)
        if kind == "all_reduce":
            return self._ring_time(2 * (n - 1), nbytes / n)
        raise ValueError(f"kind must be 'all_gather' or 'all_reduce', not {kind!r}")

    def wait(self, kind: str, nbytes: int, started: float) -> float:
        """Sleep until the emulated collective that began at ``started`` (perf_counter) would be done."""
        target = self.collective_time_s(kind, nbytes)
        left = target - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        self.emulated_s += target
        return target

    def describe(self) -> dict:
        links = []
        for i, s in enumerate(self.shapers):
            a, b = self.machines[i], self.machines[(i + 1) % self.world]
            links.append({"from": a, "to": b, **(s.describe() if s else {"emulated": True, "co_located": True})})
        return {
            "emulated": True,
            "mode": "inprocess-latency" if self.latency_only else "inprocess",
            "shaped_in_process": "latency only" if self.latency_only else "bandwidth and latency",
            "cluster": self.cluster.name,
            "algorithm": "ring",
            "ring": links,
        }
