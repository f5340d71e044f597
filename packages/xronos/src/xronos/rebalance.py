"""Online re-profiling and exact re-partitioning (beyond the paper).

While training, every rank knows how long its own computation took in each step (wall time minus
time inside collectives). :class:`Rebalancer` compares that with what the cost model predicted for
the rank's current shard, rescales the rank's cost model by the ratio (so a device slowed by another
program, or mis-profiled at start, is corrected), and when a new partition would cut the predicted
layer time by more than ``threshold`` it reshards: weights, LoRA adapters and AdamW moments are
gathered to full size and re-cut along the new shard boundaries, so training continues exactly as if
it had used the new partition from the start.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import torch
import torch.distributed as dist

from .layers import ColumnParallelLinear, RowParallelLinear, _active, all_reduce, gather_uneven
from .partition import ModelShape, Partition, RankCost, partition, segment_objective
from .shard import build_model, enable_lora, shard_model

__all__ = ["repartition", "Rebalancer"]

log = logging.getLogger(__name__)


def _sharded(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _shard_dim(mod, pname: str) -> int | None:
    if mod is None:
        return None
    if isinstance(mod, ColumnParallelLinear):
        return 0 if pname in ("weight", "bias", "lora_B") else None
    return 1 if pname in ("weight", "lora_A") else None


def repartition(trainer, new_part: Partition) -> None:
    """Reshard ``trainer`` (a TPTrainer) to ``new_part`` in place, weights and optimiser state exactly."""
    group, rank, cfg = trainer.group, trainer.rank, trainer.cfg
    old_mods = _sharded(trainer.model)
    full_p, full_s = {}, {}
    for name, p in trainer.model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        mod = old_mods.get(mod_name)
        dim = _shard_dim(mod, pname)

        def full(t, mod=mod, dim=dim, shape=p.shape):
            if dim is not None and t.shape == shape:
                return gather_uneven(t, mod.sizes, dim, group)
            return t.detach().clone()

        full_p[name] = full(p.data)
        full_s[name] = {k: full(v) if torch.is_tensor(v) else v for k, v in trainer.opt.state.get(p, {}).items()}
    model = build_model(cfg.model_config(), cfg.seed)
    shard_model(model, new_part, rank, group)
    if cfg.lora_r:
        params = enable_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.seed)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    new_mods = _sharded(model)
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod_name, _, pname = name.rpartition(".")
            mod = new_mods.get(mod_name)
            dim = _shard_dim(mod, pname)

            def local(t, mod=mod, dim=dim, full_shape=full_p[name].shape):
                if dim is None or not torch.is_tensor(t) or t.shape != full_shape:
                    return t
                return t.narrow(dim, sum(mod.sizes[:rank]), mod.sizes[rank]).clone()

            p.copy_(local(full_p[name]))
            names[id(p)] = (name, local)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    opt.load_state_dict(trainer.opt.state_dict() | {"state": {}})  # same hyper-parameters and groups
    for p in params:
        name, local = names[id(p)]
        if full_s[name]:
            opt.state[p] = {k: local(v) for k, v in full_s[name].items()}
    trainer.model, trainer.params, trainer.opt, trainer.part = model, params, opt, new_part


def _scaled(c: RankCost, f: float) -> RankCost:
    return dataclasses.replace(
        c,
        attn_per_unit_s=c.attn_per_unit_s * f,
        mlp_per_unit_s=c.mlp_per_unit_s * f,
        attn_fixed_s=c.attn_fixed_s * f,
        mlp_fixed_s=c.mlp_fixed_s * f,
    )


class Rebalancer:
    """Watches per-rank compute time; re-partitions when the model of a rank's speed drifts."""

    def __init__(self, shape: ModelShape, costs: list[RankCost], every: int = 4, threshold: float = 0.1, group=None):
        self.shape, self.costs, self.every, self.threshold, self.group = shape, list(costs), every, threshold, group
        self.window: list[float] = []
        self.history: list[dict] = []

    def observe(self, record: dict) -> None:
        self.window.append(record["step_s"] - record["comm_s"])

    def maybe_repartition(self, trainer) -> Partition | None:
        """Every ``every`` steps: share the ranks' compute medians, refit, reshard if worth it."""
        if len(self.window) < self.every:
            return None
        world = len(self.costs)
        local = statistics.median(self.window)
        self.window.clear()
        vec = torch.zeros(world, dtype=torch.float64)
        rank = dist.get_rank(self.group) if _active(self.group) else 0
        vec[rank] = local
        all_reduce(vec, self.group)
        part = trainer.part
        L = self.shape.num_layers
        pred = [L * (c.attn_time(a) + c.mlp_time(m)) for c, a, m in zip(self.costs, part.attn_units, part.mlp_units)]
        factors = [float(v) / p for v, p in zip(vec, pred)]
        self.costs = [_scaled(c, f) for c, f in zip(self.costs, factors)]
        cand = partition(self.shape, self.costs)
        now = segment_objective(self.costs, part.attn_units, part.mlp_units)
        event = {
            "step": trainer.step_idx,
            "measured_compute_s": [float(v) for v in vec],
            "factors": factors,
            "current_layer_s": now,
            "candidate_layer_s": cand.predicted_layer_s,
            "resharded": False,
        }
        if cand.predicted_layer_s < now * (1 - self.threshold) and (
            cand.attn_units != part.attn_units or cand.mlp_units != part.mlp_units
        ):
            repartition(trainer, cand)
            event.update(resharded=True, partition=cand.describe())
            log.info(
                "rank %d: resharded to %s (predicted %.1f%% faster)",
                rank,
                cand.describe(),
                100 * (1 - cand.predicted_layer_s / now),
            )
        self.history.append(event)
        return cand if event["resharded"] else None
