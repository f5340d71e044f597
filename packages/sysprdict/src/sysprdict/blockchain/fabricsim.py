"""A discrete-event model of Hyperledger Fabric's execute-order-validate pipeline (SIMULATED data).

Fabric cannot run on this machine; this model generates benchmark-shaped rows (the CSV schema) so
the predictors, cross-validation and recommender can be exercised end to end.  Every row it makes
has source "simulated", and every table or JSON built from it says so.  Real data comes from
Caliper reports (`caliper.py`).

The model, per transaction (submitted at a fixed rate `send_rate_tps` for `duration_s`, as
Caliper's fixed-rate controller does):

1. Execute (endorsement).  A write transaction is endorsed by E peers chosen round-robin
   (policy OR: 1 org; MAJORITY: floor(orgs/2)+1; AND: all orgs); a read-only query by one peer.
   Each peer is a FIFO multi-server queue with round(peer_cpus) workers (at least 1) whose speed is
   scaled by the CPU quota, reduced by the CPU share that block validation takes on the same peer,
   and slowed when `peer_mem_gb` is below the working set (paging).  Service times are lognormal.
   A proposal still queued when the client's deadline (endorsement timeout) expires is cancelled:
   it fails and takes no service, so an overloaded peer keeps serving at its capacity.
2. Order.  Endorsed transactions queue at the Raft leader (one FIFO server whose per-transaction
   cost grows with the number of orderers to replicate to and shrinks with `orderer_cpus`); blocks
   are cut at `block_size` transactions or `batch_timeout_s` after the block's first one, then take
   a consensus round (longer with more orderers) before delivery.
3. Validate.  Peers validate blocks in order: a per-block commit cost plus per-transaction
   signature checks (one per endorsement), spread over the peer's CPUs.  MVCC: each write reads and
   writes one key (a hot set takes most accesses); it is invalid if the key was committed after the
   transaction was endorsed, or written earlier in the same block.  A transaction not committed
   within the client timeout fails.

Caliper's metrics are then computed as Caliper does: throughput = successful transactions / (last
completion - first submission), success rate = successful / submitted, average latency over
successful transactions.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from .schema import ENDORSEMENT, config_id

__all__ = ["FabricConfig", "SimParams", "campaign_configs", "sample_configs", "simulate", "simulate_dataset"]


@dataclasses.dataclass(frozen=True)
class FabricConfig:
    peers: int = 4
    orderers: int = 3
    orgs: int = 2
    peer_cpus: float = 2.0
    peer_mem_gb: float = 2.0
    orderer_cpus: float = 1.0
    orderer_mem_gb: float = 1.0
    send_rate_tps: float = 200.0
    read_fraction: float = 0.2
    block_size: int = 50
    batch_timeout_s: float = 1.0
    endorsement: str = "MAJORITY"

    def __post_init__(self) -> None:
        if self.endorsement not in ENDORSEMENT:
            raise ValueError(f"endorsement: {self.endorsement!r} is not valid; use one of {ENDORSEMENT}")
        if self.orgs > self.peers:
            raise ValueError(f"orgs: {self.orgs} organizations need at least as many peers (peers={self.peers})")

    def endorsers(self) -> int:
        return {"OR": 1, "MAJORITY": self.orgs // 2 + 1, "AND": self.orgs}[self.endorsement]


@dataclasses.dataclass(frozen=True)
class SimParams:
    """CPU costs (core-milliseconds) and limits of the model; documented defaults."""

    endorse_ms: float = 4.0  # chaincode simulation + signing, per proposal
    query_ms: float = 1.5  # read-only query
    order_tx_ms: float = 0.6  # leader's per-transaction cost with one orderer
    raft_per_follower: float = 0.25  # extra leader cost per follower to replicate to
    consensus_ms: float = 8.0  # one Raft round with 3 orderers (scales with log2(orderers+1))
    block_commit_ms: float = 12.0  # per-block ledger commit (state DB + block store)
    vscc_ms: float = 0.35  # per endorsement signature check
    working_set_gb: float = 1.5  # peer memory below this pages; slowdown grows as it shrinks
    orderer_working_set_gb: float = 0.75
    endorse_timeout_s: float = 3.0
    tx_timeout_s: float = 15.0
    keys: int = 5000
    hot_keys: int = 50
    hot_fraction: float = 0.2
    sigma: float = 0.35  # lognormal shape of service times
    network_rtt_s: float = 0.004
    duration_s: float = 15.0


def _lognormal(rng, mean: np.ndarray | float, sigma: float, size=None):
    mu = np.log(mean) - sigma**2 / 2
    return rng.lognormal(mu, sigma, size)


def _mem_slowdown(mem_gb: float, working_set_gb: float) -> float:
    return 1.0 if mem_gb >= working_set_gb else 1.0 + 2.5 * (working_set_gb / mem_gb - 1.0)


def _validation_load(cfg: FabricConfig, p: SimParams) -> float:
    """Core-seconds per second that validating every block takes on each peer (all peers validate)."""
    write_rate = cfg.send_rate_tps * (1 - cfg.read_fraction)
    blocks_per_s = max(write_rate / cfg.block_size, 1.0 / cfg.batch_timeout_s)
    return (write_rate * cfg.endorsers() * p.vscc_ms + blocks_per_s * p.block_commit_ms) / 1000.0


def _chosen_peers(cfg: FabricConfig, rr: int, read: bool) -> list[int]:
    """Peers that serve the ``rr``-th proposal: one for a query, one per endorsing org for a write."""
    if read:
        return [rr % cfg.peers]
    peers_per_org = max(1, cfg.peers // cfg.orgs)
    orgs = [(rr + k) % cfg.orgs for k in range(cfg.endorsers())]
    return [min(cfg.peers - 1, o * peers_per_org + (rr // cfg.orgs) % peers_per_org) for o in orgs]


def _execute(cfg: FabricConfig, p: SimParams, rng, arrivals: np.ndarray, is_read: np.ndarray, val_load: float):
    """Phase 1, endorsement on per-peer FIFO multi-server queues; returns (done times, ok, busy per peer)."""
    n, e = len(arrivals), cfg.endorsers()
    # validation runs on the same peers, so it takes its CPU share from endorsement
    val_share = min(0.8, val_load / cfg.peer_cpus)
    workers = max(1, int(round(cfg.peer_cpus)))
    speed = cfg.peer_cpus / workers * (1 - val_share) / _mem_slowdown(cfg.peer_mem_gb, p.working_set_gb)
    free = [[0.0] * workers for _ in range(cfg.peers)]  # heaps of worker free times
    busy = np.zeros(cfg.peers)
    endorse_done = np.empty(n)
    endorse_ok = np.ones(n, bool)
    svc_w = _lognormal(rng, p.endorse_ms / 1000.0, p.sigma, (n, e)) / speed
    svc_r = _lognormal(rng, p.query_ms / 1000.0, p.sigma, n) / speed
    for i in range(n):
        t = arrivals[i] + p.network_rtt_s / 2
        done = t
        for k, pe in enumerate(_chosen_peers(cfg, i, is_read[i])):
            start = max(t, free[pe][0])
            if start - t > p.endorse_timeout_s:
                # the client's gRPC deadline expired while queued: the call is cancelled, no service
                endorse_ok[i] = False
                done = max(done, t + p.endorse_timeout_s)
                continue
            s = svc_r[i] if is_read[i] else svc_w[i, k]
            heapq.heapreplace(free[pe], start + s)
            busy[pe] += s * cfg.peer_cpus / workers
            done = max(done, start + s)
        endorse_done[i] = done + p.network_rtt_s / 2
    return endorse_done, endorse_ok, busy


def _order_cost(cfg: FabricConfig, p: SimParams) -> float:
    """The Raft leader's seconds per transaction: replication to followers over its CPU and memory."""
    cost = p.order_tx_ms / 1000.0 * (1 + p.raft_per_follower * (cfg.orderers - 1)) / cfg.orderer_cpus
    return cost * _mem_slowdown(cfg.orderer_mem_gb, p.orderer_working_set_gb)


