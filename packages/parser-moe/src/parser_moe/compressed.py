"""A compressed experts collection: one shared base plus the kept residuals of each expert.

Structured (``units``) storage keeps, per expert, a set of hidden units whose gate row, up row and down
column residuals are stored; every other unit falls back to the base. Because

    expert_e(x) = D_b h_b(x) + sum_{j kept in e} (h_f,j(x) d_f,j - h_b,j(x) d_b,j),

the base part is computed once per token for the whole layer, scaled by the sum of routing weights,
and each routed expert adds only the correction of its kept units: exact for what is kept. The
unstructured (``entries``) storage keeps individual residual entries (value + int32 position) and
rebuilds the expert's weights on the fly. Memory is the bytes of every tensor the module holds.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import hwtopo

from .models import MoELayer, module_bytes, set_submodule

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MATS = ("gate", "up", "down")


class CompressedExperts(nn.Module):
    """Drop-in replacement of a fused experts module: forward(hidden_states, top_k_index, top_k_weights)."""

    # buffers registered in __init__: the base (both modes); kept units' residuals (mode "units");
    # the entries mode's <mat>_values/_index/_offsets are reached through getattr
    base_gate: torch.Tensor
    base_up: torch.Tensor
    base_down: torch.Tensor
    kept_index: torch.Tensor
    kept_offsets: torch.Tensor
    res_gate: torch.Tensor
    res_up: torch.Tensor
    res_down: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act_fn: Callable,
        mode: str = "units",
        sizes: tuple[int, ...] = (0,),
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if mode not in ("units", "entries"):
            raise ValueError(f"mode must be 'units' or 'entries', got {mode!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.act_fn = act_fn
        self.mode = mode
        H, inter, E = hidden, intermediate, num_experts
        self.register_buffer("base_gate", torch.zeros(inter, H, dtype=dtype))
        self.register_buffer("base_up", torch.zeros(inter, H, dtype=dtype))
        self.register_buffer("base_down", torch.zeros(H, inter, dtype=dtype))
        if mode == "units":
            (k,) = sizes
            self.register_buffer("kept_index", torch.zeros(k, dtype=torch.int32))
            self.register_buffer("kept_offsets", torch.zeros(E + 1, dtype=torch.int64))
            for m in _MATS:  # down residual columns stored as rows [k, H]
                self.register_buffer(f"res_{m}", torch.zeros(k, H, dtype=dtype))
        else:
            for m, n in zip(_MATS, sizes):
                self.register_buffer(f"{m}_values", torch.zeros(n, dtype=dtype))
                self.register_buffer(f"{m}_index", torch.zeros(n, dtype=torch.int32))
                self.register_buffer(f"{m}_offsets", torch.zeros(E + 1, dtype=torch.int64))

    # construction -------------------------------------------------------------------------------
    @classmethod
    def from_units(
        cls,
        base: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        act_fn: Callable,
        dtype: torch.dtype = torch.float32,
    ) -> CompressedExperts:
        """Keep the residuals of the units in ``mask`` [E, I]; base (gate, up, down), experts [E, ...]."""
        bg, bu, bd = base
        g, u, d = experts
        E, inter, H = g.shape
        counts = mask.sum(1)
        mod = cls(E, H, inter, act_fn, "units", (int(counts.sum()),), dtype)
        idx = [mask[e].nonzero().flatten() for e in range(E)]
        with torch.no_grad():
            mod.base_gate.copy_(bg)
            mod.base_up.copy_(bu)
            mod.base_down.copy_(bd)
            mod.kept_offsets[1:] = torch.cumsum(counts, 0)
            mod.kept_index.copy_(torch.cat(idx).to(torch.int32))
            mod.res_gate.copy_(torch.cat([g[e, idx[e]] - bg[idx[e]] for e in range(E)]))
            mod.res_up.copy_(torch.cat([u[e, idx[e]] - bu[idx[e]] for e in range(E)]))
            mod.res_down.copy_(torch.cat([(d[e][:, idx[e]] - bd[:, idx[e]]).T for e in range(E)]))
        return mod

    @classmethod
    def from_entries(
        cls,
        base: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        masks: tuple[torch.Tensor, ...],
        act_fn: Callable,
        dtype: torch.dtype = torch.float32,
    ) -> CompressedExperts:
        """Keep the residual entries in ``masks`` (one boolean mask per matrix, shaped like the experts)."""
        if len(masks) != len(_MATS):
            raise ValueError(f"masks: one per matrix ({', '.join(_MATS)}), not {len(masks)}")
        E, inter, H = experts[0].shape
        sizes = tuple(int(m.sum()) for m in masks)
        mod = cls(E, H, inter, act_fn, "entries", sizes, dtype)
        with torch.no_grad():
            for name, b, w, m in zip(_MATS, base, experts, masks):
                getattr(mod, f"base_{name}").copy_(b)
                r = (w - b).reshape(E, -1)
                mf = m.reshape(E, -1)
                pos = [mf[e].nonzero().flatten() for e in range(E)]
                getattr(mod, f"{name}_values").copy_(torch.cat([r[e, pos[e]] for e in range(E)]))
                getattr(mod, f"{name}_index").copy_(torch.cat(pos).to(torch.int32))
                getattr(mod, f"{name}_offsets")[1:] = torch.cumsum(mf.sum(1), 0)
        return mod

    # accounting ---------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of every tensor this module holds."""
        return module_bytes(self)

    def kept_units(self) -> torch.Tensor:
        """Kept units per expert (units mode) or kept entries per expert (entries mode)."""
        if self.mode == "units":
            return self.kept_offsets.diff()
        return sum(getattr(self, f"{m}_offsets").diff() for m in _MATS)

    # forward ------------------------------------------------------------------------------------
    def _dense_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for m in _MATS:
            w = getattr(self, f"base_{m}").clone()
            if self.mode == "units":
                a, b = int(self.kept_offsets[e]), int(self.kept_offsets[e + 1])
                k = self.kept_index[a:b].long()
                r = getattr(self, f"res_{m}")[a:b]
                if m == "down":
                    w[:, k] += r.T
                else:
                    w[k] += r
            else:
                off = getattr(self, f"{m}_offsets")
                a, b = int(off[e]), int(off[e + 1])
                w.view(-1)[getattr(self, f"{m}_index")[a:b].long()] += getattr(self, f"{m}_values")[a:b]
            out.append(w)
        return out[0], out[1], out[2]

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense weights each expert computes with, [E, I, H], [E, I, H], [E, H, I] (for checks)."""
        ws = [self._dense_expert(e) for e in range(self.num_experts)]
        gate, up, down = (torch.stack([w[i] for w in ws]) for i in range(3))
        return gate, up, down

    def _base_terms(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ag = x @ self.base_gate.T
        au = x @ self.base_up.T
        return ag, au, self.act_fn(ag) * au

    def _correction(self, e: int, x, ag, au, hb) -> torch.Tensor | None:
        a, b = int(self.kept_offsets[e]), int(self.kept_offsets[e + 1])
        if a == b:
            return None
        k = self.kept_index[a:b].long()
        gf = ag[:, k] + x @ self.res_gate[a:b].T
        uf = au[:, k] + x @ self.res_up[a:b].T
        hf = self.act_fn(gf) * uf
        db = self.base_down[:, k]
        return hf @ (db + self.res_down[a:b].T).T - hb[:, k] @ db.T

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Output of (compressed) expert e alone on x [N, H]."""
        if self.mode == "entries":
            g, u, d = self._dense_expert(e)
            return (self.act_fn(x @ g.T) * (x @ u.T)) @ d.T
        ag, au, hb = self._base_terms(x)
        y = hb @ self.base_down.T
        c = self._correction(e, x, ag, au, hb)
        return y if c is None else y + c

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_dim).to(self.base_gate.dtype)
        idx = top_k_index.reshape(x.shape[0], -1)
        w = top_k_weights.reshape(x.shape[0], -1).to(x.dtype)
        valid = idx < self.num_experts
        hit = torch.unique(idx[valid]).tolist()
        if self.mode == "units":
            ag, au, hb = self._base_terms(x)  # the base once per token for the whole layer
            out = (hb @ self.base_down.T) * (w * valid).sum(1, keepdim=True)
            for e in hit:
                tok, slot = (idx == e).nonzero(as_tuple=True)
                c = self._correction(e, x[tok], ag[tok], au[tok], hb[tok])
                if c is not None:
                    out.index_add_(0, tok, c * w[tok, slot, None])
        else:
            out = torch.zeros_like(x)
            for e in hit:
                tok, slot = (idx == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, self.expert_forward(e, x[tok]) * w[tok, slot, None])
        return out.reshape(shape).to(hidden_states.dtype)

    def spec(self) -> dict:
        """Shapes needed to rebuild an empty module before loading its tensors."""
        if self.mode == "units":
            sizes = [int(self.kept_index.numel())]
        else:
            sizes = [int(getattr(self, f"{m}_values").numel()) for m in _MATS]
        return {
            "mode": self.mode,
            "num_experts": self.num_experts,
            "hidden": self.hidden_dim,
            "intermediate": self.intermediate_dim,
            "sizes": sizes,
            "dtype": str(self.base_gate.dtype).removeprefix("torch."),
        }


