"""The shared base of a layer's experts and the per-expert residuals.

``mean``: the plain average of the experts. ``aligned``: a permutation-aligned barycenter. Hidden units
of an expert can be permuted without changing its function, and independently trained experts store
similar units at different positions, so each expert is first permuted to match the current
barycenter (a linear assignment on the similarity of units, each unit being its gate row, up row and
down column), then the permuted experts are averaged; a few rounds of this shrink the residuals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.optimize import linear_sum_assignment

from .models import ExpertWeights

BASE_METHODS = ("mean", "aligned")


@dataclass
class Decomposition:
    """experts (possibly unit-permuted) = base + residual, per expert."""

    experts: ExpertWeights  # the (permuted) experts, [E, I, H] / [E, H, I]
    base_gate: torch.Tensor  # [I, H]
    base_up: torch.Tensor  # [I, H]
    base_down: torch.Tensor  # [H, I]
    perms: torch.Tensor  # [E, I] unit permutation applied to each original expert

    @property
    def res_gate(self) -> torch.Tensor:
        return self.experts.gate - self.base_gate

    @property
    def res_up(self) -> torch.Tensor:
        return self.experts.up - self.base_up

    @property
    def res_down(self) -> torch.Tensor:
        return self.experts.down - self.base_down

    def residual_norm(self) -> float:
        """Squared Frobenius norm of all residuals together."""
        return float(self.res_gate.pow(2).sum() + self.res_up.pow(2).sum() + self.res_down.pow(2).sum())


def _units(w: ExpertWeights, e: int) -> torch.Tensor:
    """Unit feature matrix [I, 3H] of expert e: gate row, up row, down column."""
    return torch.cat([w.gate[e], w.up[e], w.down[e].T], dim=1)


def mean_base(w: ExpertWeights) -> Decomposition:
    """Base = plain mean of the experts, no permutation."""
    ident = torch.arange(w.intermediate).repeat(w.num_experts, 1)
    return Decomposition(w, w.gate.mean(0), w.up.mean(0), w.down.mean(0), ident)


def aligned_barycenter(w: ExpertWeights, rounds: int = 5) -> Decomposition:
    """Permutation-aligned barycenter by block-coordinate descent on sum_e ||P_e W_e - B||^2.

    Starts from the identity (B = plain mean), then alternates: each expert's units are assigned to
    the barycenter's by a linear assignment (maximising similarity = minimising distance, since the
    norms do not depend on the permutation), and B becomes the mean of the permuted experts. Each step
    can only lower the objective, so the residuals are never larger than with the plain mean.
    """
    E, inter = w.num_experts, w.intermediate
    perms = torch.arange(inter).repeat(E, 1)
    aligned = w
    for _ in range(max(1, rounds)):
        ref = torch.cat([aligned.gate.mean(0), aligned.up.mean(0), aligned.down.mean(0).T], dim=1)
        new = torch.empty_like(perms)
        for e in range(E):
            sim = (_units(w, e) @ ref.T).double().numpy()  # [I_e, I_ref]
            rows, cols = linear_sum_assignment(sim, maximize=True)
            p = torch.empty(inter, dtype=torch.long)
            p[torch.as_tensor(cols)] = torch.as_tensor(rows)  # barycenter position c takes unit r of expert e
            new[e] = p
        if torch.equal(new, perms):
            break
        perms = new
        aligned = w.permuted(perms)
    return Decomposition(aligned, aligned.gate.mean(0), aligned.up.mean(0), aligned.down.mean(0), perms)


def decompose(w: ExpertWeights, method: str = "aligned", rounds: int = 5) -> Decomposition:
    """Split experts into base + residuals with ``method`` in BASE_METHODS."""
    if method == "mean":
        return mean_base(w)
    if method == "aligned":
        return aligned_barycenter(w, rounds=rounds)
    raise ValueError(f"base method must be one of {BASE_METHODS}, got {method!r}")
