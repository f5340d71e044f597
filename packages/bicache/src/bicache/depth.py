"""Safe reuse depth: the paper's core.

Bidirectional attention makes every prefix K/V depend on the whole request, so a shared prefix's
K/V cached from one request *drift* from the K/V another request would compute. The drift is zero
in layer 0 (K/V there depend only on the token) and grows with depth, faster when the shared prefix
is a smaller fraction of the request. :func:`calibrate` measures that drift per layer and per
shared-prefix fraction; :class:`DepthPolicy` picks, for a request's fraction, the deepest ``L`` whose
layers ``< L`` all stay under a drift bound, and says why (:meth:`DepthPolicy.explain`);
:func:`choose_bound` picks the bound itself as the largest one whose decoded answers still agree
with the no-cache answers on held-out calibration requests.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import asdict, dataclass, field

import torch

from . import diffusion, kvcache
from .model import DiffusionLM
from .task import Request, TableTask

log = logging.getLogger(__name__)


def kv_drift(cached: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Relative L2 distance ||fresh - cached|| / ||fresh|| per batch row (over heads, tokens, dims)."""
    diff = (fresh - cached.expand_as(fresh)).flatten(1).norm(dim=1)
    return diff / fresh.flatten(1).norm(dim=1).clamp_min(1e-12)


