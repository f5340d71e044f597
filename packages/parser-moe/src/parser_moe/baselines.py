"""Baseline scores for what to keep of the residuals, at the same memory as PARSER.

* ``magnitude`` (ResMoE-style): |residual|, no data.
* ``reconstruction``: each residual matrix by its own reconstruction error on the routed inputs
  (gate/up rows by E[(r.x)^2], down columns by E[h_j^2] |r|^2), ignoring the gate-up-down coupling.
* ``wanda``: |residual| * ||input feature|| (inputs x for gate/up, hidden activations h for down).

Each returns unit scores [E, I] (structured selection) or per-entry scores shaped like the residuals
(unstructured selection); selection itself is the same layer-wide top-k as PARSER's. With
``route_weight`` the feature norms are taken over r(x) x and r(x) h, the inputs as the layer output
sees them (each expert's output enters it scaled by its routing weight r).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Decomposition
from .calibrate import LayerCalibration
from .importance import hidden_activations, mean_square

BASELINES = ("magnitude", "reconstruction", "wanda")


def _features(
    dec: Decomposition, calib: LayerCalibration, act: Callable, e: int, route_weight: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, rms of x per input feature, h, rms of h per unit) of expert e's routed inputs."""
    x = calib.inputs[e]
    h = hidden_activations(x, dec.experts.gate[e], dec.experts.up[e], act)
    if route_weight and calib.weights_known:
        r = calib.weights[e].float()[:, None]
        x, h = x * r, h * r
    return x, mean_square(x).sqrt(), h, mean_square(h).sqrt()


def entry_scores(
    method: str, dec: Decomposition, calib: LayerCalibration | None, act: Callable, route_weight: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry scores (gate [E,I,H], up [E,I,H], down [E,H,I]) of a baseline."""
    rg, ru, rd = dec.res_gate, dec.res_up, dec.res_down
    if method == "magnitude":
        return rg.abs(), ru.abs(), rd.abs()
    if method not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {method!r}")
    if calib is None:
        raise ValueError(f"baseline {method!r} needs calibration data")
    gs, us, ds = [], [], []
    for e in range(dec.experts.num_experts):
        _, xr, _, hr = _features(dec, calib, act, e, route_weight)
        if method == "wanda":
            gs.append(rg[e].abs() * xr)
            us.append(ru[e].abs() * xr)
            ds.append(rd[e].abs() * hr)
        else:
            gs.append(rg[e].pow(2) * xr.pow(2))
            us.append(ru[e].pow(2) * xr.pow(2))
            ds.append(rd[e].pow(2) * hr.pow(2))
    return torch.stack(gs), torch.stack(us), torch.stack(ds)


def unit_scores(
    method: str, dec: Decomposition, calib: LayerCalibration | None, act: Callable, route_weight: bool = False
) -> torch.Tensor:
    """Unit scores [E, I] of a baseline: the unit's gate row, up row and down column together."""
    if method == "reconstruction":
        if calib is None:
            raise ValueError("baseline 'reconstruction' needs calibration data")
        out = []
        for e in range(dec.experts.num_experts):
            x, _, _, hr = _features(dec, calib, act, e, route_weight)
            own_g = mean_square(x @ dec.res_gate[e].T)  # each matrix's own output error
            own_u = mean_square(x @ dec.res_up[e].T)
            own_d = hr.pow(2) * dec.res_down[e].pow(2).sum(0)
            out.append(own_g + own_u + own_d)
        return torch.stack(out)
    g, u, d = entry_scores(method, dec, calib, act, route_weight)
    return g.sum(2) + u.sum(2) + d.sum(1)
