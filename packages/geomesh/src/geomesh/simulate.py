"""What one outer sync costs at 3 to 64 workers: bytes per worker and seconds, over a cluster spec's links.

Workers are placed round-robin on the spec's machines (worker k on machine k mod m), so a ring of
them crosses a WAN link at every hop. Each collective is charged by the same model as the bench's
``WanEmulator``: ``collective_hops`` x the slowest ring link's latency, plus the bytes one rank sends
(``ring_wire_bytes``) through that link's bandwidth. ``validate`` compares the model at the bench's
world size with what the bench measured (link counters, sync time), so the larger worlds rest on a
model checked where it can be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import hwtopo

from .wan import WanEmulator, ring_wire_bytes

__all__ = ["SCHEMES", "SyncCost", "sign_payload_bytes", "simulate", "validate", "scheme_of", "scaling"]

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
class SyncCost:
    scheme: str
    workers: int
    payload_bytes: int  # one worker's message before the collective
    wire_bytes_per_worker: float  # what one worker sends in one sync
    time_s: float  # the link model's seconds for the collective

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _payload(kind: str, n_params: int, chunk_size: int) -> int:
    if kind == "fp32":
        return 4 * n_params
    if kind == "fp16":
        return 2 * n_params
    return sign_payload_bytes(n_params, chunk_size)


def simulate(
    cluster: hwtopo.Cluster | str, workers: int, n_params: int, scheme: str, chunk_size: int = 1024
) -> SyncCost:
    """The cost of one sync of ``scheme`` (``SCHEMES``) for ``workers`` workers of ``n_params`` parameters."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: {scheme!r} is not valid; choose from {list(SCHEMES)}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: {workers!r} must be a positive integer")
    if isinstance(cluster, str):
        cluster = hwtopo.load(cluster)
    kind, payload_kind = SCHEMES[scheme]
    payload = _payload(payload_kind, n_params, chunk_size)
    if scheme == "reduce-scatter-sign":
        # every shard carries its own token count: n headers instead of one
        payload = sign_payload_bytes(n_params, chunk_size, shards=workers)
    names = cluster.names
    wan = WanEmulator(cluster, [names[k % len(names)] for k in range(workers)])
    return SyncCost(
        scheme=scheme,
        workers=workers,
        payload_bytes=payload,
        wire_bytes_per_worker=ring_wire_bytes(kind, payload, workers),
        time_s=wan.model_time_s(kind, payload),
    )


def validate(cluster: hwtopo.Cluster | str, n_params: int, measured: dict[str, dict], chunk_size: int = 1024) -> dict:
    """The model against measured runs: ``measured`` maps a scheme to ``{"workers", "wire_bytes",
    "collective_s"}`` (per worker per sync, from link counters and the run's timing); returns per
    scheme the modelled and measured values and their relative errors (None where not measured)."""
    out = {}
    for scheme, m in measured.items():
        sim = simulate(cluster, int(m["workers"]), n_params, scheme, chunk_size)
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


def scaling(cluster: hwtopo.Cluster | str, n_params: int, chunk_size: int = 1024, workers=WORKERS) -> dict:
    """Every scheme at every worker count: ``{scheme: [SyncCost dict per count]}`` and the sign schemes'
    traffic and time against the fp32 ring all-reduce at each count."""
    table = {sc: [simulate(cluster, n, n_params, sc, chunk_size).to_dict() for n in workers] for sc in SCHEMES}
    ratios = {}
    for sc in ("allgather-sign", "reduce-scatter-sign"):
        for mine, ring in zip(table[sc], table["ring-fp32"]):
            n = mine["workers"]
            ratios[f"{sc}_traffic_vs_ring_fp32@{n}"] = mine["wire_bytes_per_worker"] / ring["wire_bytes_per_worker"]
            ratios[f"{sc}_time_vs_ring_fp32@{n}"] = mine["time_s"] / ring["time_s"]
    return {"workers": list(workers), "schemes": table, "ratios": ratios}
