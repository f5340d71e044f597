"""Named scoring variants: what ranks the residual units, and the settings a variant may choose from.

A :class:`Scoring` is one complete recipe: the criterion that scores each residual unit, the two
routing weightings, and the per-expert minimum of the layer-wide selection. A variant is a name with
one or more candidate scorings; a variant with several candidates has its setting chosen on a
development split (the bench does this), never on the text it is reported on.

``reference`` is PARSER as published: the unit output importance E||h_f,j d_f,j - h_b,j d_b,j||^2
per expert, routing weights off, pooled layer-wide, at least 4 units per expert. ``output_wanda``
is the activation-aware residual score: the geometric mean of the output importance and Wanda's
|residual| * ||input|| of the unit's gate row, up row and down column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .base import Decomposition
from .baselines import BASELINES, entry_scores, unit_scores
from .calibrate import LayerCalibration
from .importance import element_scores_from_units, layer_output_importance

CRITERIA = ("output", "output_wanda", *BASELINES)
_DATA_FREE = ("magnitude",)


@dataclass(frozen=True)
class Scoring:
    """How residual units are scored and selected.

    ``route_weight``: weight each routed input by its routing weight squared (the layer output sees
    the expert's output scaled by it). ``routed_share``: multiply an expert's scores by the share of
    tokens routed to it, so a layer-wide top-k compares contributions to the layer's total error.
    """

    criterion: str = "output"
    route_weight: bool = False
    routed_share: bool = False
    min_per_expert: int = 4

    def __post_init__(self):
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        if self.criterion in _DATA_FREE and (self.route_weight or self.routed_share):
            raise ValueError(f"criterion {self.criterion!r} uses no data; route_weight/routed_share must be off")
        if int(self.min_per_expert) < 0:
            raise ValueError(f"min_per_expert must be >= 0, got {self.min_per_expert!r}")

    def label(self) -> str:
        """A short name of the setting, e.g. ``output+route+share/min4``."""
        flags = "".join(f for f, on in (("+route", self.route_weight), ("+share", self.routed_share)) if on)
        return f"{self.criterion}{flags}/min{self.min_per_expert}"

    def as_dict(self) -> dict:
        return asdict(self)


REFERENCE = Scoring("output")
_ROUTINGS = ((True, True), (True, False), (False, True))

# name -> candidate settings; the first candidate is the default when no development split chooses
VARIANTS: dict[str, tuple[Scoring, ...]] = {
    "reference": (REFERENCE,),
    "magnitude": (Scoring("magnitude"),),
    "reconstruction": (Scoring("reconstruction"),),
    "wanda": (Scoring("wanda"),),
    "parser": tuple(Scoring("output", rw, rs) for rw, rs in _ROUTINGS),
    "wanda_routed": tuple(Scoring("wanda", rw, rs) for rw, rs in _ROUTINGS),
    "output_wanda": (Scoring("output_wanda"), *(Scoring("output_wanda", rw, rs) for rw, rs in _ROUTINGS)),
}


def resolve(method: str | Scoring) -> Scoring:
    """A Scoring from a variant name (its default candidate) or a Scoring itself."""
    if isinstance(method, Scoring):
        return method
    if method not in VARIANTS:
        raise ValueError(f"method must be one of {tuple(VARIANTS)} or a Scoring, got {method!r}")
    return VARIANTS[method][0]


def _share(calib: LayerCalibration) -> torch.Tensor:
    total = max(sum(calib.routed), 1)
    return torch.tensor([n / total for n in calib.routed], dtype=torch.float32)


def score_units(s: Scoring, dec: Decomposition, calib: LayerCalibration, act: Callable) -> torch.Tensor:
    """Unit scores [E, I] of one layer under scoring ``s`` (larger = keep first)."""
    if s.criterion == "output":
        return layer_output_importance(dec, calib, act, weighted=s.route_weight, by_frequency=s.routed_share)
    if s.criterion == "output_wanda":
        out = layer_output_importance(dec, calib, act, weighted=s.route_weight, by_frequency=False)
        wan = unit_scores("wanda", dec, calib, act, s.route_weight)
        scores = (out.clamp_min(0) * wan.clamp_min(0)).sqrt()
    else:
        scores = unit_scores(s.criterion, dec, calib, act, s.route_weight)
    return scores * _share(calib)[:, None] if s.routed_share else scores


def score_entries(
    s: Scoring, dec: Decomposition, calib: LayerCalibration, act: Callable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry scores (gate [E,I,H], up [E,I,H], down [E,H,I]) for unstructured selection."""
    if s.criterion in BASELINES:
        g, u, d = entry_scores(s.criterion, dec, calib, act, s.route_weight)
        if s.routed_share:
            w = _share(calib)[:, None, None]
            g, u, d = g * w, u * w, d * w
        return g, u, d
    return element_scores_from_units(score_units(s, dec, calib, act), dec, calib, act)
