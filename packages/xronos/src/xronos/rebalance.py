"""Online re-profiling and exact re-partitioning (beyond the paper).

While training, every rank knows how long its own computation took in each step (wall time minus
time inside collectives). :class:`Rebalancer` compares that with what the cost model predicted for
the rank's current shard, rescales the rank's cost model by the ratio (so a device slowed by another
program, or mis-profiled at start, is corrected), and when a new partition would cut the predicted
layer time by more than ``threshold`` it reshards: weights, LoRA adapters and AdamW moments are
gathered to full size and re-cut along the new shard boundaries, so training continues exactly as if
it had used the new partition from the start.

Resharding is not free (it rebuilds the model and gathers every tensor whose shard boundaries move, in
one collective: 0.05-0.2 s for the bench's tiny Llama on 2 emulated ranks), so :func:`reshard_decision`
reshards only when the predicted saving over the steps still to run (predicted step-time gain x steps left) exceeds the reshard's cost (measured on
every reshard, max over ranks), and returns to a partition it has just left only when the predicted
gain clearly exceeds the noise of the measurements (hysteresis).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hwtopo import sync_point

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _active,
    all_reduce,
    gather_uneven_many,
)
from .partition import ModelShape, Partition, RankCost, partition, segment_objective
from .shard import build_model, enable_lora, shard_model
from .train import make_optimizer
from .waits import segment_compute

__all__ = ["repartition", "reshard_decision", "Rebalancer"]

log = logging.getLogger(__name__)


_Sharded = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding


def _sharded(model) -> dict[str, _Sharded]:
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def _shard_dim(mod, pname: str) -> int | None:
    if mod is None:
        return None
    if isinstance(mod, VocabParallelEmbedding):
        return 0 if pname == "weight" else None
    if isinstance(mod, ColumnParallelLinear):
        return 0 if pname in ("weight", "bias", "lora_B") else None
    return 1 if pname in ("weight", "lora_A") else None


def repartition(trainer, new_part: Partition, force: bool = False) -> None:
    """Reshard ``trainer`` (a TPTrainer) to ``new_part`` in place, weights and optimiser state exactly.

    Only tensors whose shard boundaries move are gathered (all of them in one collective,
    :func:`xronos.layers.gather_uneven_many`) and re-cut; a module whose sizes stay (e.g. attention when only the MLP split
    changes) keeps its local shards, which are the same rows either way. ``force`` gathers and re-cuts
    every sharded tensor even where nothing moves: what a full reshard costs, for a caller measuring it.
    """
    group, rank, cfg = trainer.group, trainer.rank, trainer.cfg
    model = build_model(cfg.model_config(), cfg.seed, init=False)  # every parameter is overwritten below
    shard_model(model, new_part, rank, group, cfg.vocab_parallel)
    if cfg.lora_r:
        params = enable_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.seed)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    old_mods, new_mods = _sharded(trainer.model), _sharded(model)
    old_params = dict(trainer.model.named_parameters())
    # every tensor to carry over: (parameter name, state key or None for the weight itself, tensor)
    items: list[tuple[str, str | None, Any]] = []
    for name, p in old_params.items():
        items.append((name, None, p.data))
        items += [(name, k, v) for k, v in trainer.opt.state.get(p, {}).items()]
    moved: list[tuple[torch.Tensor, int, tuple[int, ...]]] = []  # (local shard, dim, old sizes) to gather
    recut: list[tuple[tuple[str, str | None], int, _Sharded]] = []  # per moved tensor: its key, dim, new module
    values: dict[tuple[str, str | None], Any] = {}  # in the order of items; moved ones are filled in below
    for name, key, t in items:
        mod_name, _, pname = name.rpartition(".")
        old, new = old_mods.get(mod_name), new_mods.get(mod_name)
        dim = _shard_dim(old, pname)  # None unless old is a sharded module
        if old is not None and dim is not None and torch.is_tensor(t) and t.shape == old_params[name].shape:
            assert new is not None  # the new model has the same modules, cut differently
            if force or tuple(old.sizes) != tuple(new.sizes):
                values[(name, key)] = None
                recut.append(((name, key), dim, new))
                moved.append((t, dim, tuple(old.sizes)))
                continue
        # replicated, a scalar (AdamW's step), or a shard whose rows stay on this rank
        values[(name, key)] = t.detach().clone() if torch.is_tensor(t) else t
    full = gather_uneven_many(moved, group)
    for (name_key, dim, new), whole in zip(recut, full):
        values[name_key] = whole.narrow(dim, sum(new.sizes[:rank]), new.sizes[rank]).clone()
    new_named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in new_named.items():
            p.copy_(values[(name, None)])
    opt = make_optimizer(params, cfg)
    opt.load_state_dict(trainer.opt.state_dict() | {"state": {}})  # same hyper-parameters and groups
    name_of = {id(p): n for n, p in new_named.items()}
    for p in params:
        name = name_of[id(p)]
        state = {k: v for (n, k), v in values.items() if n == name and k is not None}
        if state:
            opt.state[p] = state
    trainer.model, trainer.params, trainer.opt, trainer.part = model, params, opt, new_part
    sync_point()  # emulated: the rebuild's compute is paid inside the reshard, which callers time


def _scaled(c: RankCost, f_attn: float, f_mlp: float | None = None) -> RankCost:
    f_mlp = f_attn if f_mlp is None else f_mlp
    return dataclasses.replace(
        c,
        attn_per_unit_s=c.attn_per_unit_s * f_attn,
        mlp_per_unit_s=c.mlp_per_unit_s * f_mlp,
        attn_fixed_s=c.attn_fixed_s * f_attn,
        mlp_fixed_s=c.mlp_fixed_s * f_mlp,
    )


def reshard_decision(
    now_layer_s: float,
    cand_layer_s: float,
    num_layers: int,
    steps_left: int,
    reshard_cost_s: float,
    threshold: float = 0.01,
    returning: bool = False,
    noise: float = 0.0,
    hysteresis: float = 0.05,
) -> tuple[bool, str]:
    """Whether to reshard from a partition predicted at ``now_layer_s`` to one at ``cand_layer_s``.

    All inputs must be the same on every rank (the decision is taken by each rank on its own).
    Reshard only when (1) the relative gain ``1 - cand/now`` exceeds ``threshold``; (2) the predicted
    saving over the remaining steps, ``num_layers x (now - cand) x steps_left``, exceeds
    ``reshard_cost_s``; (3) when ``returning`` to a partition this run just left, the relative gain
    also exceeds ``max(hysteresis, 2 x noise)`` (``noise``: relative spread of the measured speed
    factors), so jitter cannot flip the partition back and forth. Returns (decision, reason).
    """
    if not (now_layer_s > 0 and cand_layer_s >= 0):
        return False, "no positive prediction"
    gain = 1 - cand_layer_s / now_layer_s
    if gain <= threshold:
        return False, f"gain {gain:.2%} <= threshold {threshold:.2%}"
    saving = num_layers * (now_layer_s - cand_layer_s) * max(0, steps_left)
    if saving <= reshard_cost_s:
        return False, f"saving {saving:.3f} s over {steps_left} steps <= reshard cost {reshard_cost_s:.3f} s"
    if returning:
        need = max(hysteresis, 2 * noise)
        if gain <= need:
            return False, f"returning to a partition just left: gain {gain:.2%} <= {need:.2%} (hysteresis/noise)"
    return True, f"gain {gain:.2%}, saving {saving:.3f} s > reshard cost {reshard_cost_s:.3f} s"


def _spread(values: list[float]) -> float:
    """Relative spread (max - min) / median of one rank's factors over the windows kept."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


