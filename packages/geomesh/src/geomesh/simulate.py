"""What one outer sync costs at 3 to 64 workers: bytes per worker and seconds, over a cluster spec's links.

Workers are placed round-robin on the spec's machines (worker k on machine k mod m), so a ring of
them crosses a WAN link at every hop. Each collective is charged by the same model as the bench's
``WanEmulator``: ``collective_hops`` x the slowest ring link's latency, plus the bytes one rank sends
(``ring_wire_bytes``) through that link's bandwidth. The wire adds headers, ACKs and framing to the
algorithm's bytes: ``WireOverhead`` (a fraction per byte, bytes per message), fitted on measured
runs by ``fit_overhead``; ``validate`` compares the model with measured runs it was not fitted on,
so the larger worlds rest on a model checked where it can be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import hwtopo

from .wan import WanEmulator, ring_wire_bytes

__all__ = [
    "SCHEMES",
    "SyncCost",
    "WireOverhead",
    "fit_overhead",
    "messages_per_sync",
    "sign_payload_bytes",
    "simulate",
    "validate",
    "scheme_of",
    "scaling",
]

WORKERS = (3, 8, 16, 32, 64)

# scheme -> (collective, payload kind): the dense baselines, GeoMesh's all_gather of sign payloads, and
# the sign reduce-scatter (each rank gathers one shard of every payload, averages it, re-codes it,
# all-gathers the coded shards): the bytes of a ring all-reduce of the sign payload, flat in n
SCHEMES = {
    "ring-fp32": ("all_reduce", "fp32"),
    "gather-fp32": ("all_reduce_gather", "fp32"),
    "ring-fp16": ("all_reduce", "fp16"),
    "gather-fp16": ("all_reduce_gather", "fp16"),
    "allgather-sign": ("all_gather", "sign"),
    "reduce-scatter-sign": ("all_reduce", "sign"),
}


def sign_payload_bytes(n_params: int, chunk_size: int = 1024, shards: int = 1) -> int:
    """Bytes of one sign payload: 1 bit per parameter, an fp32 scale per chunk, an int64 token count
    per shard (every shard is coded on its own)."""
    return 8 * shards + 4 * math.ceil(n_params / chunk_size) + math.ceil(n_params / 8)


@dataclass(frozen=True)
class WireOverhead:
    """What the wire adds to a collective's bytes: a fraction per byte (TCP/IP headers, ACKs) and bytes
    per message (headers, ACKs and gloo's framing of a small message); fitted by ``fit_overhead``."""

    per_byte: float = 0.0
    per_message: float = 0.0


def messages_per_sync(scheme: str, workers: int) -> int:
    """Messages one worker sends in one sync: the (tokens, time) meta all_gather and the collective's steps."""
    kind = SCHEMES[scheme][0]
    steps = 2 * (workers - 1) if kind == "all_reduce" else workers - 1
    return (workers - 1) + steps if workers > 1 else 0


@dataclass(frozen=True)
class SyncCost:
    scheme: str
    workers: int
    payload_bytes: int  # one worker's message before the collective
    traffic_bytes_per_worker: float  # what the collective's algorithm makes one worker send per sync
    wire_bytes_per_worker: float  # the same plus the wire's overhead (``WireOverhead``)
    time_s: float  # the link model's seconds for the collective

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _payload(scheme: str, n_params: int, chunk_size: int, workers: int) -> int:
    kind = SCHEMES[scheme][1]
    if kind == "fp32":
        return 4 * n_params
    if kind == "fp16":
        return 2 * n_params
    # the reduce-scatter codes every shard on its own: a token count per shard
    return sign_payload_bytes(n_params, chunk_size, shards=workers if scheme == "reduce-scatter-sign" else 1)


def simulate(
    cluster: hwtopo.Cluster | str,
    workers: int,
    n_params: int,
    scheme: str,
    chunk_size: int = 1024,
    overhead: WireOverhead | None = None,
) -> SyncCost:
    """The cost of one sync of ``scheme`` (``SCHEMES``) for ``workers`` workers of ``n_params`` parameters."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: {scheme!r} is not valid; choose from {list(SCHEMES)}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: {workers!r} must be a positive integer")
    if isinstance(cluster, str):
        cluster = hwtopo.load(cluster)
    kind = SCHEMES[scheme][0]
    payload = _payload(scheme, n_params, chunk_size, workers)
    names = cluster.names
    wan = WanEmulator(cluster, [names[k % len(names)] for k in range(workers)])
    traffic = ring_wire_bytes(kind, payload, workers)
    ov = overhead or WireOverhead()
    return SyncCost(
        scheme=scheme,
        workers=workers,
        payload_bytes=payload,
        traffic_bytes_per_worker=traffic,
        wire_bytes_per_worker=traffic * (1 + ov.per_byte) + ov.per_message * messages_per_sync(scheme, workers),
        time_s=wan.model_time_s(kind, payload),
    )


def fit_overhead(n_params: int, measured: dict[str, dict], chunk_size: int = 1024) -> WireOverhead:
    """Per-byte and per-message overhead, least squares over measured runs (``validate``'s ``measured``);
    with one run, per-message overhead only. Fit on one set of runs, check on another."""
    rows = []
    for scheme, m in measured.items():
        if m.get("wire_bytes") is None:
            continue
        n = int(m["workers"])
        traffic = ring_wire_bytes(SCHEMES[scheme][0], _payload(scheme, n_params, chunk_size, n), n)
        rows.append((traffic, messages_per_sync(scheme, n), float(m["wire_bytes"])))
    if not rows:
        return WireOverhead()
    if len(rows) == 1:
        t, k, w = rows[0]
        return WireOverhead(0.0, max(0.0, (w - t) / k))
    # solve min sum (t a + k h - (w - t))^2 over (a, h): the 2x2 normal equations
    stt = sum(t * t for t, _, _ in rows)
    skk = sum(k * k for _, k, _ in rows)
    stk = sum(t * k for t, k, _ in rows)
    sty = sum(t * (w - t) for t, _, w in rows)
    sky = sum(k * (w - t) for t, k, w in rows)
    det = stt * skk - stk * stk
    if abs(det) < 1e-9 * max(1.0, stt * skk):
        return WireOverhead(sty / stt if stt else 0.0, 0.0)
    return WireOverhead(max(0.0, (sty * skk - sky * stk) / det), max(0.0, (sky * stt - sty * stk) / det))


def validate(
    cluster: hwtopo.Cluster | str,
    n_params: int,
    measured: dict[str, dict],
    chunk_size: int = 1024,
    overhead: WireOverhead | None = None,
) -> dict:
    """The model against measured runs: ``measured`` maps a scheme to ``{"workers", "wire_bytes",
    "collective_s"}`` (per worker per sync, from link counters and the run's timing); returns per
    scheme the modelled and measured values and their relative errors (None where not measured)."""
    out = {}
    for scheme, m in measured.items():
        sim = simulate(cluster, int(m["workers"]), n_params, scheme, chunk_size, overhead)
        row: dict = {"model_wire_bytes": sim.wire_bytes_per_worker, "model_time_s": sim.time_s}
        for key, model in (("wire_bytes", sim.wire_bytes_per_worker), ("collective_s", sim.time_s)):
            got = m.get(key)
            row[f"measured_{key}"] = got
            row[f"{key}_rel_err"] = (got - model) / model if got is not None and model > 0 else None
        out[scheme] = row
    return out


def scheme_of(method: str, collective: str | None) -> str | None:
    """The ``SCHEMES`` entry a bench method ran as (from the collective it recorded), None if none fits."""
    if collective == "all_gather" and method.startswith("geomesh"):
        return "allgather-sign"
    if collective == "reduce_scatter+all_gather":
        return "reduce-scatter-sign"
    if method in ("diloco-fp32", "diloco-fp16"):
        algo = {"all_reduce": "ring", "all_reduce_gather": "gather"}.get(collective or "")
        return f"{algo}-{method.split('-')[1]}" if algo else None
    return None


def scaling(
    cluster: hwtopo.Cluster | str,
    n_params: int,
    chunk_size: int = 1024,
    workers=WORKERS,
    overhead: WireOverhead | None = None,
) -> dict:
    """Every scheme at every worker count: ``{scheme: [SyncCost dict per count]}`` and the sign schemes'
    traffic (the algorithm's bytes), wire bytes (with ``overhead``) and time against the fp32 ring."""
    table = {
        sc: [simulate(cluster, n, n_params, sc, chunk_size, overhead).to_dict() for n in workers] for sc in SCHEMES
    }
    ratios = {}
    for sc in ("allgather-sign", "reduce-scatter-sign"):
        for mine, ring in zip(table[sc], table["ring-fp32"]):
            n = mine["workers"]
            for what in ("traffic", "wire"):
                key = f"{what}_bytes_per_worker"
                ratios[f"{sc}_{what}_vs_ring_fp32@{n}"] = mine[key] / ring[key]
            ratios[f"{sc}_time_vs_ring_fp32@{n}"] = mine["time_s"] / ring["time_s"]
    return {"workers": list(workers), "schemes": table, "ratios": ratios}
