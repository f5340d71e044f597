"""Find the routed-expert collections of a MoE model and read them in one canonical layout.

Detection is structural, never by class name:

* fused layout (transformers 5.x): a module holding 3-D parameters ``gate_up_proj`` and ``down_proj``
  and an ``act_fn``; orientation (``is_transposed``) and gate/up packing (``is_concatenated``) are read
  from the attributes transformers' ``use_experts_implementation`` sets, or inferred from the shapes.
* per-expert layout: an ``nn.ModuleList`` whose children all hold three ``nn.Linear`` named
  ``gate_proj/up_proj/down_proj`` or ``w1/w3/w2`` (Mixtral-style), plus an activation.

Modules whose path contains ``shared`` (shared experts) are never selected, so they stay intact.
The canonical layout is ``gate``/``up`` ``[E, I, H]`` and ``down`` ``[E, H, I]`` in float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

_TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class NoMoEError(ValueError):
    """The model has no routed-expert layers that this package can compress."""


@dataclass
class ExpertWeights:
    """All experts of one MoE layer in canonical orientation: y = down @ (act(gate @ x) * (up @ x))."""

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate.shape[1]

    @property
    def hidden(self) -> int:
        return self.gate.shape[2]

    def permuted(self, perms: torch.Tensor) -> ExpertWeights:
        """Reorder the hidden units of each expert (perms [E, I]); the function of each expert is unchanged."""
        idx = perms.long()
        gate = torch.stack([self.gate[e, idx[e]] for e in range(self.num_experts)])
        up = torch.stack([self.up[e, idx[e]] for e in range(self.num_experts)])
        down = torch.stack([self.down[e][:, idx[e]] for e in range(self.num_experts)])
        return ExpertWeights(gate, up, down)

    def expert_forward(self, e: int, x: torch.Tensor, act: Callable) -> torch.Tensor:
        """Reference forward of expert e on inputs x [N, H]."""
        return (act(x @ self.gate[e].T) * (x @ self.up[e].T)) @ self.down[e].T


@dataclass
class MoELayer:
    """One routed-expert collection found in a model."""

    name: str  # module path of the experts collection
    module: nn.Module
    layout: str  # "fused" or "per_expert"
    num_experts: int
    hidden: int
    intermediate: int
    act_fn: Callable
    transposed: bool = False
    concatenated: bool = True

    def expert_modules(self) -> list[nn.Module]:
        """One module per expert (layout ``per_expert``: the experts collection is an ``nn.ModuleList``)."""
        if not isinstance(self.module, nn.ModuleList):
            raise TypeError(f"experts at {self.name!r} are one fused module, not a list of expert modules")
        return list(self.module)

    def weights(self) -> ExpertWeights:
        """A float32 CPU copy of all experts of this layer in canonical orientation."""
        with torch.no_grad():
            if self.layout == "fused":
                gu = _weight(self.module, "gate_up_proj", self.name).detach().float().cpu()
                dn = _weight(self.module, "down_proj", self.name).detach().float().cpu()
                if self.transposed:  # [E, H, 2I] and [E, I, H]
                    gu = gu.transpose(1, 2)
                    dn = dn.transpose(1, 2)
                if self.concatenated:
                    gate, up = gu[:, : self.intermediate], gu[:, self.intermediate :]
                else:  # interleaved gate0, up0, gate1, up1, ...
                    gate, up = gu[:, 0::2], gu[:, 1::2]
                return ExpertWeights(gate.contiguous().clone(), up.contiguous().clone(), dn.contiguous().clone())
            gates, ups, downs = [], [], []
            for child in self.expert_modules():
                g, u, d = _linear_triple(child)
                gates.append(g.weight.detach().float().cpu())
                ups.append(u.weight.detach().float().cpu())
                downs.append(d.weight.detach().float().cpu())
            return ExpertWeights(torch.stack(gates).clone(), torch.stack(ups).clone(), torch.stack(downs).clone())

    def original_bytes(self) -> int:
        """Bytes of every tensor the original experts collection holds."""
        return module_bytes(self.module)


def module_bytes(module: nn.Module) -> int:
    """Sum of the bytes of every distinct tensor (parameters and buffers) held by a module."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _linear_triple(child: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    for names in _TRIPLES:
        g, u, d = (getattr(child, n, None) for n in names)
        if isinstance(g, nn.Linear) and isinstance(u, nn.Linear) and isinstance(d, nn.Linear):
            return g, u, d
    raise NoMoEError(f"expert module {type(child).__name__} has no gate/up/down linear triple")


