"""Run text through a MoE model and keep, per expert, a reservoir sample of the inputs routed to it.

Hooks sit on the experts collections found by :func:`parser_moe.models.find_moe_layers`, so the router
of the model itself decides which expert sees which token. Each expert keeps at most ``cap`` routed
inputs (and their routing weights) chosen uniformly among all it received (Vitter's Algorithm R), so
the memory held is bounded by ``max_bytes`` however much text is fed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .models import MoELayer, find_moe_layers

log = logging.getLogger(__name__)


class CalibrationError(ValueError):
    """The calibration data cannot support compression (e.g. an expert saw no token)."""


class Reservoir:
    """Uniform sample of at most ``cap`` rows out of a stream (Algorithm R), with a weight per row."""

    def __init__(self, cap: int, dim: int, generator: torch.Generator):
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self.x = torch.empty(cap, dim)
        self.w = torch.empty(cap)
        self.seen = 0
        self._gen = generator

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        m = x.shape[0]
        if m == 0:
            return
        x = x.detach().float().cpu()
        w = w.detach().float().cpu()
        fill = max(0, min(m, self.cap - self.seen))
        if fill:
            self.x[self.seen : self.seen + fill] = x[:fill]
            self.w[self.seen : self.seen + fill] = w[:fill]
        rest = m - fill
        if rest > 0:
            pos = torch.arange(self.seen + fill, self.seen + m, dtype=torch.float64)  # 0-based stream index t
            slot = (torch.rand(rest, generator=self._gen, dtype=torch.float64) * (pos + 1)).floor().long()
            accept = (slot < self.cap).nonzero().flatten()
            for i in accept.tolist():  # in stream order, so a later row overwrites an earlier one
                self.x[slot[i]] = x[fill + i]
                self.w[slot[i]] = w[fill + i]
        self.seen += m

    @property
    def size(self) -> int:
        return min(self.seen, self.cap)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[: self.size].clone(), self.w[: self.size].clone()


@dataclass
class LayerCalibration:
    """Routed inputs per expert of one MoE layer."""

    name: str
    inputs: list[torch.Tensor]  # per expert [n_e, H]
    weights: list[torch.Tensor]  # per expert [n_e]; routing weights (1.0 when the layout hides them)
    routed: list[int]  # tokens routed to each expert in the whole calibration stream
    weights_known: bool = True


@dataclass
class CalibrationData:
    layers: dict[str, LayerCalibration] = field(default_factory=dict)
    tokens: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lc in self.layers.values() for t in lc.inputs + lc.weights)


def _cap_per_expert(layers: list[MoELayer], max_bytes: int, max_per_expert: int | None) -> int:
    slots = sum(layer.num_experts * (layer.hidden + 1) * 4 for layer in layers)
    cap = max_bytes // slots
    if max_per_expert is not None:
        cap = min(cap, max_per_expert)
    if cap < 1:
        raise CalibrationError(f"max_bytes={max_bytes} cannot hold one routed input per expert (needs >= {slots})")
    return int(cap)


def _fused_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args[:3])
    for n in names[len(vals) :]:
        vals.append(kwargs[n])
    return vals[0], vals[1], vals[2]


def calibrate(
    model: nn.Module,
    batches: Iterable[torch.Tensor] | torch.Tensor,
    *,
    max_bytes: int = 64 << 20,
    max_per_expert: int | None = 2048,
    seed: int = 0,
    layers: list[MoELayer] | None = None,
    require_all_experts: bool = True,
) -> CalibrationData:
    """Feed ``batches`` of token ids ([B, T] each) through ``model`` and sample routed inputs per expert.

    ``max_bytes`` caps the memory of all samples together. Raises CalibrationError naming the layer and
    expert when ``require_all_experts`` and some expert received no token.
    """
    layers = layers if layers is not None else find_moe_layers(model)
    cap = _cap_per_expert(layers, max_bytes, max_per_expert)
    gen = torch.Generator().manual_seed(seed)
    res = {ly.name: [Reservoir(cap, ly.hidden, gen) for _ in range(ly.num_experts)] for ly in layers}
    handles = []

    def fused_hook(layer: MoELayer):
        def hook(mod, args, kwargs):
            x, idx, w = _fused_args(args, kwargs)
            x = x.reshape(-1, layer.hidden)
            idx = idx.reshape(x.shape[0], -1)
            w = w.reshape(x.shape[0], -1)
            for e in range(layer.num_experts):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel():
                    res[layer.name][e].add(x[tok], w[tok, slot])

        return hook

    def expert_hook(layer: MoELayer, e: int):
        def hook(mod, args, kwargs):
            x = (args[0] if args else next(iter(kwargs.values()))).reshape(-1, layer.hidden)
            res[layer.name][e].add(x, torch.ones(x.shape[0]))

        return hook

    try:
        for ly in layers:
            if ly.layout == "fused":
                handles.append(ly.module.register_forward_pre_hook(fused_hook(ly), with_kwargs=True))
            else:
                for e, child in enumerate(ly.expert_modules()):
                    handles.append(child.register_forward_pre_hook(expert_hook(ly, e), with_kwargs=True))
        if isinstance(batches, torch.Tensor):
            batches = [batches] if batches.dim() == 2 else list(batches)
        was_training = model.training
        model.eval()
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        tokens = 0
        with torch.no_grad():
            for b in batches:
                b = b if b.dim() == 2 else b.unsqueeze(0)
                model(input_ids=b.to(device))
                tokens += b.numel()
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    data = CalibrationData(tokens=tokens)
    for ly in layers:
        rs = res[ly.name]
        routed = [r.seen for r in rs]
        if require_all_experts and min(routed) == 0:
            missing = [e for e, n in enumerate(routed) if n == 0]
            raise CalibrationError(
                f"calibration data ({tokens} tokens) routed no token to expert(s) {missing} of layer {ly.name!r}; "
                "pass more or longer calibration text so that every expert receives at least one token"
            )
        xs, ws = zip(*(r.tensors() for r in rs))
        data.layers[ly.name] = LayerCalibration(ly.name, list(xs), list(ws), routed, ly.layout == "fused")
    log.info("calibrated on %d tokens, %d bytes of samples", tokens, data.nbytes())
    return data
