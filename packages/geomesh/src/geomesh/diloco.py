"""The outer/inner loop (DiLoCo family) as a small wrapper around a user's own training loop.

    outer = DiLoCo(model, inner_opt, inner_steps=H_i, compression="sign")
    for batch in data:                       # the user's loop, inner optimizer of their choice
        loss(model, batch).backward(); inner_opt.step(); inner_opt.zero_grad()
        outer.step(tokens=batch.numel())     # every H_i local steps: one synchronous outer step

At an outer step each worker forms its pseudo-gradient (weights at the last sync - current weights),
exchanges it (sign-compressed bytes via all_gather, or a dense fp32/fp16 all_reduce for the
baselines), averages them weighted by token counts, and applies the same Nesterov SGD step to the
same last-synced weights on every worker, so all workers leave the outer step with identical weights.
A ``Rebalancer`` (optional) re-plans b_i and H_i from the measured throughputs exchanged at each sync.
A ``Quorum`` (optional) drops workers that die or stall and admits new ones at outer-step boundaries;
``overlap=True`` applies each outer step one phase late, its exchange running behind the next phase.
Each inner step and each exchange of an outer step first calls ``hwtopo.sync_point()``: under emulated
slow compute (``hwtopo.dilate``) the dilation is paid there, outside the waits; without one it does
nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import hwtopo

from .balance import PhaseClock, Plan, Rebalancer, token_weights
from .quorum import Quorum
from .signcompress import SignCompressor
from .signreduce import SignReduceScatter
from .wan import WanEmulator, ring_wire_bytes

__all__ = [
    "DiLoCo",
    "SyncStats",
    "GeoMeshError",
    "COMPRESSIONS",
    "ALL_REDUCE_ALGOS",
    "SIGN_COLLECTIVES",
    "dense_all_reduce",
]

log = logging.getLogger(__name__)
COMPRESSIONS = ("sign", "fp32", "fp16")
# dense all-reduce algorithms: "ring" (gloo's, 2(n-1) hops, fewest bytes), "gather" (all_gather then a
# local sum, n-1 hops), "auto" (the faster of the two on the WanEmulator's links for this payload)
ALL_REDUCE_ALGOS = ("ring", "gather", "auto")
SIGN_COLLECTIVES = ("all_gather", "reduce_scatter")


class GeoMeshError(RuntimeError):
    """A distributed training failure with a clear cause (mismatched models, a dead or stalled rank)."""


@dataclass
class SyncStats:
    """What one outer step cost this worker."""

    outer_step: int
    tokens: int
    all_tokens: list[int]
    weights: list[float]
    compute_s: float
    wait_s: float  # blocked at the sync point waiting for slower workers (straggler idle)
    comm_s: float  # exchanging pseudo-gradients (incl. emulated WAN time)
    payload_bytes: int  # this worker's message
    wire_bytes: float  # what this worker sends on the wire under a ring collective
    rates: list[float] = field(default_factory=list)  # measured tokens/s of every worker
    sync_cpu_s: float = 0.0  # this worker's own CPU work in this outer step (codec, averaging, outer step)
    replanned: bool = False
    codec: dict = field(default_factory=dict)  # sign payload: SignCompressor.last_stats of this step
    collective: str = ""  # the algorithm the payload ran as (wan.COLLECTIVES), charged per hop alike
    collective_s: float = 0.0  # seconds in the payload's collective (emulated WAN time included)
    members: list[int] = field(default_factory=list)  # the quorum's worker ids in this outer step (if any)

    def to_dict(self) -> dict:
        return asdict(self)


def _shape_digest(params: Sequence[torch.Tensor]) -> torch.Tensor:
    h = hashlib.sha256(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()).digest()[:8]
    return torch.tensor([int.from_bytes(h, "little", signed=True)], dtype=torch.int64)


def _comm_device(group=None) -> torch.device:
    """Where collective buffers must live: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_meta(
    tokens: int,
    compute_s: float,
    world: int,
    group=None,
    sync_cpu_s: float = -1.0,
    post_s: float = -1.0,
    join: bool = False,
) -> tuple[list[int], list[float], float, list[float], list[float], bool]:
    """all_gather of (tokens, compute seconds, last sync's CPU seconds, last sync's seconds from the sync
    point to the next phase, whether this rank saw a worker asking to join): the sync point; its
    blocking time is straggler idle.

    Returns every worker's tokens, measured throughput (tokens/s), the seconds this rank waited,
    every worker's CPU seconds of its previous outer step, every worker's post-sync seconds of
    its previous outer step (-1 where not measured yet), and whether any rank saw a join request.
    """
    row = [float(tokens), compute_s, sync_cpu_s, post_s, float(join)]
    meta = torch.tensor(row, dtype=torch.float64, device=_comm_device(group))
    hwtopo.sync_point()
    t0 = time.perf_counter()
    if world > 1:
        got = [torch.zeros_like(meta) for _ in range(world)]
        dist.all_gather(got, meta, group=group)
    else:
        got = [meta]
    wait_s = time.perf_counter() - t0
    hwtopo.resume_point()
    got = [g.cpu() for g in got]
    rates = [float(g[0] / g[1]) if g[1] > 0 else 0.0 for g in got]
    joins = any(bool(g[4]) for g in got)
    return [int(g[0]) for g in got], rates, wait_s, [float(g[2]) for g in got], [float(g[3]) for g in got], joins