def _per_expert_act(child: nn.Module) -> Callable | None:
    for attr in ("act_fn", "act", "activation", "activation_fn"):
        fn = getattr(child, attr, None)
        if callable(fn):
            return fn
    return None


def _weight(mod: nn.Module, attr: str, name: str) -> torch.Tensor:
    """A fused experts collection's weight ``attr`` (gate_up_proj, down_proj)."""
    t = getattr(mod, attr, None)
    if not isinstance(t, torch.Tensor):
        raise NoMoEError(f"experts at {name!r}: {attr} is not a weight tensor")
    return t


def _fused_layer(name: str, mod: nn.Module) -> MoELayer:
    gu, dn = _weight(mod, "gate_up_proj", name), _weight(mod, "down_proj", name)
    act_fn = getattr(mod, "act_fn", None)
    if not callable(act_fn):
        raise NoMoEError(f"experts at {name!r} have no act_fn; cannot tell the activation")
    if getattr(mod, "has_bias", False) or getattr(mod, "gate_up_proj_bias", None) is not None:
        raise NoMoEError(f"experts at {name!r} use biases; only bias-free gated experts are supported")
    if getattr(mod, "has_gate", True) is False:
        raise NoMoEError(f"experts at {name!r} have no gate projection; only gated (GLU) experts are supported")
    apply_gate = getattr(type(mod), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        raise NoMoEError(f"experts at {name!r} use a custom gating function; only act(gate) * up is supported")
    E = gu.shape[0]
    transposed = getattr(mod, "is_transposed", None)
    if transposed is None:  # infer from shapes: standard is gate_up [E, 2I, H], down [E, H, I]
        transposed = not (gu.shape[1] == 2 * dn.shape[2] and gu.shape[2] == dn.shape[1])
    if transposed:
        H, I2 = gu.shape[1], gu.shape[2]
        ok = dn.shape[1] * 2 == I2 and dn.shape[2] == H
    else:
        I2, H = gu.shape[1], gu.shape[2]
        ok = dn.shape[2] * 2 == I2 and dn.shape[1] == H
    if not ok or dn.shape[0] != E:
        raise NoMoEError(
            f"experts at {name!r}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} do not form a "
            "gated expert collection"
        )
    return MoELayer(
        name=name,
        module=mod,
        layout="fused",
        num_experts=E,
        hidden=H,
        intermediate=I2 // 2,
        act_fn=act_fn,
        transposed=bool(transposed),
        concatenated=bool(getattr(mod, "is_concatenated", True)),
    )


def _per_expert_layer(name: str, mod: nn.ModuleList) -> MoELayer | None:
    children = list(mod)
    if len(children) < 2:
        return None
    try:
        triples = [_linear_triple(c) for c in children]
    except NoMoEError:
        return None
    acts = [_per_expert_act(c) for c in children]
    act = acts[0]
    if act is None or any(a is None for a in acts):
        return None
    g, _, d = triples[0]
    H, inter = g.in_features, g.out_features
    for gg, uu, dd in triples:
        if any(lin.bias is not None for lin in (gg, uu, dd)):
            raise NoMoEError(f"experts at {name!r} use biases; only bias-free gated experts are supported")
        if (gg.in_features, gg.out_features, uu.out_features, dd.in_features, dd.out_features) != (
            H,
            inter,
            inter,
            inter,
            H,
        ):
            return None
    return MoELayer(name, mod, "per_expert", len(children), H, inter, act)


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every routed-expert collection of ``model`` (shared experts excluded), in module order.

    Raises NoMoEError when there is none.
    """
    layers: list[MoELayer] = []
    for name, mod in model.named_modules():
        if "shared" in name.lower():
            continue
        gu = getattr(mod, "gate_up_proj", None)
        dn = getattr(mod, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
            layers.append(_fused_layer(name, mod))
        elif isinstance(mod, nn.ModuleList):
            layer = _per_expert_layer(name, mod)
            if layer is not None:
                layers.append(layer)
    if not layers:
        raise NoMoEError(
            f"model {type(model).__name__} has no MoE layers: found no fused experts (3-D gate_up_proj/down_proj) "
            "and no list of gate/up/down experts; pass a mixture-of-experts model"
        )
    log.debug("found %d MoE layers", len(layers))
    return layers


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and leaf.isdigit():
        parent[int(leaf)] = new
    else:
        setattr(parent, leaf, new)
