"""Glue: decompose every MoE layer once, score residuals with a method, install compressed experts.

Every method uses the same base, the same selection rule and the same budget, so at a given keep
ratio all methods hold exactly the same bytes (structured) or the same bytes to within one entry per
layer (unstructured); only the scores differ.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .base import Decomposition, decompose
from .calibrate import CalibrationData, CalibrationError
from .compressed import CompressedExperts, install
from .importance import check_keep_ratio, select_elements, select_units
from .models import MoELayer, find_moe_layers
from .scoring import VARIANTS, Scoring, resolve, score_entries, score_units

log = logging.getLogger(__name__)

# the named variants compress_model accepts (each also takes a Scoring directly)
METHODS = tuple(VARIANTS)


@dataclass
class Plan:
    """Per layer: the MoE layer found, its base/residual decomposition, its calibration samples."""

    layers: list[MoELayer]
    decomps: dict[str, Decomposition]
    calib: CalibrationData
    dtype: dict[str, torch.dtype] = field(default_factory=dict)
    device: dict[str, torch.device] = field(default_factory=dict)
    _scores: dict = field(default_factory=dict)

    def original_bytes(self) -> int:
        return sum(ly.original_bytes() for ly in self.layers)


def prepare(model: nn.Module, calib: CalibrationData, base: str = "aligned", rounds: int = 5) -> Plan:
    """Find the MoE layers of ``model`` and decompose each into a base and residuals."""
    layers = find_moe_layers(model)
    decomps, dtypes, devices = {}, {}, {}
    for ly in layers:
        if ly.name not in calib.layers:
            raise CalibrationError(f"calibration data has no samples for layer {ly.name!r}")
        decomps[ly.name] = decompose(ly.weights(), base, rounds)
        p = next(iter(ly.module.parameters()), None)
        dtypes[ly.name] = p.dtype if p is not None else torch.float32
        devices[ly.name] = p.device if p is not None else torch.device("cpu")
    return Plan(layers, decomps, calib, dtypes, devices)


def layer_scores(plan: Plan, ly: MoELayer, scoring: Scoring, structured: bool = True):
    """Unit scores [E, I] (structured) or per-entry scores of layer ``ly`` under ``scoring``, memoised
    on the plan (the per-expert minimum does not change scores, so it is not part of the key)."""
    key = (ly.name, scoring.criterion, scoring.route_weight, scoring.routed_share, structured)
    if key in plan._scores:
        return plan._scores[key]
    dec, cal = plan.decomps[ly.name], plan.calib.layers[ly.name]
    fn = score_units if structured else score_entries
    s = fn(scoring, dec, cal, ly.act_fn)
    plan._scores[key] = s
    return s


def entry_ratio_for(keep_ratio: float, hidden: int, value_bytes: int, index_bytes: int = 4) -> float:
    """Keep ratio over residual entries that spends the same bytes as ``keep_ratio`` of units.

    A unit costs 3H values + one index; an entry costs one value + one index.
    """
    unit_cost = 3 * hidden * value_bytes + index_bytes
    entry_cost = value_bytes + index_bytes
    return min(1.0, keep_ratio * unit_cost / (3 * hidden * entry_cost))


def compress_model(
    model: nn.Module,
    plan: Plan,
    method: str | Scoring = "parser",
    keep_ratio: float = 0.2,
    *,
    structured: bool = True,
    min_per_expert: int | None = None,
    inplace: bool = False,
) -> nn.Module:
    """Return ``model`` (a deep copy unless ``inplace``) with every MoE layer compressed by ``method``.

    ``method`` is a variant name of :data:`METHODS` (its default setting) or a :class:`Scoring`.
    ``keep_ratio`` is the fraction of residual units kept (structured) or of residual entries kept
    (unstructured; :func:`entry_ratio_for` converts a unit ratio into the entry ratio of equal bytes).
    ``min_per_expert`` overrides the scoring's minimum of kept units (entries) per expert.
    """
    keep_ratio = check_keep_ratio(keep_ratio)
    scoring = resolve(method)
    minimum = scoring.min_per_expert if min_per_expert is None else int(min_per_expert)
    target = model if inplace else copy.deepcopy(model)
    by_name = {ly.name: ly for ly in find_moe_layers(target)}
    for ly in plan.layers:
        dec = plan.decomps[ly.name]
        base = (dec.base_gate, dec.base_up, dec.base_down)
        experts = (dec.experts.gate, dec.experts.up, dec.experts.down)
        dtype = plan.dtype[ly.name]
        s = layer_scores(plan, ly, scoring, structured)
        if structured:
            mask = select_units(s, keep_ratio, minimum)
            storage = CompressedExperts.from_units(base, experts, mask, ly.act_fn, dtype)
        else:
            masks = select_elements(s, keep_ratio, minimum)
            storage = CompressedExperts.from_entries(base, experts, masks, ly.act_fn, dtype)
        install(target, by_name[ly.name], storage.to(plan.device.get(ly.name, "cpu")))
    return target


def base_only_model(model: nn.Module, plan: Plan) -> nn.Module:
    """A copy of ``model`` whose experts all equal the base (no residual kept): the floor of compression."""
    target = copy.deepcopy(model)
    by_name = {ly.name: ly for ly in find_moe_layers(target)}
    for ly in plan.layers:
        dec = plan.decomps[ly.name]
        base = (dec.base_gate, dec.base_up, dec.base_down)
        experts = (dec.experts.gate, dec.experts.up, dec.experts.down)
        mask = torch.zeros(ly.num_experts, ly.intermediate, dtype=torch.bool)
        storage = CompressedExperts.from_units(base, experts, mask, ly.act_fn, plan.dtype[ly.name])
        install(target, by_name[ly.name], storage.to(plan.device.get(ly.name, "cpu")))
    return target
