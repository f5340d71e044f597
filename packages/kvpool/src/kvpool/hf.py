"""transformers integration: a Cache that fills its layers from the pool while the model computes.

``PoolCache`` is a ``DynamicCache`` whose layers start out as the cached prefix in flight: layer
``l`` blocks on the pool's retrieval of layer ``l`` the first time the model touches it, so
layer 0 of the uncached suffix computes while later layers are still loading. ``prefill`` runs a
request: longest cached prefix from the pool, prefill of the rest only, then the new full chunks
go back into the pool. Outputs equal a full recompute (tested); a chunk that fails its checks
makes ``prefill`` recompute from the last intact chunk instead of using wrong KV.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .keys import KVLayout
from .pool import KVPool
from .retrieval import KVBuffers

__all__ = ["PoolLayer", "PoolCache", "PrefillResult", "prefill", "cache_kv", "layout_for"]

log = logging.getLogger(__name__)


def layout_for(model, chunk_tokens: int = 256) -> KVLayout:
    """The pool layout of a transformers causal LM (dtype from its parameters)."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return KVLayout.from_config(model.config, dtype=dtype, chunk_tokens=chunk_tokens)


class LoadedPrefix(Protocol):
    """What a cache layer reads from a retrieval: kvpool's LayerwiseLoad or a baseline's SerialLoad."""

    @property
    def tokens(self) -> int: ...

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PoolLayer(DynamicLayer):
    """A full-attention cache layer whose first ``prefix`` tokens come from a pool retrieval."""

    def __init__(self, load: LoadedPrefix, layer_idx: int):
        super().__init__()
        self.load = load
        self.layer_idx = layer_idx

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self.load.tokens
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            k, v = self.load.wait(self.layer_idx)
            p, q = self.load.tokens, key_states.shape[-2]
            kb, vb = self.load.buffers(self.layer_idx)
            if kb.shape[-2] >= p + q and kb.dtype == key_states.dtype and kb.device == key_states.device:
                # the suffix lands right after the prefix in the preallocated buffer: no concatenation copy
                kb[:, :, p : p + q].copy_(key_states)
                vb[:, :, p : p + q].copy_(value_states)
                self.device = key_states.device
                self.keys, self.values = kb[:, :, : p + q], vb[:, :, : p + q]
                self.is_initialized = True
                return self.keys, self.values
            self.device = key_states.device
            self.keys = k.to(key_states.device, key_states.dtype)
            self.values = v.to(value_states.device, value_states.dtype)
            self.is_initialized = True
        return super().update(key_states, value_states, *args, **kwargs)


class PoolCache(DynamicCache):
    """A DynamicCache pre-seeded, layer by layer, with a prefix loaded from a KVPool."""

    def __init__(self, load: LoadedPrefix, config):
        super().__init__(config=config)
        if any(type(layer) is not DynamicLayer for layer in self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers})
            raise ValueError(f"PoolCache supports full-attention layers only; this model has {kinds}")
        self.load = load
        self.layers = [PoolLayer(load, i) for i in range(len(self.layers))]


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of a filled transformers cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


@dataclass
class PrefillResult:
    logits: torch.Tensor  # logits of the last position, [1, vocab]
    cached_tokens: int  # prefix tokens taken from the pool
    computed_tokens: int  # tokens run through the model
    ttft_s: float  # lookup + retrieval + prefill of the rest, to the first token's logits
    blocked_s: float  # time the compute thread waited on pool I/O
    retrieval: dict | None = None
    store_s: float = 0.0
    stored_chunks: int = 0
    fallback: str | None = None
    cache: object = field(default=None, repr=False)


def _run(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


@torch.no_grad()
def prefill(
    model, input_ids: torch.Tensor, pool: KVPool | None, store: bool = True, out: KVBuffers | None = None
) -> PrefillResult:
    """Prefill one request (``input_ids`` of shape [1, T]) reusing the pool's longest cached prefix.

    ``out``: preallocated destination buffers to load into (reused across requests by the caller).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T] (one request), not {tuple(input_ids.shape)}")
    T = input_ids.shape[1]
    t0 = time.perf_counter()
    tokens = input_ids[0].tolist()
    load = None
    fallback = None
    blocked = 0.0
    if pool is not None:
        keys = pool.keys(tokens)
        # keep at least one token to compute: the model must produce the next token's logits
        load = pool.retrieve(tokens, max_tokens=T - 1, keys=keys, extra_tokens=None, out=out)
    cache: DynamicCache
    if load is not None and load.tokens > 0:
        assert pool is not None  # a load comes only from a pool
        cache = PoolCache(load, model.config)
        logits = _run(model, input_ids[:, load.tokens :], cache)
        load.join()
        blocked = load.blocked_s
        if load.lost:
            fallback = (
                f"{len(load.lost)} cached chunk(s) failed their checks; recomputed from token {load.valid_tokens}"
            )
            log.warning("%s", fallback)
            pool.forget_lost(load)
            # recompute from scratch (layers already used the loaded prefix; nothing of it is kept)
            cache = DynamicCache(config=model.config)
            logits = _run(model, input_ids, cache)
        cached = 0 if fallback else load.tokens
    else:
        cache = DynamicCache(config=model.config)
        logits = _run(model, input_ids, cache)
        cached = 0
    ttft = time.perf_counter() - t0
    res = PrefillResult(
        logits=logits,
        cached_tokens=cached,
        computed_tokens=T - cached,
        ttft_s=ttft,
        blocked_s=blocked,
        retrieval=load.describe() if load is not None and load.tokens else None,
        fallback=fallback,
        cache=cache,
    )
    if pool is not None and store:
        t1 = time.perf_counter()
        res.stored_chunks = pool.put(tokens, cache_kv(cache))
        res.store_s = time.perf_counter() - t1
    return res