def _cut_blocks(cfg: FabricConfig, writes: np.ndarray, ordered: np.ndarray) -> list[tuple[float, list[int]]]:
    """Phase 2's block cutter: (cut time, transactions), cut at ``block_size`` or the batch timeout."""
    blocks: list[tuple[float, list[int]]] = []
    cur: list[int] = []
    cur_start = 0.0
    for j, i in enumerate(writes):
        t = ordered[j]
        if cur and t > cur_start + cfg.batch_timeout_s:
            blocks.append((cur_start + cfg.batch_timeout_s, cur))
            cur = []
        if not cur:
            cur_start = t
        cur.append(i)
        if len(cur) >= cfg.block_size:
            blocks.append((t, cur))
            cur = []
    if cur:
        blocks.append((cur_start + cfg.batch_timeout_s, cur))
    return blocks


def _order(cfg: FabricConfig, rng, writes: np.ndarray, endorse_done: np.ndarray, ord_cost: float):
    """Phase 2, the Raft leader's FIFO in endorsement order, then block cutting; returns the blocks."""
    leader_free = 0.0
    ordered = np.empty(len(writes))
    for j, i in enumerate(writes):
        leader_free = max(leader_free, endorse_done[i]) + ord_cost * rng.lognormal(-0.02, 0.2)
        ordered[j] = leader_free
    return _cut_blocks(cfg, writes, ordered)


