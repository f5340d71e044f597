"""LLaDA-style decoding: block-wise semi-autoregressive, confidence-based iterative unmasking.

The answer region starts fully masked; it is split into blocks decoded left to right; inside a
block each step predicts every masked position and unmasks the most confident ones (the number per
step is fixed by ``steps``). How the logits of a step are computed is the *cache mode*:

``none``          plain bidirectional forward over the whole sequence every step;
``naive``         autoregressive-style prefix cache: all layers' prefix K/V reused, never refreshed
                  (a transformers ``DynamicCache`` through the model's own forward);
``bicache``       layers ``< depth`` reuse the shared prefix's K/V, deeper layers recompute;
``block``         Fast-dLLM style: a full forward refreshes every K/V at the start of each block,
                  the other steps compute the current block only (dual cache);
``bicache+block`` the block refreshes themselves reuse the shared prefix in layers ``< depth``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from . import kvcache
from .kvcache import PrefixEntry
from .model import DiffusionLM

DECODE_MODES = ("none", "naive", "bicache", "block", "bicache+block")  # how one decode computes logits


@dataclass(frozen=True)
class DecodeConfig:
    """Generation length, block length and total denoising steps."""

    gen_length: int = 4
    block_length: int = 2
    steps: int = 4

    def validate(self) -> None:
        if self.gen_length <= 0:
            raise ValueError(f"gen_length must be positive, got {self.gen_length}")
        if self.block_length <= 0 or self.gen_length % self.block_length:
            raise ValueError(
                f"block_length ({self.block_length}) must be positive and divide gen_length ({self.gen_length})"
            )
        blocks = self.gen_length // self.block_length
        if self.steps <= 0 or self.steps % blocks or self.steps // blocks > self.block_length:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of the {blocks} blocks and at most gen_length ({self.gen_length})"
            )

    def schedule(self) -> list[int]:
        """Tokens unmasked at each step of a block (spread evenly)."""
        per_block = self.steps // (self.gen_length // self.block_length)
        base, extra = divmod(self.block_length, per_block)
        return [base + (1 if i < extra else 0) for i in range(per_block)]


@dataclass
class DecodeStats:
    forwards: int = 0
    tokens_computed: int = 0  # token-layer products computed over the batch (a FLOP proxy)
    entry: PrefixEntry | None = None  # the prefix entry filled by this call (``fill_prefix``)


def naive_logits(dlm: DiffusionLM, x: torch.Tensor, entry: PrefixEntry, cache: Cache | None = None) -> torch.Tensor:
    """The AR-engine prefix cache: the model's forward of the suffix on a DynamicCache holding the prefix.

    ``cache``: instead of a fresh DynamicCache, a splice cache from an earlier step of the same
    batch (``kvcache.prefix_cache(dlm, entry, N)``) to reuse its buffers.
    """
    b, p = x.shape[0], entry.length
    if cache is None:
        # every layer a full DynamicLayer, sliding-window ones included: bicache's masks apply the
        # bidirectional window, which a suffix query's window over the prefix needs from both sides
        cache = DynamicCache()
        for i in range(dlm.num_layers):
            cache.update(entry.keys[i].expand(b, -1, -1, -1), entry.values[i].expand(b, -1, -1, -1), i)
    return kvcache.forward(dlm, x, cache, start=p, depth=dlm.num_layers, logits_from=p)


def _check_request(dlm: DiffusionLM, prompts: torch.Tensor, cfg: DecodeConfig, mode: str) -> None:
    """Reject an unknown mode, a bad config or prompts that do not fit the model, before any compute."""
    if mode not in DECODE_MODES:
        raise ValueError(f"mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    cfg.validate()
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError("prompts must be a non-empty (batch, length) tensor of token ids")
    tp = prompts.shape[1]
    if tp + cfg.gen_length > dlm.max_length:
        raise ValueError(
            f"prompt ({tp}) + gen_length ({cfg.gen_length}) exceeds the model's {dlm.max_length} positions"
        )


def _check_prefix(
    dlm: DiffusionLM, prompts: torch.Tensor, mode: str, entry: PrefixEntry | None, fill_prefix: int
) -> None:
    """Reject a prefix mode's fill length or entry unless it is a true prefix of every prompt, for this model."""
    tp = prompts.shape[1]
    if entry is None and fill_prefix > 0:
        if not 0 < fill_prefix < tp:
            raise ValueError(f"fill_prefix must lie in (0, {tp}), got {fill_prefix}")
        return
    if entry is None:
        raise ValueError(f"mode {mode!r} needs a prefix entry")
    if entry.model_id and entry.model_id != id(dlm.model):
        raise ValueError("the prefix entry was built by another model; mismatched cache and model")
    want = torch.tensor(entry.tokens, dtype=prompts.dtype)
    if entry.length >= tp or (prompts[:, : entry.length] != want).any():
        raise ValueError("the prefix entry's tokens are not a prefix of every prompt in the batch")


