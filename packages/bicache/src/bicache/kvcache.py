"""Per-layer prefix KV cache on the transformers Cache API, run through the model's own forward.

A forward pass of the diffusion LM can compute only a *span* of the sequence in its first
``depth`` layers, taking the other positions' keys/values from a cache, and then continue with the
full sequence in the deeper layers from a cached hidden state. Layers are
:class:`transformers.cache_utils.CacheLayerMixin` objects held in a
:class:`transformers.cache_utils.Cache` that the model's own ``forward`` takes; its attention
modules (Llama, Qwen2, Gemma3 and any decoder of the same layer shape) call them through
``cache.update``:

* :class:`SpliceLayer` keeps stored K/V for the positions not recomputed and splices the fresh K/V of
  the computed span in (shared-prefix reuse: stored = prefix; Fast-dLLM dual cache: stored = the
  whole sequence from the last refresh);
* :class:`PassLayer` stores nothing (the layer recomputes everything);
* :class:`RecordingLayer` wraps either and keeps what attention saw (to refresh a block cache or to
  fill a prefix entry).

:func:`forward` never re-implements a decoder loop: hooks on the model's decoder layers, active only
inside it, give each layer its bidirectional mask and switch the query span at the reuse depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .model import DiffusionLM


class SpliceLayer(CacheLayerMixin):
    """Stored K/V (batch 1 or B) with the fresh span's K/V spliced in at ``start``.

    The first update builds a ``(B, H, L, D)`` buffer holding the stored positions; every update
    writes only the fresh span into it and returns it. One layer reused over the denoising steps of
    a batch therefore copies the shared prefix once per batch, not once per step (the returned K/V
    are valid until the next update). ``inplace=True`` is for stored K/V that belong to this batch
    alone (a block-cache refresh pass's own K/V, batch B): the fresh span is written into them
    directly, with no copy of the unchanged positions at all.
    """

    is_sliding = False
    keys: torch.Tensor  # stored at construction, never None here
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int, inplace: bool = False) -> None:
        super().__init__()
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError("stored keys and values must both have shape (batch, heads, length, head_dim)")
        if not 0 <= start <= keys.shape[-2]:
            raise ValueError(f"splice start {start} outside the stored length {keys.shape[-2]}")
        self.keys, self.values, self.start, self.inplace = keys, values, start, inplace
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._spans: list[int | None] = [None, None]  # the fresh span's end each buffer was built for
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # stored at construction
        return None

    def _splice(self, which: int, stored: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        b, h, n, d = fresh.shape
        if stored.shape[1] != h or stored.shape[3] != d:
            raise ValueError(
                f"cached K/V have {stored.shape[1]} heads x {stored.shape[3]} dims but the model gives {h} x {d}; "
                "the cache was built for another model"
            )
        if stored.shape[0] not in (1, b):
            raise ValueError(f"cached K/V batch {stored.shape[0]} does not match the request batch {b}")
        end = self.start + n
        if self.inplace and stored.shape[0] == b and end <= stored.shape[2]:
            stored[:, :, self.start : end] = fresh
            return stored
        length = max(stored.shape[2], end)
        buf = self._buffers[which]
        if (
            buf is None
            or buf.shape != (b, h, length, d)
            or self._spans[which] != end  # a shorter span would leave stale entries after it
            or buf.dtype != fresh.dtype
            or buf.device != fresh.device
        ):
            buf = fresh.new_empty((b, h, length, d))
            buf[:, :, : self.start] = stored[:, :, : self.start]  # batch-1 entries broadcast
            if end < stored.shape[2]:
                buf[:, :, end:] = stored[:, :, end:]
            self._buffers[which] = buf
            self._spans[which] = end
        buf[:, :, self.start : end] = fresh
        return buf

    def update(self, key_states, value_states, *args, **kwargs):
        return self._splice(0, self.keys, key_states), self._splice(1, self.values, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.keys.shape[-2], self.start + query_length), 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return -1


class PassLayer(CacheLayerMixin):
    """No cache: the layer attends over exactly what it computed."""

    is_sliding = False

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class RecordingLayer(CacheLayerMixin):
    """Wraps a layer and records the full K/V its attention used (refresh of a block cache)."""

    is_sliding = False

    def __init__(self, inner: CacheLayerMixin) -> None:
        super().__init__()
        self.inner = inner

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values = self.inner.update(key_states, value_states, *args, **kwargs)
        self.is_initialized = True
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return -1


@dataclass
class PrefixEntry:
    """Shared-prefix state of every layer: K/V (1, H, P, D) and the hidden state entering each layer."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: list[torch.Tensor]  # hidden[l]: (1, P, d) input of layer l; hidden[N] = last layer output
    model_id: int = 0
    hits: int = field(default=0)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, *self.hidden))


