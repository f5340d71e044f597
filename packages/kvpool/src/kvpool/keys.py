"""Chunk keys: a chained hash over the token prefix, the model and the KV layout.

A request of T tokens is cut into chunks of N tokens (default 256). Chunk i's key hashes chunk i's
tokens together with chunk i-1's key, so a key names the whole prefix up to the end of its chunk;
the model identity and the KV layout (layers, heads, head size, dtype, chunk size) are hashed into
the first link, so KV from another model or layout can never match. The longest cached prefix is
the longest run of leading keys present in an index, found in one pass (``longest_prefix``).
Only full chunks get keys: a trailing partial chunk is always recomputed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DEFAULT_CHUNK_TOKENS", "KVLayout", "ChunkKey", "chunk_keys", "longest_prefix", "unit_name"]

DEFAULT_CHUNK_TOKENS = 256
_DIGEST = 16  # bytes of blake2b output: 128-bit keys


@dataclass(frozen=True)
class KVLayout:
    """Shape of one chunk's KV: per layer, K and V of ``[kv_heads, chunk_tokens, head_dim]``."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "chunk_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive integer, not {v!r}")
        if self.dtype not in _ELEMENT_SIZE:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_ELEMENT_SIZE)}, not {self.dtype!r}")

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZE[self.dtype]

    @property
    def unit_bytes(self) -> int:
        """Bytes of one (chunk, layer) unit: K and V of one layer for one chunk."""
        return 2 * self.kv_heads * self.chunk_tokens * self.head_dim * self.element_size

    @property
    def chunk_bytes(self) -> int:
        return self.unit_bytes * self.num_layers

    def tag(self) -> str:
        return f"L{self.num_layers}-H{self.kv_heads}-D{self.head_dim}-{self.dtype}-N{self.chunk_tokens}"

    @classmethod
    def from_config(cls, config, dtype: str = "float32", chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> KVLayout:
        """Layout of a transformers decoder config (LlamaConfig and the like)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, int(kv_heads), int(head_dim), dtype, chunk_tokens)


_ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class ChunkKey:
    """Key of chunk ``index`` (tokens ``[index*N, (index+1)*N)``) of a request."""

    index: int
    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def __str__(self) -> str:
        return self.hex


def _root(model_id: str, layout: KVLayout) -> bytes:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, not {model_id!r}")
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvpool-root")
    h.update(model_id.encode())
    h.update(b"\0")
    h.update(layout.tag().encode())
    return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as e:
        raise ValueError(f"tokens must be integers in the int64 range ({e})") from None


def chunk_keys(tokens: Sequence[int], model_id: str, layout: KVLayout) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens`` (a list, tuple, 1-D tensor or array of token ids)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if tokens and isinstance(tokens[0], list):
        raise ValueError("tokens must be 1-D (one request); got a nested sequence")
    n = layout.chunk_tokens
    prev = _root(model_id, layout)
    keys = []
    for i in range(len(tokens) // n):
        h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvpool-chunk")
        h.update(prev)
        h.update(_token_bytes(tokens[i * n : (i + 1) * n]))
        prev = h.digest()
        keys.append(ChunkKey(i, prev))
    return keys


class KeyIndex(Protocol):
    """Anything that answers ``hex in index``: a set or dict of hex keys, a Placement."""

    def __contains__(self, key: str, /) -> bool: ...


def longest_prefix(keys: Sequence[ChunkKey], index: KeyIndex | Callable[[str], bool]) -> int:
    """Number of leading keys present in ``index`` (a set/dict of hex keys, or a predicate)."""
    present = index if callable(index) else index.__contains__
    n = 0
    for k in keys:
        if not present(k.hex):
            break
        n += 1
    return n


def unit_name(key: ChunkKey | str, layer: int) -> str:
    """Store name of one (chunk, layer) unit."""
    return f"{key if isinstance(key, str) else key.hex}.{layer}"