def reduce_kind(algo: str, nbytes: int, wan: WanEmulator | None) -> str:
    """The collective an all-reduce algorithm of ``ALL_REDUCE_ALGOS`` runs as for an ``nbytes`` payload."""
    if algo not in ALL_REDUCE_ALGOS:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_ALGOS}, not {algo!r}")
    if algo == "gather":
        return "all_reduce_gather"
    if algo == "auto" and wan is not None:
        return wan.best_all_reduce(nbytes)
    return "all_reduce"


def _dense_launch(flat: torch.Tensor, kind: str, world: int, group=None) -> tuple[Any, list[torch.Tensor]]:
    """Start the dense sum of ``flat`` (``kind`` as in :func:`dense_all_reduce`); its work handle and buffers."""
    if world > 1 and kind == "all_reduce_gather":
        parts = [torch.empty_like(flat) for _ in range(world)]
        return dist.all_gather(parts, flat, group=group, async_op=True), parts
    if world > 1:
        return dist.all_reduce(flat, group=group, async_op=True), [flat]
    return None, [flat]


def _dense_finish(work, parts: list[torch.Tensor], kind: str, t0: float, wan: WanEmulator | None) -> torch.Tensor:
    """Wait for :func:`_dense_launch`'s work, sum a gather, then wait out the emulated WAN time since ``t0``."""
    if work is not None:
        work.wait()
        hwtopo.resume_point()
    if wan is not None:  # the transfer's emulated time first: the sum after it is this worker's compute
        wan.wait(kind, parts[0].numel() * parts[0].element_size(), t0)
    flat = parts[0]
    if len(parts) > 1:  # summed in fp32 and in rank order, so every worker holds bit-identical weights
        flat = torch.stack([q.float() for q in parts]).sum(0).to(parts[0].dtype)
    return flat


def dense_all_reduce(
    flat: torch.Tensor, kind: str, world: int, group=None, wan: WanEmulator | None = None
) -> torch.Tensor:
    """Sum ``flat`` over all ranks with the algorithm ``kind`` really runs ("all_reduce": gloo's ring;
    "all_reduce_gather": all_gather then a local sum), then wait out its emulated WAN time."""
    hwtopo.sync_point()  # emulated compute before the collective is paid before its clock starts
    t0 = time.perf_counter()
    work, parts = _dense_launch(flat, kind, world, group)
    return _dense_finish(work, parts, kind, t0, wan)


@dataclass
class _Exchange:
    """One outer step's pseudo-gradient exchange, started (maybe still in flight) or done."""

    work: Any  # the collective's handle; None once done or when nothing runs
    t0: float  # when it started (the emulated WAN time counts from here)
    parts: list[torch.Tensor]  # the all_gather's outputs, or the dense sum's buffer
    own: list[torch.Tensor]  # this worker's pseudo-gradient
    payload: int
    wire: float
    agg: list[torch.Tensor] | None = None  # the token-weighted mean, when already known