class _ExpertView(nn.Module):
    """Expert e of a CompressedExperts, callable like one per-expert MLP module."""

    _storage: CompressedExperts

    def __init__(self, storage: CompressedExperts, e: int):
        super().__init__()
        object.__setattr__(self, "_storage", storage)  # not registered: held once by the list
        self.e = e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._storage.expert_forward(self.e, x.reshape(-1, shape[-1]).to(self._storage.base_gate.dtype))
        return y.reshape(shape).to(x.dtype)


class CompressedExpertList(nn.Module):
    """Replacement of a per-expert ``nn.ModuleList``: indexable and iterable, one shared storage."""

    def __init__(self, storage: CompressedExperts):
        super().__init__()
        self.storage = storage
        self._views = [_ExpertView(storage, e) for e in range(storage.num_experts)]

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> nn.Module:
        return self._views[i]

    def __iter__(self):
        return iter(self._views)

    def nbytes(self) -> int:
        return self.storage.nbytes()


def install(model: nn.Module, layer: MoELayer, storage: CompressedExperts) -> nn.Module:
    """Put ``storage`` in place of the experts collection ``layer`` of ``model``; returns the new module."""
    new: nn.Module = storage if layer.layout == "fused" else CompressedExpertList(storage)
    set_submodule(model, layer.name, new)
    return new