def prefix_cache(dlm: DiffusionLM, entry: PrefixEntry | None, depth: int, record: bool = False) -> Cache:
    """A Cache whose layers ``< depth`` reuse ``entry``'s prefix K/V and the rest recompute."""
    n = dlm.num_layers
    if not 0 <= depth <= n:
        raise ValueError(f"depth must lie in [0, {n}] (the model has {n} layers), got {depth}")
    if depth > 0 and entry is None:
        raise ValueError("a depth > 0 needs a prefix entry")
    if entry is not None and len(entry.keys) != n:
        raise ValueError(f"prefix entry has {len(entry.keys)} layers but the model has {n}; mismatched cache and model")
    layers: list[CacheLayerMixin] = []
    for i in range(n):
        # i < depth implies an entry (checked above)
        if entry is not None and i < depth:
            layer: CacheLayerMixin = SpliceLayer(entry.keys[i], entry.values[i], entry.length)
        else:
            layer = PassLayer()
        layers.append(RecordingLayer(layer) if record else layer)
    return _cache(layers)


def _cache(layers: Sequence[CacheLayerMixin]) -> Cache:
    # transformers types ``layers`` as a list of its layer union; a list of one kind is as good
    return Cache(layers=layers)  # type: ignore[arg-type]


def recorded_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a cache layer holds after a forward (a RecordingLayer's, a SpliceLayer's)."""
    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise ValueError(f"cache layer {type(layer).__name__} holds no keys and values: no forward recorded them")
    return layer.keys, layer.values


def block_cache(recorded: Cache, start: int, keep_suffix: bool = True) -> Cache:
    """Fast-dLLM style cache from a refresh pass: dual (prefix + suffix) or prefix only.

    The dual cache writes each step's fresh block K/V into the refresh pass's own K/V (they belong to
    this batch and are refreshed at the next block), so a block step copies only the block.
    """
    layers = []
    for layer in recorded.layers:
        k, v = recorded_kv(layer)
        if not keep_suffix:
            k, v = k[:, :, :start], v[:, :, :start]
        layers.append(SpliceLayer(k, v, start, inplace=keep_suffix))
    return _cache(layers)


@dataclass
class _Plan:
    """What the layer hooks of one :func:`forward` call do (see there)."""

    dlm: DiffusionLM
    cache: Cache | None
    first: int  # the first position the model is fed
    start: int  # the first position layers < depth compute when reinjecting
    end: int
    depth: int
    reinject: bool
    prefix_hidden: torch.Tensor | None
    hidden_out: list | None
    masks: dict = field(default_factory=dict)  # memo: one mask per (layer type, query span, keys)


# The plan of the forward running in this thread (or task); None outside bicache's forward, so the
# hooks leave every other call of the model alone, in this thread or any other.
_PLAN: ContextVar[_Plan | None] = ContextVar("bicache_plan", default=None)


def forward(
    dlm: DiffusionLM,
    ids: torch.Tensor,
    cache: Cache | None = None,
    start: int = 0,
    end: int | None = None,
    depth: int = 0,
    prefix_hidden: torch.Tensor | None = None,
    logits_from: int | None = None,
    hidden_out: list | None = None,
) -> torch.Tensor:
    """Logits for positions ``[logits_from, end)`` computing only what the cache does not hold.

    Layers ``< depth`` compute positions ``[start, end)``; when ``0 < depth < N`` and ``start > 0``
    the hidden state of positions ``[0, start)`` entering layer ``depth`` comes from
    ``prefix_hidden`` and deeper layers compute ``[0, end)``. With ``depth == 0`` every layer
    computes ``[start, end)`` (``start == 0`` and no cache: the plain bidirectional forward).

    The model's own ``forward`` runs (any decoder :func:`~bicache.model.decoder_layers` accepts),
    with ``cache`` as its transformers Cache. Hooks on its layers give each one a bidirectional
    mask (full, or Gemma3's bidirectional sliding window) and, for a reuse depth inside the model,
    let the shallow layers compute the span only and hand the deep ones the prefix's hidden state.
    ``hidden_out`` receives the hidden state entering each layer and the last layer's output.
    """
    n = dlm.num_layers
    end = ids.shape[1] if end is None else end
    logits_from = start if logits_from is None else logits_from
    if end > dlm.max_length:
        raise ValueError(f"sequence of {end} tokens is longer than the model's {dlm.max_length} positions")
    reinject = 0 < depth < n and start > 0
    if reinject and (prefix_hidden is None or prefix_hidden.shape[1] != start):
        raise ValueError("recomputing deep layers over the prefix needs its hidden state at that depth")
    if cache is not None and len(cache.layers) != n:
        raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {n}; mismatched cache and model")
    _install_hooks(dlm)
    first = 0 if reinject else start
    plan = _Plan(dlm, cache, first, start, end, depth, reinject, prefix_hidden, hidden_out)
    keep = end - logits_from
    token = _PLAN.set(plan)
    try:
        out = dlm.model(
            input_ids=ids[:, first:end],
            position_ids=torch.arange(first, end, device=ids.device).unsqueeze(0),
            # a 4D mask makes the model skip building its own (causal) masks; the hooks set each layer's
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device),
            cache=cache,
            use_cache=False,
            # logits of the last ``keep`` positions; 0 would mean all of them to transformers
            logits_to_keep=keep if keep > 0 else torch.zeros(0, dtype=torch.long, device=ids.device),
        )
    finally:
        _PLAN.reset(token)
    return out.logits


def _install_hooks(dlm: DiffusionLM) -> None:
    """Hook every decoder layer once; the hooks act only while a :class:`_Plan` is set."""
    if getattr(dlm.model, "_bicache_hooked", False):
        return
    for i, layer in enumerate(dlm.layers):
        layer.register_forward_pre_hook(_layer_pre_hook(i), with_kwargs=True)
    dlm.layers[-1].register_forward_hook(_last_layer_hook)
    dlm.model._bicache_hooked = True


def _layer_pre_hook(i: int):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict):
        plan = _PLAN.get()
        if plan is None:
            return None
        h = args[0] if args else kwargs["hidden_states"]
        span = plan.reinject and i < plan.depth
        if plan.reinject and i == plan.depth:
            assert plan.prefix_hidden is not None  # checked by forward()
            h = torch.cat([plan.prefix_hidden.expand(h.shape[0], -1, -1).to(h.dtype), h], dim=1)
        if span:  # the model is fed [0, end); this shallow layer computes [start, end) only
            cut = plan.start - plan.first
            if h.shape[1] == plan.end - plan.first:
                h = h[:, cut:]
            for name in ("position_embeddings", "position_ids"):
                if kwargs.get(name) is not None:
                    kwargs[name] = _tail(kwargs[name], cut)
        if plan.hidden_out is not None:
            plan.hidden_out.append(h)
        kwargs["attention_mask"] = _layer_mask(plan, i, plan.start if span else plan.first)
        kwargs["is_causal"] = False  # Llama's and Qwen2's attention default to causal without a mask
        if args:
            return (h, *args[1:]), kwargs
        kwargs["hidden_states"] = h
        return args, kwargs

    return hook


def _last_layer_hook(module: torch.nn.Module, args: tuple, output):
    plan = _PLAN.get()
    if plan is not None and plan.hidden_out is not None:
        plan.hidden_out.append(output[0] if isinstance(output, tuple) else output)


def _tail(x, cut: int):
    """Positions ``cut:`` of a per-position tensor (sequence on dim -2 for rotary cos/sin, -1 for ids)."""
    if isinstance(x, tuple):
        return tuple(t[..., cut:, :] for t in x)
    return x[..., cut:]


def _layer_mask(plan: _Plan, i: int, q0: int) -> torch.Tensor | None:
    """Layer ``i``'s bidirectional mask for queries ``[q0, end)`` over the keys its cache layer gives.

    Full attention needs none (``is_causal=False``); a sliding-window layer gets ``|q - k| < window``
    in the layout its attention kernel takes (bool for sdpa, additive for eager).
    """
    dlm = plan.dlm
    if dlm.layer_types[i] == "full_attention":
        return None
    q = plan.end - q0
    layer = plan.cache.layers[i] if plan.cache is not None else None
    if layer is not None and not isinstance(layer, CacheLayerMixin):
        raise ValueError(f"cache layer {i} is a {type(layer).__name__}; a sliding-window layer needs a K/V cache layer")
    if layer is None or (layer.get_seq_length() == 0 and layer.get_mask_sizes(q)[0] == q):
        kv, offset = q, q0  # the layer attends over exactly what it computes
    else:
        kv, offset = layer.get_mask_sizes(q)
    key = (q0, q, kv, offset)
    if key not in plan.masks:
        device = dlm.model.device
        q_pos = torch.arange(q0, plan.end, device=device)
        k_pos = torch.arange(offset, offset + kv, device=device)
        allowed = ((q_pos[:, None] - k_pos[None, :]).abs() < dlm.sliding_window)[None, None]
        if dlm.config._attn_implementation == "eager":
            dtype = dlm.model.dtype
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        plan.masks[key] = allowed
    return plan.masks[key]


def fill_entry(dlm: DiffusionLM, ids: torch.Tensor, prefix_len: int) -> tuple[PrefixEntry, torch.Tensor]:
    """Run the plain forward on ``ids`` (batch rows) recording row 0's prefix state.

    Returns the entry and the full-sequence logits of the pass (so the pass doubles as a decoding
    step): the KVs come from the request that first brought the prefix, as in AR serving engines.
    """
    cache = prefix_cache(dlm, None, 0, record=True)
    hidden: list[torch.Tensor] = []
    logits = forward(dlm, ids, cache=cache, hidden_out=hidden, logits_from=0)
    return entry_from(dlm, ids, cache, hidden, prefix_len), logits


def entry_from(dlm: DiffusionLM, ids: torch.Tensor, recorded: Cache, hidden: list[torch.Tensor], p: int) -> PrefixEntry:
    """Row 0's first ``p`` positions of a recorded full forward, as a prefix entry."""
    kv = [recorded_kv(layer) for layer in recorded.layers]
    return PrefixEntry(
        tokens=tuple(ids[0, :p].tolist()),
        keys=[k[:1, :, :p].clone() for k, _ in kv],
        values=[v[:1, :, :p].clone() for _, v in kv],
        hidden=[x[:1, :p].clone() for x in hidden],
        model_id=id(dlm.model),
    )


def layer_kv(dlm: DiffusionLM, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fresh per-layer K/V of the whole sequence (no cache)."""
    cache = prefix_cache(dlm, None, 0, record=True)
    forward(dlm, ids, cache=cache, logits_from=ids.shape[1])
    kv = [recorded_kv(la) for la in cache.layers]
    return [k for k, _ in kv], [v for _, v in kv]
