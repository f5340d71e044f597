"""The cheapest scaling configuration predicted to meet a throughput and success-rate target.

Candidates span the vertical (CPU and memory per node) and horizontal (peers, orderers) choices at
the user's workload.  Cost = cpu_cost x total cores + mem_cost x total GB + node_cost x nodes.  A
candidate qualifies when its predicted throughput and success rate meet the targets (with
`conservative=True`, when the lower ends of their prediction intervals do).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from .models import PerfModel
from .schema import ENDORSEMENT

__all__ = ["Costs", "Recommendation", "candidates", "recommend"]


@dataclasses.dataclass(frozen=True)
class Costs:
    cpu: float = 1.0  # per core
    mem_gb: float = 0.25  # per GB
    node: float = 0.5  # per node

    def of(self, c: dict) -> float:
        cores = c["peers"] * c["peer_cpus"] + c["orderers"] * c["orderer_cpus"]
        mem = c["peers"] * c["peer_mem_gb"] + c["orderers"] * c["orderer_mem_gb"]
        return self.cpu * cores + self.mem_gb * mem + self.node * (c["peers"] + c["orderers"])


@dataclasses.dataclass
class Recommendation:
    config: dict
    cost: float
    predicted: dict
    interval: dict
    candidates_considered: int
    candidates_meeting: int


DEFAULT_SPACE = {
    "peers": [2, 4, 6],
    "orderers": [1, 3, 5],
    "orgs": [2],
    "peer_cpus": [0.5, 1.0, 2.0, 4.0],
    "peer_mem_gb": [1.0, 2.0, 4.0],
    "orderer_cpus": [0.5, 1.0, 2.0],
    "orderer_mem_gb": [0.5, 1.0, 2.0],
}


def candidates(workload: dict, space: dict | None = None) -> list[dict]:
    """Scaling options (the product of `space`'s values; by default DEFAULT_SPACE) at a fixed
    workload (send rate, read fraction, block size, timeout, policy)."""
    sp = {**DEFAULT_SPACE, **(space or {})}
    keys = list(DEFAULT_SPACE)
    out = []
    for vals in itertools.product(*(sp[k] for k in keys)):
        c = dict(zip(keys, vals))
        if c["orgs"] <= c["peers"]:
            out.append({**c, **workload})
    return out


def recommend(
    model: PerfModel,
    workload: dict,
    target_tps: float,
    target_success: float,
    costs: Costs | None = None,
    space: dict | None = None,
    conservative: bool = False,
    q: float = 0.9,
) -> Recommendation | None:
    """The cheapest candidate meeting the targets, or None when none is predicted to.  Candidates
    span `space`, by default the scaling values the model was trained on (no extrapolation)."""
    if workload.get("endorsement", "OR") not in ENDORSEMENT:
        raise ValueError(f"endorsement: {workload.get('endorsement')!r} is not valid; use one of {ENDORSEMENT}")
    if not 0 <= target_success <= 1:
        raise ValueError(f"target_success: {target_success!r} must be within [0, 1]")
    costs = costs or Costs()
    cands = candidates(workload, space if space is not None else getattr(model, "space", None))
    pred = model.predict(cands)
    lo_t, hi_t = model.interval(cands, "throughput_tps", q)
    lo_s, hi_s = model.interval(cands, "success_rate", q)
    tps = lo_t if conservative else pred["throughput_tps"]
    suc = lo_s if conservative else pred["success_rate"]
    ok = np.where((tps >= target_tps) & (suc >= target_success))[0]
    if not len(ok):
        return None
    cost = np.array([costs.of(c) for c in cands])
    best = ok[np.argmin(cost[ok])]
    return Recommendation(
        config=cands[best],
        cost=float(cost[best]),
        predicted={t: float(v[best]) for t, v in pred.items()},
        interval={
            "throughput_tps": (float(lo_t[best]), float(hi_t[best])),
            "success_rate": (float(lo_s[best]), float(hi_s[best])),
            "level": q,
        },
        candidates_considered=len(cands),
        candidates_meeting=int(len(ok)),
    )