def compressed_modules(model: nn.Module) -> dict[str, CompressedExperts]:
    """Every CompressedExperts storage of ``model`` by the path of the module that replaced the experts."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, CompressedExperts):
            out[name.removesuffix(".storage") if name.endswith(".storage") else name] = mod
    return out


def compressed_layers(model: nn.Module) -> dict[str, dict]:
    """Shapes, layout and dtype of every compressed experts collection of ``model``, by module path."""
    out = {}
    for name, mod in compressed_modules(model).items():
        layout = "per_expert" if isinstance(model.get_submodule(name), CompressedExpertList) else "fused"
        out[name] = {**mod.spec(), "layout": layout}
    return out


def install_empty(model: nn.Module, layers: dict[str, dict]) -> None:
    """Put empty compressed modules shaped by ``layers`` (from :func:`compressed_layers`) in place of
    the experts collections of an uncompressed ``model``, ready for its tensors to be loaded."""
    from .models import find_moe_layers

    found = {ly.name: ly for ly in find_moe_layers(model)}
    for name, spec in layers.items():
        if name not in found:
            raise ValueError(f"compressed layer {name!r} has no experts collection in the rebuilt model")
        ly = found[name]
        sizes = tuple(int(n) for n in spec["sizes"])
        storage = CompressedExperts(
            spec["num_experts"],
            spec["hidden"],
            spec["intermediate"],
            ly.act_fn,
            spec["mode"],
            sizes,
            getattr(torch, spec["dtype"]),
        )
        install(model, ly, storage)


def save_compressed(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write a compressed transformers model with ``save_pretrained`` (safetensors + a ``parser_moe``
    config), atomically; ``AutoModelForCausalLM.from_pretrained`` loads it once ``parser_moe.hf`` is
    imported."""
    from .hf import ParserMoeForCausalLM

    wrapped = ParserMoeForCausalLM.wrap(model)
    return hwtopo.atomic_dir(Path(path), lambda d: wrapped.save_pretrained(str(d)))


def load_compressed(path: str | os.PathLike, model_factory: Callable | None = None) -> nn.Module:
    """Load a model written by :func:`save_compressed`; returns the compressed causal LM itself (the
    ``inner`` model of :class:`parser_moe.hf.ParserMoeForCausalLM`).

    Directories of the first format (``parser_moe.json`` beside the original config) load too;
    ``model_factory(config)`` builds their uncompressed architecture (default
    ``AutoModelForCausalLM.from_config``).
    """
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: missing config.json or model.safetensors; not written by save_compressed")
    if (path / "parser_moe.json").is_file():
        return _load_first_format(path, model_factory)
    from .hf import ParserMoeForCausalLM

    model = ParserMoeForCausalLM.from_pretrained(str(path)).inner
    model.eval()
    return model


def _load_first_format(path: Path, model_factory: Callable | None) -> nn.Module:
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = json.loads((path / "parser_moe.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path / 'parser_moe.json'}: format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    factory = model_factory or AutoModelForCausalLM.from_config
    model = factory(AutoConfig.from_pretrained(str(path)))
    install_empty(model, meta["layers"])
    load_model(model, str(path / "model.safetensors"), strict=True)
    model.eval()
    return model