def _validate(cfg: FabricConfig, p: SimParams, rng, blocks, keys, endorse_done, complete, success) -> None:
    """Phase 3, consensus, validation and commit in block order with MVCC on keys; fills completion."""
    e = cfg.endorsers()
    consensus = p.consensus_ms / 1000.0 * math.log2(cfg.orderers + 1) / 2.0 / min(cfg.orderer_cpus, 1.0)
    last_commit: dict[int, float] = {}  # key -> when its last write committed
    val_free = 0.0
    val_par = max(1.0, min(cfg.peer_cpus, 4.0))
    for cut, txs in blocks:
        delivered = cut + consensus * rng.lognormal(-0.02, 0.2)
        cost = (p.block_commit_ms + len(txs) * e * p.vscc_ms / val_par) / 1000.0
        cost *= _mem_slowdown(cfg.peer_mem_gb, p.working_set_gb) / min(cfg.peer_cpus, 1.0)
        val_free = max(val_free, delivered) + cost * rng.lognormal(-0.02, 0.2)
        written = set()
        for i in txs:
            k = keys[i]
            valid = k not in written and last_commit.get(k, -1.0) <= endorse_done[i]
            complete[i] = val_free + p.network_rtt_s / 2
            if valid:
                written.add(k)
                success[i] = True
        for k in written:
            last_commit[k] = val_free


def simulate(cfg: FabricConfig, seed: int = 0, params: SimParams | None = None) -> dict:
    """One simulated Caliper round of `cfg`: metrics in the CSV schema's measured columns."""
    p = params or SimParams()
    rng = np.random.default_rng(seed)
    # Caliper's fixed-rate controller: one transaction every 1/send_rate seconds (small jitter)
    n = max(1, int(cfg.send_rate_tps * p.duration_s))
    gap = 1.0 / cfg.send_rate_tps
    arrivals = np.arange(n) * gap + rng.uniform(0.0, 0.1 * gap, n)
    is_read = rng.random(n) < cfg.read_fraction
    val_load = _validation_load(cfg, p)
    endorse_done, endorse_ok, busy = _execute(cfg, p, rng, arrivals, is_read, val_load)

    complete = np.full(n, np.inf)
    success = np.zeros(n, bool)
    rd = is_read & endorse_ok
    complete[rd] = endorse_done[rd]
    success[rd] = True

    writes = np.where(~is_read & endorse_ok)[0]
    writes = writes[np.argsort(endorse_done[writes], kind="stable")]
    ord_cost = _order_cost(cfg, p)
    blocks = _order(cfg, rng, writes, endorse_done, ord_cost)
    # each write reads and writes one key; a hot set takes most accesses
    hot = rng.random(n) < p.hot_fraction
    keys = np.where(hot, rng.integers(0, p.hot_keys, n), rng.integers(p.hot_keys, p.keys, n))
    _validate(cfg, p, rng, blocks, keys, endorse_done, complete, success)
    late = complete - arrivals > p.tx_timeout_s
    success &= ~late

    ok = np.where(success)[0]
    if len(ok):
        span = max(float(complete[ok].max() - arrivals.min()), 1e-9)
        tps = len(ok) / span
        lat = float(np.mean(complete[ok] - arrivals[ok]))
    else:
        tps, lat = 0.0, float(p.tx_timeout_s)
    horizon = max(p.duration_s, float(np.max(complete[np.isfinite(complete)], initial=p.duration_s)))
    return {
        "throughput_tps": tps,
        "avg_latency_s": lat,
        "success_rate": float(len(ok) / n),
        "peer_cpu_util": float(min(1.0, (busy.mean() + val_load * p.duration_s) / (cfg.peer_cpus * horizon))),
        "orderer_cpu_util": float(min(1.0, len(writes) * ord_cost / horizon)),
    }


