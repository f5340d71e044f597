"""Simulation mode: analytic step time of a strategy on an hwtopo cluster too large to run here.

Compute: 6 x params x tokens (+ attention scores) FLOPs split over dp x tp x pp ranks at ``mfu`` of
the accelerators' peak, stretched by the GPipe bubble (accum + pp - 1) / accum. Communication:
TP all-reduces of the activations (4 per layer per micro-batch, ring), PP point-to-point sends,
one DP gradient all-reduce (ring), each at the bandwidth of the links it crosses (ranks are placed
tp innermost, then pp, then dp; ranks on one machine use ``intra_bandwidth``). A prediction, never a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import hwtopo

from .space import ModelDims, Strategy, StrategyError, check_strategy

__all__ = ["SimulatedStep", "simulate_step", "PAPER_MODELS"]

# Public architecture sizes of the paper's models (layers, hidden, heads, kv heads, MLP, vocab).
PAPER_MODELS = {
    "gpt3-1.3b": ModelDims(24, 2048, 16, 16, 8192, 50257, 2048),
    "bert-large": ModelDims(24, 1024, 16, 16, 4096, 30522, 512),
    "llama-3.2-1b": ModelDims(16, 2048, 32, 8, 8192, 128256, 2048),
}


@dataclass(frozen=True)
class SimulatedStep:
    strategy: Strategy
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s

    @property
    def throughput(self) -> float:
        return self.strategy.global_batch / self.step_s


def _ranks(cluster: hwtopo.Cluster) -> list[tuple[str, float]]:
    """(machine name, peak FLOP/s) per rank: one per accelerator, else one per machine."""
    out = []
    for m in cluster.machines:
        if m.accelerators:
            out += [(m.name, a.peak_flops or 0.0) for a in m.accelerators]
        else:
            out.append((m.name, m.flops or 0.0))
    return out


def _bandwidth(cluster: hwtopo.Cluster, machines: list[str], intra: float) -> float:
    """Slowest bandwidth among a group of ranks' machines (intra-machine: ``intra``)."""
    names = sorted(set(machines))
    bw = intra
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            bw = min(bw, cluster.bottleneck_bandwidth_bytes_per_s(a, b))
    return bw


def _ring_allreduce_s(nbytes: float, n: int, bw: float, latency: float = 5e-6) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def simulate_step(
    s: Strategy,
    dims: ModelDims,
    cluster: hwtopo.Cluster,
    mfu: float = 0.4,
    bytes_per_value: int = 2,
    intra_bandwidth_bytes_per_s: float | None = None,
) -> SimulatedStep:
    """Predicted step time of ``s`` for a model of ``dims`` on ``cluster``. Bandwidth within a machine: the
    spec's ``accelerators[].interconnect`` unless given, else 450 GB/s (NVLink 4)."""
    ranks = _ranks(cluster)
    if intra_bandwidth_bytes_per_s is None:
        declared = [m.accelerator_interconnect_bytes_per_s for m in cluster.machines]
        known = [bw for bw in declared if bw is not None]
        intra_bandwidth_bytes_per_s = min(known) if known else 450e9
    check_strategy(s, dims, len(ranks))
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    peak = min(f for _, f in ranks)
    if peak <= 0:
        raise StrategyError(
            f"cluster {cluster.name!r} declares no peak FLOP/s (accelerators[].peak or machines[].compute)"
        )
    tokens = s.global_batch * dims.seq_len
    flops = 6 * dims.params * tokens + 12 * dims.layers * dims.seq_len * dims.hidden * tokens
    bubble = (s.accum + s.pp - 1) / s.accum
    compute = flops / s.world / (peak * mfu) * bubble
    machines = [m for m, _ in ranks]
    tp_bw = _bandwidth(cluster, machines[: s.tp], intra_bandwidth_bytes_per_s)
    act = s.micro_batch * dims.seq_len * dims.hidden * bytes_per_value
    layers_per_stage = -(-dims.layers // s.pp)
    tp_comm = 4 * layers_per_stage * s.accum * _ring_allreduce_s(act, s.tp, tp_bw)
    pp_bw = _bandwidth(cluster, machines[: s.tp * s.pp : s.tp], intra_bandwidth_bytes_per_s)
    pp_comm = 2 * (s.accum + s.pp - 2) * act / pp_bw if s.pp > 1 else 0.0
    dp_bw = _bandwidth(cluster, machines[:: s.tp * s.pp], intra_bandwidth_bytes_per_s)
    grads = dims.params / (s.tp * s.pp) * bytes_per_value
    dp_comm = _ring_allreduce_s(grads, s.dp, dp_bw)
    return SimulatedStep(s, compute, tp_comm, pp_comm, dp_comm)
