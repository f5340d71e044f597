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

__all__ = ["WanEmulator", "ring_wire_bytes", "collective_hops", "COLLECTIVES"]

# "all_reduce": ring reduce-scatter + all-gather (gloo's ring); "all_reduce_gather": every rank's whole
# payload all-gathered around the ring, then summed locally (half the hops, (n-1)/2 times the bytes);
# "reduce_scatter": nbytes per rank, one n-th of it kept by each rank (the first half of the ring)
COLLECTIVES = ("all_gather", "all_reduce", "all_reduce_gather", "reduce_scatter")


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {list(COLLECTIVES)}, not {kind!r}")


def collective_hops(kind: str, world: int) -> int:
    """Sequential ring steps of a collective: each one pays a link's latency once, whatever the method."""
    _check_kind(kind)
    if world <= 1:
        return 0
    return 2 * (world - 1) if kind == "all_reduce" else world - 1


def ring_wire_bytes(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring collective: all_gather of nbytes per rank, or all_reduce of nbytes."""
    _check_kind(kind)
    if world <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (world - 1) / world * nbytes
    if kind == "reduce_scatter":
        return (world - 1) / world * nbytes
    return float((world - 1) * nbytes)


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

    def _steps(self, kind: str, nbytes: int) -> tuple[int, float]:
        hops = collective_hops(kind, self.world)
        return hops, (nbytes / self.world if kind in ("all_reduce", "reduce_scatter") else nbytes)

    def collective_time_s(self, kind: str, nbytes: int) -> float:
        """Emulated seconds of a collective of ``COLLECTIVES`` (nbytes per rank): one latency per hop
        (``collective_hops``) for every algorithm alike, plus the bytes through the slowest ring link
        (reserved on its token bucket: back-to-back collectives queue)."""
        return self._ring_time(*self._steps(kind, nbytes))

    def model_time_s(self, kind: str, nbytes: int) -> float:
        """The link model's seconds for one collective on idle links (reserves nothing): hops x latency
        plus bytes / bandwidth on the slowest ring link, bandwidth counted even when ``latency_only``."""
        steps, per_step = self._steps(kind, nbytes)
        if self.world <= 1 or steps <= 0:
            return 0.0
        live = [s for s in self.shapers if s is not None]
        return max((steps * (s.latency_s + per_step / s.bandwidth_bytes_per_s) for s in live), default=0.0)

    def best_all_reduce(self, nbytes: int) -> str:
        """The all-reduce algorithm a user would pick on these links for ``nbytes``: the ring (fewest
        bytes) or the gather (fewest hops), whichever the link model says is faster."""
        ring = self.model_time_s("all_reduce", nbytes)
        gather = self.model_time_s("all_reduce_gather", nbytes)
        return "all_reduce_gather" if gather < ring else "all_reduce"

    def wait(self, kind: str, nbytes: int, started: float) -> float:
        """Sleep until the emulated collective that began at ``started`` (perf_counter) would be done.

        ``latency_only``: the bytes just crossed really shaped links, so the hops' latency comes on top of
        the time they took (a WAN transfer pays both), instead of hiding inside it."""
        target = self.collective_time_s(kind, nbytes)
        left = target if self.latency_only else target - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
            hwtopo.resume_point()  # waking up late is part of the wait, not of the next compute
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