@dataclass
class Calibration:
    """Measured drift at each calibrated shared-prefix fraction ``fractions[i]``.

    ``kv[i][l]``: mean drift of layer ``l``'s prefix K/V; ``hidden[i][l]``: mean drift of the prefix
    hidden state entering layer ``l`` (reused when the deeper layers recompute the prefix);
    ``drift[i][L-1]``: what reusing depth ``L`` exposes, ``max(kv[:L], hidden[L])``
    (``hidden[N]`` is not used at full depth). ``*_max`` are the worst requests instead of means.
    """

    fractions: list[float]
    kv: list[list[float]]
    hidden: list[list[float]]
    drift: list[list[float]]
    drift_max: list[list[float]]
    samples: int
    num_layers: int
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(
            d["fractions"],
            d["kv"],
            d["hidden"],
            d["drift"],
            d["drift_max"],
            d["samples"],
            d["num_layers"],
            d.get("meta", {}),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def calibrate(
    dlm: DiffusionLM,
    shared_rows: list[int] | None = None,
    requests_per_fraction: int = 8,
    groups: int = 2,
    seed: int = 1234,
) -> Calibration:
    """Per-layer drift of cached vs fresh prefix K/V on table-task bursts (see :func:`calibrate_bursts`)."""
    spec = dlm.spec
    task = TableTask(spec, seed=seed)
    if shared_rows is None:
        shared_rows = sorted({spec.shared_rows_for_fraction(f) for f in (0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)})
    bursts = [[task.burst(requests_per_fraction + 1, rows, group=g) for g in range(groups)] for rows in shared_rows]
    fractions = [spec.prefix_length(rows) / spec.prompt_length for rows in shared_rows]
    return calibrate_bursts(dlm, fractions, bursts, meta={"shared_rows": list(shared_rows), "seed": seed})


def calibrate_bursts(
    dlm: DiffusionLM, fractions: list[float], bursts: list[list[list[Request]]], meta: dict | None = None
) -> Calibration:
    """Measure per-layer drift of cached vs fresh prefix K/V for several shared-prefix fractions.

    ``bursts[i]``: the bursts of fraction ``fractions[i]`` (requests sharing a prefix). The entry
    is filled from each burst's first request (all answer tokens masked, as when a serving engine
    first meets the prefix) and compared with the fresh K/V of every other request, both at its
    first step (answer masked) and with its answer half revealed (a later denoising step).
    """
    spec = dlm.spec
    n = dlm.num_layers
    out: dict[str, list] = {"fractions": [], "kv": [], "hidden": [], "drift": [], "drift_max": []}
    total = 0
    for fraction, group_bursts in zip(fractions, bursts):
        kv_rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
        hid_rows: list[list[torch.Tensor]] = [[] for _ in range(n + 1)]
        for reqs in group_bursts:
            p = reqs[0].prefix_len
            gl = spec.gen_length
            first = [r.prompt + [dlm.mask_id] * gl for r in reqs]
            half = [r.prompt + r.answer[: gl // 2] + [dlm.mask_id] * (gl - gl // 2) for r in reqs[1:]]
            ids = torch.tensor(first[1:] + half)
            with torch.no_grad():
                entry, _ = kvcache.fill_entry(dlm, torch.tensor(first[:1]), p)
                cache = kvcache.prefix_cache(dlm, None, 0, record=True)
                hidden: list[torch.Tensor] = []
                kvcache.forward(dlm, ids, cache=cache, hidden_out=hidden, logits_from=ids.shape[1])
            for layer in range(n):
                k, v = kvcache.recorded_kv(cache.layers[layer])
                dk = kv_drift(entry.keys[layer], k[:, :, :p])
                dv = kv_drift(entry.values[layer], v[:, :, :p])
                kv_rows[layer].append(torch.maximum(dk, dv))
            for layer in range(n + 1):
                hid_rows[layer].append(kv_drift(entry.hidden[layer], hidden[layer][:, :p]))
            total += ids.shape[0]
        kv_t = torch.stack([torch.cat(x) for x in kv_rows], 1)  # (requests, n)
        hid_t = torch.stack([torch.cat(x) for x in hid_rows], 1)  # (requests, n + 1)
        exposed = []
        for depth in range(1, n + 1):
            worst = kv_t[:, :depth].max(1).values
            if depth < n:
                worst = torch.maximum(worst, hid_t[:, depth])
            exposed.append(worst)
        exp_t = torch.stack(exposed, 1)
        out["fractions"].append(fraction)
        out["kv"].append([float(x) for x in kv_t.mean(0)])
        out["hidden"].append([float(x) for x in hid_t.mean(0)])
        out["drift"].append([float(x) for x in exp_t.mean(0)])
        out["drift_max"].append([float(x) for x in exp_t.max(0).values])
        log.info(
            "fraction %.3f exposed drift per depth %s", out["fractions"][-1], [round(d, 4) for d in out["drift"][-1]]
        )
    return Calibration(**out, samples=total, num_layers=n, meta=meta or {})


@dataclass
class DepthPolicy:
    """Pick the reuse depth for a shared-prefix fraction so that reused layers stay under ``bound``.

    The drift of fraction ``f`` is read from the largest calibrated fraction ``<= f`` (drift falls
    as the shared fraction grows, so this is the conservative side); below the smallest calibrated
    fraction only layers with zero measured drift at that fraction are reused.
    """

    calibration: Calibration
    bound: float
    statistic: str = "drift"  # or "drift_max"

    def _row(self, fraction: float) -> tuple[int, float]:
        fr = self.calibration.fractions
        i = bisect.bisect_right(fr, fraction + 1e-9) - 1
        return max(i, 0), fr[max(i, 0)]

    def depth(self, fraction: float) -> int:
        """Deepest L whose exposed drift (reused K/V of layers < L and hidden state at L) is <= bound."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        i, at = self._row(fraction)
        table = getattr(self.calibration, self.statistic)[i]
        bound = self.bound if fraction >= at - 1e-9 else 0.0
        depth = 0
        for d in table:
            if d > bound:
                break
            depth += 1
        return depth

    def explain(self, fraction: float) -> dict:
        """Why ``depth(fraction)``: the calibrated row used, the per-layer drifts and the first layer over the bound."""
        i, at = self._row(fraction)
        table = getattr(self.calibration, self.statistic)[i]
        d = self.depth(fraction)
        if d == len(table):
            reason = f"drift at every depth <= bound {self.bound:g}: reuse all {d} layers"
        else:
            reason = (
                f"depth {d + 1} would expose drift {table[d]:.4g} > bound {self.bound:g}: "
                f"reuse prefix K/V of layers 0..{d - 1}, recompute layers {d}..{len(table) - 1}"
                if d
                else f"depth 1 would expose drift {table[0]:.4g} > bound {self.bound:g}: recompute every layer"
            )
        return {
            "fraction": round(fraction, 4),
            "calibrated_fraction": round(at, 4),
            "drift_by_depth": [round(x, 5) for x in table],
            "bound": self.bound,
            "depth": d,
            "num_layers": len(table),
            "reason": reason,
        }

    def table(self) -> list[dict]:
        """The fraction -> depth map at every calibrated fraction."""
        return [self.explain(f) for f in self.calibration.fractions]


def choose_bound(
    dlm: DiffusionLM,
    calibration: Calibration,
    max_disagreement: float = 0.02,
    requests_per_fraction: int = 12,
    cfg: diffusion.DecodeConfig | None = None,
    seed: int = 4321,
    statistic: str = "drift",
    bursts: list[list[Request]] | None = None,
) -> tuple[float, dict]:
    """The largest drift bound whose answers disagree with no-cache answers on <= ``max_disagreement``.

    Candidate bounds are the measured drift values themselves (each gives a different policy); the
    check decodes held-out requests of every calibrated fraction both ways: ``bursts`` (the first
    request of each fills the prefix entry), by default table-task bursts of the calibrated
    fractions. Returns the bound and a report of every candidate tried.
    """
    cfg = cfg or diffusion.DecodeConfig(gen_length=dlm.spec.gen_length)
    if bursts is None:
        task = TableTask(dlm.spec, seed=seed)
        bursts = [task.burst(requests_per_fraction + 1, rows) for rows in calibration.meta.get("shared_rows", [])]
    batches = []
    for reqs in bursts:
        ids = torch.tensor([r.prompt for r in reqs])
        with torch.no_grad():
            masked = torch.cat([ids[:1], torch.full((1, dlm.spec.gen_length), dlm.mask_id)], dim=1)
            entry, _ = kvcache.fill_entry(dlm, masked, reqs[0].prefix_len)
            ref = diffusion.generate(dlm, ids[1:], cfg, mode="none")
        batches.append((reqs[0].prefix_len / len(reqs[0].prompt), ids[1:], entry, ref))
    values = sorted({v for row in getattr(calibration, statistic) for v in row}, reverse=True)
    report = {}
    decoded: dict[tuple[int, int], int] = {}  # (batch, depth) -> answers agreeing with no-cache

    def agreeing(i: int, d: int) -> int:
        if (i, d) not in decoded:
            _, ids, entry, ref = batches[i]
            out = diffusion.generate(dlm, ids, cfg, mode="bicache", depth=d, entry=entry)
            decoded[(i, d)] = int((out == ref).all(1).sum())
        return decoded[(i, d)]

    for bound in values:
        policy = DepthPolicy(calibration, bound, statistic)
        depths = [policy.depth(b[0]) for b in batches]
        agree = sum(agreeing(i, d) for i, d in enumerate(depths))
        count = sum(b[1].shape[0] for b in batches)
        dis = 1 - agree / max(count, 1)
        report[f"{bound:.5g}"] = {
            "disagreement": round(dis, 4),
            "depths": {f"{b[0]:.3f}": d for b, d in zip(batches, depths)},
        }
        if dis <= max_disagreement:
            return bound, report
    return 0.0, report
