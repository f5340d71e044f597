"""Check the reference unit scores against the paper's formula, computed the slow, literal way.

For every expert e and hidden unit j the paper's score is E_x ||h_f,j(x) d_f,j - h_b,j(x) d_b,j||^2:
the squared change of the expert's output when unit j falls back to the base. Here that is computed
unit by unit and token by token from the layer's own weights (read again from the model, mapped
through the base's unit permutation), with none of the package's scoring code, and compared with the
scores the ``reference`` variant selects by.
"""

from __future__ import annotations

import torch
from torch import nn

from .pipeline import Plan, layer_scores
from .scoring import REFERENCE


def literal_unit_scores(
    x: torch.Tensor,
    full: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    base: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    act,
) -> torch.Tensor:
    """[I] mean over the rows of x [N, H] of ||h_f,j d_f,j - h_b,j d_b,j||^2, one unit at a time."""
    gate, up, down = (t.double() for t in full)
    bgate, bup, bdown = (t.double() for t in base)
    x = x.double()
    out = torch.empty(gate.shape[0], dtype=torch.float64)
    for j in range(gate.shape[0]):
        h_full = act(x @ gate[j]) * (x @ up[j])  # [N]
        h_base = act(x @ bgate[j]) * (x @ bup[j])
        change = h_full[:, None] * down[:, j][None, :] - h_base[:, None] * bdown[:, j][None, :]  # [N, H]
        out[j] = change.pow(2).sum(1).mean()
    return out


def reference_matches_formula(model: nn.Module, plan: Plan, rtol: float = 1e-3) -> dict:
    """Compare every reference unit score of every layer with :func:`literal_unit_scores`.

    Returns ``{"matches", "max_rel_error", "units", "layers"}``; the relative error is taken against
    the largest score of the expert, so units with almost no importance do not dominate it.
    """
    worst, units = 0.0, 0
    modules = dict(model.named_modules())
    for ly in plan.layers:
        dec, cal = plan.decomps[ly.name], plan.calib.layers[ly.name]
        ours = layer_scores(plan, ly, REFERENCE).double()
        raw = ly.weights() if modules.get(ly.name) is ly.module else None
        if raw is None:
            raise ValueError(f"layer {ly.name!r} of the plan is not a module of this model")
        base = (dec.base_gate, dec.base_up, dec.base_down)
        for e in range(ly.num_experts):
            p = dec.perms[e]
            full = (raw.gate[e][p], raw.up[e][p], raw.down[e][:, p])
            lit = literal_unit_scores(cal.inputs[e], full, base, ly.act_fn)
            scale = float(lit.abs().max()) or 1.0
            worst = max(worst, float((ours[e] - lit).abs().max()) / scale)
            units += lit.numel()
    return {"matches": worst <= rtol, "max_rel_error": worst, "units": units, "layers": len(plan.layers)}
