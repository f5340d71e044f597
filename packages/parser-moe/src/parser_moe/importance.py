"""Output importance of residual units: the core of PARSER.

An expert computes y = sum_j h_j d_j with h = act(G x) * (U x) and d_j column j of the down
projection. With a shared base (G_b, U_b, D_b) and the expert's full weights (G_f, U_f, D_f), falling
back to the base for hidden unit j (dropping its gate row, up row and down column residuals together)
changes the expert output by exactly h_f,j d_f,j - h_b,j d_b,j. The importance of unit j is the
expected squared norm of that change over the inputs the router sends to the expert,

    s_j = E_x[ r(x)^2 || h_f,j(x) d_f,j - h_b,j(x) d_b,j ||^2 ],

with r(x) the routing weight (the expert's output enters the layer output scaled by it; pass
``weighted=False`` for the unweighted form). Scoring the residual of each matrix by its own error
ignores that gate, up and down are coupled through h; this score measures the coupled effect.

Selection keeps a layer-wide top-k of units with a minimum per expert (structured), or, in the
unstructured variant, individual residual entries ranked by their share of their unit's importance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Decomposition
from .calibrate import LayerCalibration


def check_keep_ratio(keep_ratio: float) -> float:
    """Validate a keep ratio: the fraction of residual units (or entries) kept, in (0, 1]."""
    try:
        r = float(keep_ratio)
    except (TypeError, ValueError):
        raise ValueError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}") from None
    if not (0.0 < r <= 1.0):
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    return r


def mean_square(t: torch.Tensor) -> torch.Tensor:
    """Mean of t^2 over rows; zeros (not NaN) for an expert that was routed no calibration token."""
    return t.pow(2).sum(0) / max(t.shape[0], 1)


def hidden_activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: Callable) -> torch.Tensor:
    """h = act(x G^T) * (x U^T) for x [N, H], G/U [I, H] -> [N, I]."""
    return act(x @ gate.T) * (x @ up.T)


def unit_output_importance(
    x: torch.Tensor,
    full: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    base: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    act: Callable,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """s_j = mean_n r_n^2 ||h_f,j(x_n) d_f,j - h_b,j(x_n) d_b,j||^2 for one expert; returns [I].

    ``full``/``base`` are (gate [I, H], up [I, H], down [H, I]). Expanded as
    E[r^2 h_f^2] |d_f|^2 - 2 E[r^2 h_f h_b] <d_f, d_b> + E[r^2 h_b^2] |d_b|^2, so it costs O(N I).
    """
    gf, uf, df = full
    gb, ub, db = base
    hf = hidden_activations(x, gf, uf, act)
    hb = hidden_activations(x, gb, ub, act)
    r2 = torch.ones(x.shape[0]) if route_weights is None else route_weights.float().pow(2)
    r2 = r2[:, None]
    n = max(x.shape[0], 1)
    ff = (r2 * hf * hf).sum(0) / n
    fb = (r2 * hf * hb).sum(0) / n
    bb = (r2 * hb * hb).sum(0) / n
    return ff * df.pow(2).sum(0) - 2 * fb * (df * db).sum(0) + bb * db.pow(2).sum(0)


def layer_output_importance(
    dec: Decomposition,
    calib: LayerCalibration,
    act: Callable,
    *,
    weighted: bool = True,
    by_frequency: bool = True,
) -> torch.Tensor:
    """Output importance [E, I] of every unit of every expert of one layer.

    ``by_frequency`` multiplies an expert's scores by the share of tokens routed to it, turning the
    per-expert expectation into each unit's contribution to the layer's total output error, which is
    what a layer-wide top-k should compare.
    """
    E = dec.experts.num_experts
    base = (dec.base_gate, dec.base_up, dec.base_down)
    total = max(sum(calib.routed), 1)
    rows = []
    for e in range(E):
        x = calib.inputs[e]
        r = calib.weights[e] if (weighted and calib.weights_known) else None
        full = (dec.experts.gate[e], dec.experts.up[e], dec.experts.down[e])
        s = unit_output_importance(x, full, base, act, r)
        if by_frequency:
            s = s * (calib.routed[e] / total)
        rows.append(s)
    return torch.stack(rows).clamp_min(0.0)


def select_units(scores: torch.Tensor, keep_ratio: float, min_per_expert: int = 2) -> torch.Tensor:
    """Boolean mask [E, I]: a layer-wide top-k of units, k = round(keep_ratio * E * I), with at least
    ``min_per_expert`` units per expert (capped so the minimum never exceeds the budget)."""
    keep_ratio = check_keep_ratio(keep_ratio)
    E, inter = scores.shape
    k = max(1, min(E * inter, round(keep_ratio * E * inter)))
    m = max(0, min(int(min_per_expert), inter, k // E))
    mask = torch.zeros(E, inter, dtype=torch.bool)
    if m:
        top = scores.topk(m, dim=1).indices
        mask.scatter_(1, top, True)
    rest = k - int(mask.sum())
    if rest > 0:
        s = scores.masked_fill(mask, float("-inf")).flatten()
        idx = s.topk(rest).indices
        mask.view(-1)[idx] = True
    return mask


def element_scores_from_units(
    unit_scores: torch.Tensor, dec: Decomposition, calib: LayerCalibration, act: Callable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unstructured variant: spread each unit's output importance over its residual entries.

    Entry shares follow each entry's first-order effect on h (gate/up: |r_jk| * rms(x_k) scaled by the
    unit's |dh/dgate| or |dh/dup|) or on the output (down: |r_ij| * rms(h_f,j)), normalised within the
    unit so that a unit's entries sum to its importance. Returns scores shaped like the residuals.
    """
    E = dec.experts.num_experts
    gs, us, ds = [], [], []
    for e in range(E):
        x = calib.inputs[e]
        g, u, d = dec.experts.gate[e], dec.experts.up[e], dec.experts.down[e]
        xr = mean_square(x).sqrt()  # [H]
        zg = x @ g.T
        zu = x @ u.T
        zg_req = zg.detach().clone().requires_grad_(True)
        a = act(zg_req)
        (da,) = torch.autograd.grad(a.sum(), zg_req)
        sens_g = mean_square(da * zu).sqrt()  # [I]
        sens_u = mean_square(a.detach()).sqrt()  # [I]
        hr = mean_square(a.detach() * zu).sqrt()  # [I]
        eg = (dec.res_gate[e].abs() * xr) * sens_g[:, None] * d.norm(dim=0)[:, None]
        eu = (dec.res_up[e].abs() * xr) * sens_u[:, None] * d.norm(dim=0)[:, None]
        ed = dec.res_down[e].abs() * hr[None, :]  # [H, I]
        tot = eg.sum(1) + eu.sum(1) + ed.sum(0) + 1e-30  # [I]
        share = unit_scores[e] / tot
        gs.append(eg * share[:, None])
        us.append(eu * share[:, None])
        ds.append(ed * share[None, :])
    return torch.stack(gs), torch.stack(us), torch.stack(ds)


def select_elements(
    scores: tuple[torch.Tensor, ...], keep_ratio: float, min_per_expert: int = 1
) -> tuple[torch.Tensor, ...]:
    """Unstructured selection: a layer-wide top-k over all residual entries of all matrices, keeping
    at least ``min_per_expert`` entries per expert; returns one boolean mask per matrix."""
    keep_ratio = check_keep_ratio(keep_ratio)
    E = scores[0].shape[0]
    flat = torch.cat([s.reshape(E, -1) for s in scores], dim=1)  # [E, n]
    mask = select_units(flat, keep_ratio, min_per_expert)
    out, start = [], 0
    for s in scores:
        n = s[0].numel()
        out.append(mask[:, start : start + n].reshape(s.shape))
        start += n
    return tuple(out)