def sample_configs(n: int, seed: int = 0) -> list[FabricConfig]:
    """`n` random scaling configurations over the ranges a BaaS offering exposes."""
    rng = np.random.default_rng(seed)
    out: list[FabricConfig] = []
    while len(out) < n:
        orgs = int(rng.choice([1, 2, 3, 4]))
        peers = int(orgs * rng.choice([1, 2, 3]))
        cfg = FabricConfig(
            peers=peers,
            orderers=int(rng.choice([1, 3, 5])),
            orgs=orgs,
            peer_cpus=float(rng.choice([0.5, 1.0, 2.0, 4.0])),
            peer_mem_gb=float(rng.choice([1.0, 2.0, 4.0])),
            orderer_cpus=float(rng.choice([0.5, 1.0, 2.0])),
            orderer_mem_gb=float(rng.choice([0.5, 1.0, 2.0])),
            send_rate_tps=float(rng.choice([50, 100, 200, 300, 400, 600])),
            read_fraction=float(rng.choice([0.0, 0.2, 0.5])),
            block_size=int(rng.choice([10, 50, 100])),
            batch_timeout_s=float(rng.choice([0.5, 1.0, 2.0])),
            endorsement=str(rng.choice(list(ENDORSEMENT))),
        )
        out.append(cfg)
    return out


def campaign_configs(n: int | None = None, seed: int = 0) -> list[FabricConfig]:
    """A scaling campaign as a BaaS operator runs it: a factorial over peers, orderers, CPU quota and
    memory per peer, and the offered load, at one workload (block size 50, timeout 1 s, MAJORITY of
    2 orgs, 20% reads) over the node sizes a BaaS offers (1-4 cores, 2-4 GB per peer); `n` draws a
    random subset of the 180 points."""
    grid = [
        FabricConfig(peers=p, orderers=o, orgs=2, peer_cpus=c, peer_mem_gb=m, send_rate_tps=float(r))
        for p in (2, 4, 6)
        for o in (1, 3)
        for c in (1.0, 2.0, 4.0)
        for m in (2.0, 4.0)
        for r in (100, 200, 300, 400, 500)
    ]
    if n is None or n >= len(grid):
        return grid
    idx = np.random.default_rng(seed).choice(len(grid), n, replace=False)
    return [grid[i] for i in sorted(idx)]


def simulate_dataset(
    n_configs: int | None = 60,
    repeats: int = 3,
    seed: int = 0,
    params: SimParams | None = None,
    design: str = "campaign",
) -> list[dict]:
    """Schema rows (source "simulated"): `repeats` runs of each of `n_configs` configurations (None: the
    whole campaign) drawn from the factorial campaign (`design="campaign"`) or sampled over every dimension (`"random"`)."""
    if design not in ("campaign", "random"):
        raise ValueError(f"design: {design!r} is not valid; use 'campaign' or 'random'")
    if design == "campaign":
        cfgs = campaign_configs(n_configs, seed)
    else:
        cfgs = sample_configs(n_configs or 60, seed)
    rows = []
    for c, cfg in enumerate(cfgs):
        base = dataclasses.asdict(cfg)
        for r in range(repeats):
            m = simulate(cfg, seed=seed * 100003 + c * 101 + r, params=params)
            row = {**base, **m, "run": r, "source": "simulated"}
            row["config_id"] = config_id(row)
            rows.append(row)
    return rows