class Rebalancer:
    """Watches per-rank compute time; re-partitions when the model of a rank's speed drifts.

    When a step's record carries its synchronisations (``syncs``), the compute a rank did before each
    attention all-reduce and before each MLP all-reduce is measured separately
    (:func:`xronos.waits.segment_compute`) and each segment's cost model is corrected by its own
    factor: the two segments meet at different synchronisation points, so each must balance on its
    own. Otherwise the rank's whole compute time rescales both segments alike.

    Each factor is measured against the *start-up* cost model (for the shard the rank held in that
    window) and is the median over the last ``windows`` windows: one noisy window cannot flip the
    partition back and forth (seen with a 4-step window: 12 <-> 11 heads every window), while a real
    drift (another program on a device) wins the median after ``windows // 2 + 1`` windows.

    Cost-aware (:func:`reshard_decision`): ``reshard_cost_s`` is the estimated cost of one reshard
    (replaced by the measured one, max over ranks, after every reshard); ``total_steps`` is the
    run's length (default: the trainer's ``cfg.steps``), so the saving is counted over the steps left.
    Returning to a partition left earlier needs a gain above ``hysteresis`` and twice the factors'
    relative spread over the kept windows. ``min_windows``: no reshard is decided before that many
    windows are kept (a median of fewer than 3 is a mean, which one transient window can swing).
    """

    def __init__(
        self,
        shape: ModelShape,
        costs: list[RankCost],
        every: int = 4,
        threshold: float = 0.1,
        group=None,
        windows: int = 3,
        reshard_cost_s: float = 0.0,
        total_steps: int | None = None,
        hysteresis: float = 0.05,
        calibration_margin: float | None = None,
        min_windows: int = 1,
    ):
        self.shape, self.every, self.threshold, self.group = shape, every, threshold, group
        # windows (the calibration's included) whose median a reshard decision needs: with fewer than 3
        # the median is a mean and one window's transient slowdown of a rank can move the partition
        self.min_windows = max(1, int(min_windows))
        # predicted gain the calibrating reshard needs to move (default: the hysteresis margin)
        self.calibration_margin = hysteresis if calibration_margin is None else float(calibration_margin)
        self.reshard_cost_s, self.total_steps, self.hysteresis = float(reshard_cost_s), total_steps, hysteresis
        self.left: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # partitions resharded away from
        self._last_reshard_s = 0.0
        self.base = list(costs)
        self.costs = list(costs)
        self.windows = max(1, int(windows))
        if int(min_windows) > self.windows:
            raise ValueError(
                f"min_windows ({min_windows}) must be <= windows ({self.windows}): only the last {self.windows} "
                "windows are kept, so no reshard could ever be decided"
            )
        self.window: list[tuple[float, float]] = []
        self.ratios: list[tuple[list[float], list[float]]] = []  # per window: per-rank (attn, mlp) vs base
        self.history: list[dict] = []

    def calibrate(self, trainer, correct: bool = False) -> float:
        """Measure one reshard's cost; collective. Sets ``reshard_cost_s`` to the slowest rank's time.

        Call after the first optimiser step(s), so the AdamW moments are gathered and re-cut as in a
        real reshard. Without ``correct`` (or with no step observed yet) the reshard goes to the current
        partition: exact, nothing changes. With ``correct`` the steps observed so far (:meth:`observe`)
        first correct the start-up cost model as :meth:`maybe_repartition` does and, when the corrected
        model predicts a layer time shorter by more than ``calibration_margin`` (default ``hysteresis``), the
        calibrating reshard goes to
        the partition it gives: the start-up profile times shard computations
        in isolation, the observed steps are the run itself (under the same emulation), and the reshard
        is paid for either way. Returns the slowest rank's reshard time.
        """
        part = trainer.part
        target = part
        if correct and self.window:
            m = self._measure(trainer)
            now, cand_s = m["current_layer_s"], m["candidate_layer_s"]
            gain = 1 - cand_s / now if now > 0 else 0.0
            # a few steps' factors carry the segments' jitter and the affine model extrapolates them to
            # other shard sizes: move only for a predicted gain above the hysteresis margin, not on noise
            margin = self.calibration_margin
            moved = m["key"] != (tuple(part.attn_units), tuple(part.mlp_units)) and gain > margin
            target = m["cand"] if moved else part
            event = {k: v for k, v in m.items() if k not in ("cand", "key")}
            event.update(
                calibration=True,
                decision=f"calibration: predicted gain {gain:.2%} > {margin:.0%}, start from the partition "
                "the observed steps give"
                if moved
                else f"calibration: keep the start-up partition (predicted gain {gain:.2%} <= {margin:.0%})",
                resharded=moved,
            )
            if moved:
                self.left = [*self.left, (tuple(part.attn_units), tuple(part.mlp_units))][-4:]
                event["partition"] = target.describe()
            self.history.append(event)
        sync_point()  # emulated: earlier compute is not charged to the reshard
        t0 = time.perf_counter()
        # a reshard to the same partition would move nothing and measure only the rebuild: gather every
        # sharded tensor then, so the cost later decisions weigh is a real reshard's
        repartition(trainer, target, force=target is part)
        world = len(self.costs)
        vec = torch.zeros(world, dtype=torch.float64)
        vec[dist.get_rank(self.group) if _active(self.group) else 0] = time.perf_counter() - t0
        all_reduce(vec, self.group)
        self.reshard_cost_s = float(vec.max())
        if self.history and self.history[-1].get("calibration"):
            self.history[-1]["reshard_s"] = self.reshard_cost_s
        return self.reshard_cost_s

    def observe(self, record: dict) -> None:
        seg = segment_compute(record, self.shape.num_layers) if "syncs" in record else None
        if seg is None:
            total = record["step_s"] - record["comm_s"]
            self.window.append((total, float("nan")))
        else:
            self.window.append((seg["attn"], seg["mlp"]))

    def _measure(self, trainer) -> dict:
        """Share the ranks' window medians (collective), refit the cost models, find the best partition."""
        world = len(self.costs)
        by_segment = not any(m != m for _, m in self.window)  # no NaN: segment times were measured
        local = [statistics.median(a for a, _ in self.window), statistics.median(m for _, m in self.window)]
        self.window.clear()
        vec = torch.zeros(3 * world, dtype=torch.float64)
        rank = dist.get_rank(self.group) if _active(self.group) else 0
        vec[2 * rank], vec[2 * rank + 1] = local[0], local[1] if by_segment else 0.0
        vec[2 * world + rank] = self._last_reshard_s  # the previous reshard's time on this rank
        all_reduce(vec, self.group)
        slowest_reshard_s = float(vec[2 * world :].max())  # includes this rank's own last reshard
        if slowest_reshard_s > 0:
            self.reshard_cost_s = slowest_reshard_s  # measured: the slowest rank's
            self._last_reshard_s = 0.0
        part = trainer.part
        L = self.shape.num_layers
        units = list(zip(self.base, part.attn_units, part.mlp_units))
        if by_segment:
            f_attn = [float(vec[2 * r]) / (L * c.attn_time(a)) for r, (c, a, _) in enumerate(units)]
            f_mlp = [float(vec[2 * r + 1]) / (L * c.mlp_time(m)) for r, (c, _, m) in enumerate(units)]
        else:
            f_attn = [float(vec[2 * r]) / (L * (c.attn_time(a) + c.mlp_time(m))) for r, (c, a, m) in enumerate(units)]
            f_mlp = f_attn
        self.ratios = [*self.ratios, (f_attn, f_mlp)][-self.windows :]
        f_attn = [statistics.median(w[0][r] for w in self.ratios) for r in range(world)]
        f_mlp = [statistics.median(w[1][r] for w in self.ratios) for r in range(world)]
        self.costs = [_scaled(c, fa, fm) for c, fa, fm in zip(self.base, f_attn, f_mlp)]
        cand = partition(self.shape, self.costs)
        total = self.total_steps if self.total_steps is not None else getattr(getattr(trainer, "cfg", None), "steps", 0)
        noise = max(
            [_spread([w[0][r] for w in self.ratios]) for r in range(world)]
            + ([_spread([w[1][r] for w in self.ratios]) for r in range(world)] if by_segment else [])
        )
        return {
            "step": trainer.step_idx,
            "measured_compute_s": [float(v) for v in vec[: 2 * world]],
            "by_segment": by_segment,
            "factors": f_attn if not by_segment else list(zip(f_attn, f_mlp)),
            "current_layer_s": segment_objective(self.costs, part.attn_units, part.mlp_units),
            "candidate_layer_s": cand.predicted_layer_s,
            "steps_left": max(0, int(total) - int(trainer.step_idx)),
            "reshard_cost_s": self.reshard_cost_s,
            "noise": noise,
            "cand": cand,
            "key": (tuple(cand.attn_units), tuple(cand.mlp_units)),
        }

    def maybe_repartition(self, trainer) -> Partition | None:
        """Every ``every`` steps: share the ranks' compute medians, refit, reshard if worth it."""
        if len(self.window) < self.every:
            return None
        part = trainer.part
        m = self._measure(trainer)
        rank = dist.get_rank(self.group) if _active(self.group) else 0
        L = self.shape.num_layers
        cand, key, now, steps_left, noise = m["cand"], m["key"], m["current_layer_s"], m["steps_left"], m["noise"]
        moves = key != (tuple(part.attn_units), tuple(part.mlp_units))
        if moves and len(self.ratios) < self.min_windows:
            ok, reason = (
                False,
                f"{len(self.ratios)} window(s) measured, a decision needs the median of {self.min_windows}",
            )
        else:
            ok, reason = (
                reshard_decision(
                    now,
                    cand.predicted_layer_s,
                    L,
                    steps_left,
                    self.reshard_cost_s,
                    self.threshold,
                    returning=key in self.left,
                    noise=noise,
                    hysteresis=self.hysteresis,
                )
                if moves
                else (False, "candidate is the current partition")
            )
        event = {k: v for k, v in m.items() if k not in ("cand", "key")}
        event.update(decision=reason, resharded=False)
        if ok:
            self.left = [*self.left, (tuple(part.attn_units), tuple(part.mlp_units))][-4:]
            sync_point()
            t0 = time.perf_counter()
            repartition(trainer, cand)
            self._last_reshard_s = time.perf_counter() - t0
            event.update(resharded=True, partition=cand.describe(), reshard_s=self._last_reshard_s)
            log.info(
                "rank %d: resharded to %s (predicted %.1f%% faster)",
                rank,
                cand.describe(),
                100 * (1 - cand.predicted_layer_s / now),
            )
        self.history.append(event)
        return cand if event["resharded"] else None