def _check_args(compression, all_reduce, sign_collective, inner_steps, group, quorum, overlap) -> None:
    """DiLoCo's arguments, checked before any collective runs."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    reduce_kind(all_reduce, 0, None)
    if sign_collective not in SIGN_COLLECTIVES:
        raise ValueError(f"sign_collective must be one of {SIGN_COLLECTIVES}, not {sign_collective!r}")
    if not isinstance(inner_steps, int) or inner_steps < 1:
        raise ValueError(f"inner_steps must be a positive integer, not {inner_steps!r}")
    if quorum is not None and group is not None:
        raise ValueError("group must be None with a quorum: the quorum's members form the default process group")
    if overlap and (quorum is not None or (compression == "sign" and sign_collective == "reduce_scatter")):
        raise ValueError(
            "overlap=True runs with the all_gather sign exchange or a dense all-reduce, without a quorum "
            "(an exchange in flight does not survive a change of members)"
        )


class DiLoCo:
    """Outer/inner loop state of one worker; call ``step(tokens)`` after every inner optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        inner_steps: int,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compression: str = "sign",
        chunk_size: int | None = 4096,
        scale: str = "mean",
        error_feedback: bool = True,
        ef_decay: float = 1.0,
        rotate: bool = False,
        rotate_seed: int = 0,
        batch_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        wan: WanEmulator | None = None,
        rebalancer: Rebalancer | None = None,
        worker_name: str | None = None,
        phase_clock: PhaseClock | None = None,
        all_reduce: str = "ring",
        sign_collective: str = "all_gather",
        quorum: Quorum | None = None,
        overlap: bool = False,
    ):
        _check_args(compression, all_reduce, sign_collective, inner_steps, group, quorum, overlap)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.inner_steps = inner_steps
        self.batch_size = batch_size
        self.compression = compression
        self.group = group
        self.wan = wan
        self.rebalancer = rebalancer
        # time-boxed phases: the clock decides, step by step, whether (and at which batch) another
        # inner step fits before the common deadline; ``inner_steps`` is then not used
        self.phase_clock = phase_clock
        # a lost worker (dead or stalled past the group's timeout) is dropped at the next sync and the
        # others go on, and a new one joins at an outer-step boundary; without a quorum a failure is raised
        self.quorum = quorum
        # one-step-delayed outer step: a sync's exchange runs during the next inner phase, whose sync
        # applies it; the local weights keep their own progress meanwhile (``flush`` at the end)
        self.overlap = overlap
        self._inflight: _Exchange | None = None
        self._wan_all = wan  # every launch rank's machine: a quorum's members (launch ranks) pick theirs
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.worker_name = worker_name or f"rank{quorum.me if quorum is not None else self.rank}"
        self.synced = [torch.nn.Parameter(p.detach().clone().float(), requires_grad=False) for p in self.params]
        # (torch's Nesterov needs a momentum: without one the outer step is plain SGD)
        nesterov = outer_momentum > 0
        self.outer_optimizer = torch.optim.SGD(self.synced, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        shapes = [p.shape for p in self.params]
        self.compressor = (
            SignCompressor(shapes, chunk_size, error_feedback, scale, ef_decay, rotate=rotate, seed=rotate_seed)
            if compression == "sign"
            else None
        )
        self.reduce_kind = self._reduce_kind(all_reduce)
        # the sign payload: all-gathered whole, or reduced by shard (traffic flat in the worker count)
        self.sign_reduce = (
            SignReduceScatter(self.compressor, self.world, self.rank, group, wan)
            if self.compressor is not None and sign_collective == "reduce_scatter"
            else None
        )
        self.local_step = 0
        self.outer_step = 0
        self.tokens = 0
        self.history: list[SyncStats] = []
        self._phase_start = time.perf_counter()
        self._last_sync_cpu_s = -1.0
        self._last_post_s = -1.0
        self._step_start = self._phase_start
        self._collective_s = 0.0
        self._start()
        self._ref = [p.detach().float().clone() for p in self.params] if overlap else None

    # --- set-up ---------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start identical to the others: from rank 0's weights, or (joining) from the quorum's outer state."""
        if self.quorum is not None and self.quorum.joining:
            self.quorum.join()  # bounded by quorum.join_timeout_s
            self._rewire()
            self._share_outer_state()
        elif self.world > 1:
            hwtopo.sync_point()  # set-up's emulated compute is paid before the first collective
            self._check_same_model()
            self._broadcast_initial()
            hwtopo.resume_point()

    def _collective_name(self) -> str:
        if self.sign_reduce is not None:
            return "reduce_scatter+all_gather"
        return "all_gather" if self.compressor is not None else self.reduce_kind

    def _reduce_kind(self, algo: str) -> str:
        """The WanEmulator collective the dense payload runs as (the sign payload is always all_gather)."""
        elem = 4 if self.compression == "fp32" else 2
        return reduce_kind(algo, elem * sum(p.numel() for p in self.params), self.wan)

    def _check_same_model(self) -> None:
        mine = _shape_digest(self.params).to(_comm_device(self.group))
        got = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        bad = [r for r, g in enumerate(got) if not torch.equal(g, got[0])]
        if bad:
            raise GeoMeshError(
                f"model parameter shapes differ across workers: rank(s) {bad} do not match rank 0 "
                f"(this rank {self.rank} has {len(self.params)} tensors, {sum(p.numel() for p in self.params)} elements)"
            )

    def _broadcast_initial(self) -> None:
        """Start every worker from rank 0's weights, so outer steps begin identical."""
        with torch.no_grad():
            for s, p in zip(self.synced, self.params):
                dist.broadcast(s.data, src=0, group=self.group)
                p.data.copy_(s.data.to(p.dtype))

    # --- the loop -------------------------------------------------------------------------------
    def step(self, tokens: int) -> SyncStats | None:
        """Count one inner step of ``tokens`` tokens; run the outer step when H_i steps are done."""
        hwtopo.sync_point()  # emulated slow compute: the step's dilation is paid before it is timed
        self.local_step += 1
        self.tokens += int(tokens)
        if self.phase_clock is not None:
            now = time.perf_counter()
            self.phase_clock.observe_step(int(tokens), now - self._step_start)
            self._step_start = now
            nxt = self.phase_clock.next_batch(now)
            if nxt == 0:
                return self.sync()
            self.batch_size = nxt
            return None
        if self.local_step >= self.inner_steps:
            return self.sync()
        return None

    def start_phase(self, anchor: float | None = None) -> None:
        """Start a time-boxed phase now (its deadline ``phase_clock.cycle_s`` after ``anchor``, a
        perf_counter instant common to all workers, e.g. right after a collective)."""
        now = time.perf_counter()
        self._phase_start = self._step_start = now
        if self.phase_clock is not None:
            self.phase_clock.begin(now if anchor is None else anchor)
            self.batch_size = self.phase_clock.next_batch(now) or 1

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """Weights at the last sync minus current weights (the direction the outer step descends)."""
        return [s.detach() - p.detach().float() for s, p in zip(self.synced, self.params)]

    def _exchange_meta(self, compute_s: float) -> tuple[list[int], list[float], float, list[float], list[float], bool]:
        args = (self._last_sync_cpu_s, self._last_post_s)
        for _ in range(self.world + 1):  # each failure drops at least the worker it met, or gives up
            join = self.quorum is not None and self.quorum.join_pending()
            try:
                return exchange_meta(self.tokens, compute_s, self.world, self.group, *args, join=join)
            except RuntimeError:  # gloo: a peer closed its connections, or the group's timeout passed
                if self.quorum is None:
                    raise
                self.quorum.reform()
                self._rewire()
        raise GeoMeshError(f"worker {self.worker_name}: the sync point kept failing after {self.world + 1} quorums")

    def _rewire(self) -> None:
        """Take the quorum's members as they are now: their group's rank, links and sign exchange."""
        assert self.quorum is not None
        members = self.quorum.members
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self._wan_all is not None:
            w = self._wan_all
            if max(members) >= len(w.machines):
                raise GeoMeshError(f"worker id {max(members)} has no machine in the WanEmulator ({w.machines})")
            self.wan = WanEmulator(w.cluster, [w.machines[i] for i in members], latency_only=w.latency_only)
        self.rebalancer = None  # its plan shares the work among other workers; the phase clock re-times
        if self.sign_reduce is not None:
            comp = self.sign_reduce.compressor  # its error feedback carries over; the shards are re-cut
            self.sign_reduce = SignReduceScatter(comp, self.world, self.rank, self.group, self.wan)

    def _admit(self) -> None:
        """At an outer-step boundary: let the workers that asked join, and send them the outer state."""
        assert self.quorum is not None
        joined = self.quorum.admit()
        self._rewire()
        if not joined:
            return
        try:
            self._share_outer_state()
        except RuntimeError:  # a joiner vanished (or refused the state) while it was sent: go on without it
            self.quorum.reform()
            self._rewire()

    def _share_outer_state(self) -> None:
        """Broadcast the outer state (outer step, synced weights, outer momentum) from the quorum's
        ``source`` member to everyone, so a worker that joined starts from exactly the members' state."""
        assert self.quorum is not None
        src = self.quorum.members.index(self.quorum.source)
        dev = _comm_device()
        mom = [self.outer_optimizer.state.get(s, {}).get("momentum_buffer") for s in self.synced]
        digest = int(_shape_digest(self.params))
        head = torch.tensor([self.outer_step, int(all(m is not None for m in mom)), digest], device=dev)
        dist.broadcast(head, src=src)
        if int(head[2]) != digest:
            raise GeoMeshError(
                f"worker {self.worker_name}: model parameter shapes differ from the quorum's (worker {self.quorum.source})"
            )
        self.outer_step = int(head[0])
        tensors = list(self.synced)
        if bool(head[1]):
            for s in self.synced:
                self.outer_optimizer.state[s].setdefault("momentum_buffer", torch.zeros_like(s))
            tensors += [self.outer_optimizer.state[s]["momentum_buffer"] for s in self.synced]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(dev)
        dist.broadcast(flat, src=src)
        with torch.no_grad():
            off = 0
            for t in tensors:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()
            for s, p in zip(self.synced, self.params):
                p.data.copy_(s.data.to(p.dtype))

    def _launch(self, deltas: list[torch.Tensor], all_tokens: list[int]) -> _Exchange:
        """Start exchanging every worker's pseudo-gradient (the sharded sign exchange runs through)."""
        t0 = time.perf_counter()
        if self.sign_reduce is not None:
            agg = [a.to(d.device) for a, d in zip(self.sign_reduce.reduce(deltas, self.tokens), deltas)]
            self._collective_s += self.sign_reduce.collective_s
            payload, wire = self.sign_reduce.payload_bytes, self.sign_reduce.wire_bytes()
            return _Exchange(None, t0, [], deltas, payload, wire, agg=agg)
        if self.compressor is not None:  # compression == "sign"
            buf = self.compressor.compress(deltas, self.tokens)
            hwtopo.sync_point()
            t0 = time.perf_counter()
            bufs = [torch.empty_like(buf) for _ in range(self.world)] if self.world > 1 else [buf]
            work = dist.all_gather(bufs, buf, group=self.group, async_op=True) if self.world > 1 else None
            self._collective_s += time.perf_counter() - t0
            wire = ring_wire_bytes("all_gather", buf.numel(), self.world)
            return _Exchange(work, t0, bufs, deltas, buf.numel(), wire)
        dtype = torch.float32 if self.compression == "fp32" else torch.float16
        w = token_weights(all_tokens)[self.rank]
        flat = torch.cat([d.reshape(-1) for d in deltas]).mul_(w).to(dtype)
        hwtopo.sync_point()  # the pseudo-gradient's emulated compute is paid before the collective's clock
        t0 = time.perf_counter()
        work, parts = _dense_launch(flat, self.reduce_kind, self.world, self.group)
        self._collective_s += time.perf_counter() - t0
        nbytes = flat.numel() * flat.element_size()
        return _Exchange(work, t0, parts, deltas, nbytes, ring_wire_bytes(self.reduce_kind, nbytes, self.world))

    def _finish(self, ex: _Exchange) -> list[torch.Tensor]:
        """Wait for an exchange (and its emulated WAN time); the token-weighted mean pseudo-gradient."""
        if ex.agg is not None:
            return ex.agg
        t0 = time.perf_counter()
        deltas = ex.own
        if self.compressor is not None:
            if ex.work is not None:
                ex.work.wait()
                hwtopo.resume_point()
            if self.wan is not None:
                self.wan.wait("all_gather", ex.payload, ex.t0)
            self._collective_s += time.perf_counter() - t0
            weights = token_weights([self.compressor.codec.tokens_of(b) for b in ex.parts])
            # summed in rank order (identical on every worker), in the coded basis: one inverse rotation
            return [a.to(d.device) for a, d in zip(self.compressor.decode_mean(ex.parts, weights), deltas)]
        flat = _dense_finish(ex.work, ex.parts, self.reduce_kind, ex.t0, self.wan)
        self._collective_s += time.perf_counter() - t0
        flat = flat.float()
        agg, off = [], 0
        for d in deltas:
            agg.append(flat[off : off + d.numel()].view_as(d))
            off += d.numel()
        return agg

    def _outer_update(self, agg: list[torch.Tensor]) -> None:
        """The outer optimizer's step on the synced weights, with the mean pseudo-gradient as gradient."""
        with torch.no_grad():
            for s, g in zip(self.synced, agg):
                s.grad = g
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)

    def _exchange_and_step(self, all_tokens: list[int]) -> _Exchange:
        """The outer step: synchronous, or (``overlap``) the previous sync's exchange, finished now,
        while this sync's exchange runs during the next inner phase."""
        if not self.overlap:
            ex = self._launch(self.pseudo_gradient(), all_tokens)
            self._outer_update(self._finish(ex))
            with torch.no_grad():
                for s, p in zip(self.synced, self.params):
                    p.data.copy_(s.data.to(p.dtype))
            return ex
        assert self._ref is not None
        # progress since the last send: the local weights already hold it, the outer weights not yet
        ex = self._launch([r - p.detach().float() for r, p in zip(self._ref, self.params)], all_tokens)
        prev, self._inflight = self._inflight, ex
        if prev is not None:
            before = [s.detach().clone() for s in self.synced]
            self._outer_update(self._finish(prev))
            with torch.no_grad():  # swap this worker's own earlier step for the agreed outer step
                for p, s, b, own in zip(self.params, self.synced, before, prev.own):
                    p.data.add_((s.data - b + own).to(p.dtype))
        self._ref = [p.detach().float().clone() for p in self.params]
        return ex

    def flush(self) -> None:
        """``overlap``: wait for the exchange still in flight, take its outer step, and set the weights to
        the outer weights (identical on every worker). Call it right after a sync, e.g. before evaluating
        or saving; every worker must call it."""
        if self._inflight is None:
            return
        if self.local_step:
            raise ValueError(f"flush() right after a sync: {self.local_step} inner steps since would be lost")
        prev, self._inflight = self._inflight, None
        self._outer_update(self._finish(prev))
        with torch.no_grad():
            for s, p in zip(self.synced, self.params):
                p.data.copy_(s.data.to(p.dtype))
        self._ref = [p.detach().float().clone() for p in self.params]

    def sync(self) -> SyncStats:
        """One synchronous outer step (all workers must call it the same number of times)."""
        hwtopo.sync_point()
        compute_s = time.perf_counter() - self._phase_start
        all_tokens, rates, wait_s, overheads, posts, join = self._exchange_meta(compute_s)
        t0 = time.perf_counter()  # the sync point: the all_gather released every worker at about this instant
        self._collective_s = 0.0
        ex = self._exchange_and_step(all_tokens)
        payload, wire = ex.payload, ex.wire
        comm_s = time.perf_counter() - t0
        stats = SyncStats(
            outer_step=self.outer_step,
            tokens=self.tokens,
            all_tokens=all_tokens,
            weights=token_weights(all_tokens),
            compute_s=compute_s,
            wait_s=wait_s,
            comm_s=comm_s,
            payload_bytes=int(payload),
            wire_bytes=float(wire),
            rates=rates,
            codec=dict(self.compressor.last_stats) if self.compressor is not None else {},
            collective=self._collective_name(),
            collective_s=self._collective_s,
            members=list(self.quorum.members) if self.quorum is not None else [],
        )
        if self.rebalancer is not None:
            names = [p.name for p in self.rebalancer.plan.profiles]
            self.rebalancer.observe_all(
                {n: (t, t / r, o) for n, t, r, o in zip(names, all_tokens, rates, overheads) if r > 0}
            )
            new = self.rebalancer.maybe_replan()
            if new is not None:
                self.apply_plan(new)
                stats.replanned = True
        if self.phase_clock is not None:
            self.phase_clock.update(all_tokens, [t / r if r > 0 else 0.0 for t, r in zip(all_tokens, rates)], posts)
        self.history.append(stats)
        self.outer_step += 1
        self.local_step = 0
        self.tokens = 0
        if join:  # every member saw the same flag in the meta exchange: all admit at this boundary
            self._admit()
        hwtopo.sync_point()  # the outer step's own compute is paid within the sync, not the next phase
        self.start_phase(anchor=t0)
        # own CPU work of this outer step (not the collectives): the balancer keeps it in each cycle
        self._last_sync_cpu_s = max(0.0, self._phase_start - t0 - self._collective_s)
        self._last_post_s = self._phase_start - t0
        stats.sync_cpu_s = self._last_sync_cpu_s
        return stats

    def apply_plan(self, plan: Plan) -> None:
        """Take this worker's (b_i, H_i) from a plan (the same plan is computed on every worker)."""
        mine = plan.worker(self.worker_name)
        self.inner_steps = mine.inner_steps
        self.batch_size = mine.batch
        if self.phase_clock is not None:
            self.phase_clock.set_batch(mine.batch)
        log.info("worker %s: batch %d, inner steps %d", self.worker_name, mine.batch, mine.inner_steps)

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._inflight is not None:
            raise ValueError("an outer step's exchange is still in flight (overlap=True): call flush() first")
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "synced": [s.detach().clone() for s in self.synced],
            "compressor": self.compressor.state_dict() if self.compressor else None,
            "server_residual": self.sign_reduce.server_residual.clone() if self.sign_reduce else None,
            "local_step": self.local_step,
            "outer_step": self.outer_step,
            "tokens": self.tokens,
            "inner_steps": self.inner_steps,
            "batch_size": self.batch_size,
            "compression": self.compression,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("compression") != self.compression:
            raise ValueError(
                f"checkpoint was made with compression={state.get('compression')!r}, not {self.compression!r}"
            )
        self.model.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        with torch.no_grad():
            for s, v in zip(self.synced, state["synced"]):
                s.data.copy_(v)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        if self.compressor is not None and state["compressor"] is not None:
            self.compressor.load_state_dict(state["compressor"])
        if self.sign_reduce is not None and state.get("server_residual") is not None:
            self.sign_reduce.server_residual = state["server_residual"].clone()
        for k in ("local_step", "outer_step", "tokens", "inner_steps", "batch_size"):
            setattr(self, k, state[k])
        self._inflight = None
        self._ref = [p.detach().float().clone() for p in self.params] if self.overlap else None
        self._phase_start = time.perf_counter()

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        """Atomic checkpoint (a whole file or none, fsynced) of this worker's whole state.

        ``extra`` holds plain values only (numbers, strings, None, tensors and lists, tuples or dicts of
        them): :meth:`load` reads with ``weights_only=True``, which unpickles nothing else.
        """
        extra = extra or {}
        _check_plain(extra, "extra")
        with hwtopo.atomic_file(path, "wb") as f:
            torch.save({"diloco": self.state_dict(), "extra": extra}, f)

    def load(self, path: str | os.PathLike) -> dict:
        """Restore from ``save``; returns the ``extra`` dict stored with it.

        Loaded with ``weights_only=True``: a crafted file cannot run code when it is read.
        """
        path = os.fspath(path)
        try:
            blob = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"checkpoint {path} holds objects other than tensors and plain values, which geomesh does not "
                "unpickle (that could run code); load only checkpoints written by DiLoCo.save"
            ) from e
        if not isinstance(blob, dict) or "diloco" not in blob:
            raise ValueError(f"checkpoint {path} was not written by DiLoCo.save (it has no 'diloco' state)")
        self.load_state_dict(blob["diloco"])
        return blob.get("extra", {})


_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def _check_plain(obj, where: str) -> None:
    """Raise TypeError naming the first value under ``where`` that ``weights_only`` loading would refuse."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} must be a string or an integer")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(
            f"{where} is of type {type(obj).__name__}; checkpoints hold numbers, strings, None, tensors and "
            "lists, tuples or dicts of them"
        )


def default_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("GEOMESH_TIMEOUT_S", "120")))