def _fill_entry(dlm: DiffusionLM, first: torch.Tensor, p: int, stats: DecodeStats) -> PrefixEntry:
    """The entry for the first ``p`` tokens, from one full forward of ``first`` (the batch's first row)."""
    total = first.shape[1]
    cache = kvcache.prefix_cache(dlm, None, 0, record=True)
    hidden: list[torch.Tensor] = []
    kvcache.forward(dlm, first, cache=cache, logits_from=total, hidden_out=hidden)
    stats.forwards += 1
    stats.tokens_computed += dlm.num_layers * total
    return kvcache.entry_from(dlm, first, cache, hidden, p)


def generate(
    dlm: DiffusionLM,
    prompts: torch.Tensor,
    cfg: DecodeConfig = DecodeConfig(),
    mode: str = "none",
    depth: int = 0,
    entry: PrefixEntry | None = None,
    stats: DecodeStats | None = None,
    fill_prefix: int = 0,
) -> torch.Tensor:
    """Decode ``cfg.gen_length`` tokens for a batch of equal-length prompts; returns the answers.

    With ``fill_prefix > 0`` and no ``entry``, a prefix mode first runs the batch's first request
    alone through the full forward (its answer still masked) and fills the entry for the first
    ``fill_prefix`` tokens from it (``stats.entry``), as a serving engine prefills a new prefix once
    for the first request that brings it; every row of the batch then decodes with reuse from its
    first step (one request's full forward instead of the whole batch's). The depth calibration
    fills its entries the same way.
    """
    _check_request(dlm, prompts, cfg, mode)
    b, tp = prompts.shape
    total = tp + cfg.gen_length
    uses_prefix = mode in ("naive", "bicache", "bicache+block")
    if uses_prefix:
        _check_prefix(dlm, prompts, mode, entry, fill_prefix)
    if mode == "naive":
        depth = dlm.num_layers
    if not 0 <= depth <= dlm.num_layers:
        raise ValueError(f"depth must lie in [0, {dlm.num_layers}], got {depth}")
    stats = stats or DecodeStats()
    n = dlm.num_layers
    p = (entry.length if entry is not None else fill_prefix) if uses_prefix else 0
    x = torch.cat([prompts, torch.full((b, cfg.gen_length), dlm.mask_id, dtype=prompts.dtype)], dim=1)
    block_mode = mode in ("block", "bicache+block")
    reuse: Cache | None = None  # the prefix splice cache, built once per batch: its buffers hold the prefix K/V
    with torch.no_grad():
        if uses_prefix and entry is None:  # the batch brings a new prefix: its first request fills the entry
            entry = stats.entry = _fill_entry(dlm, x[:1], p, stats)
        for blk in range(cfg.gen_length // cfg.block_length):
            b0 = tp + blk * cfg.block_length
            b1 = b0 + cfg.block_length
            recorded = None
            for step, k in enumerate(cfg.schedule()):
                if mode == "none" or (mode == "block" and step == 0):
                    cache = kvcache.prefix_cache(dlm, None, 0, record=block_mode)
                    logits = kvcache.forward(dlm, x, cache=cache, logits_from=b0, end=total)
                    stats.tokens_computed += b * n * total
                    recorded = cache
                elif mode == "naive":
                    assert entry is not None  # a prefix mode has its entry, given or filled above
                    if reuse is None and "sliding_attention" in dlm.layer_types:
                        reuse = kvcache.prefix_cache(dlm, entry, n)
                    logits = naive_logits(dlm, x, entry, reuse)[:, b0 - p :]
                    stats.tokens_computed += b * n * (total - p)
                elif mode == "bicache" or (mode == "bicache+block" and step == 0):
                    assert entry is not None  # a prefix mode has its entry, given or filled above
                    if reuse is None:
                        reuse = kvcache.prefix_cache(dlm, entry, depth, record=block_mode)
                    cache = reuse
                    hid = entry.hidden[depth] if 0 < depth < n else None
                    start = p if depth > 0 else 0
                    logits = kvcache.forward(dlm, x, cache, start=start, depth=depth, prefix_hidden=hid, logits_from=b0)
                    stats.tokens_computed += b * (depth * (total - start) + (n - depth) * total)
                    recorded = cache
                else:  # a block-cache step inside the block
                    assert recorded is not None  # step 0 of the block recorded its cache
                    cache = kvcache.block_cache(recorded, b0)
                    logits = kvcache.forward(dlm, x, cache, start=b0, end=b1, logits_from=b0)
                    stats.tokens_computed += b * n * (b1 - b0)
                stats.forwards += 1
                _unmask(x, logits[:, : b1 - b0], b0, k, dlm.mask_id)
    return x[:, tp:]


def _unmask(x: torch.Tensor, logits: torch.Tensor, b0: int, k: int, mask_id: int) -> None:
    """Unmask the ``k`` most confident masked positions of the block, in place."""
    probs = torch.softmax(logits.float(), dim=-1)
    probs[..., mask_id] = 0.0
    conf, pred = probs.max(dim=-1)
    blockx = x[:, b0 : b0 + logits.shape[1]]
    masked = blockx == mask_id
    conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
    k = min(k, logits.shape[1])
    top = conf.topk(k, dim=-1).indices
    chosen = torch.zeros_like(masked)
    chosen.scatter_(1, top, True)
    chosen &= masked
    blockx[chosen] = pred[chosen]
