"""Indexed prefix store and bounded latency statistics for the serving engine.

:class:`PrefixStore` keeps :class:`~bicache.kvcache.PrefixEntry` objects in a radix tree (a trie
whose edges carry token runs), so the longest stored prefix of a batch is found in one walk down
the first prompt, in time proportional to the prompt, however many entries are stored. Byte
accounting is a running total updated on add and evict; eviction is least recently used.

:class:`Reservoir` keeps a uniform sample of at most ``capacity`` values (exact count, mean and
maximum), so a long-running server's latency percentiles use bounded memory.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Sequence

from .kvcache import PrefixEntry

log = logging.getLogger(__name__)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Node:
    """A radix-tree node: the edge from its parent carries ``label`` (never empty below the root)."""

    __slots__ = ("children", "entry", "label", "parent")

    def __init__(self, label: tuple[int, ...], parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: PrefixEntry | None = None


class PrefixStore:
    """Token-prefix -> entry radix tree with longest-match lookup and LRU eviction by bytes.

    ``entries`` lists the stored entries by token tuple, least recently used first. The store never
    holds more than ``capacity_bytes``: an entry larger than the whole budget is not stored.
    """

    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an integer >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._root = _Node((), None)
        self._nodes: dict[tuple[int, ...], tuple[_Node, int]] = {}  # tokens -> (its node, its bytes)
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, tokens: object) -> bool:
        return tokens in self.entries

    def nbytes(self) -> int:
        """Bytes held by the stored entries (a running total, not a re-sum)."""
        return self._bytes

    def lookup(self, prompts: Sequence[Sequence[int]]) -> PrefixEntry | None:
        """The longest stored prefix shared by every prompt (and shorter than each)."""
        entry = self.longest(prompts)
        if entry is not None:
            self.entries.move_to_end(entry.tokens)
            entry.hits += 1
            self.hits += 1
        else:
            self.misses += 1
        return entry

    def longest(self, prompts: Sequence[Sequence[int]]) -> PrefixEntry | None:
        """:meth:`lookup` without touching recency or hit counts."""
        if not prompts:
            return None
        first = prompts[0]
        limit = min(len(p) for p in prompts) - 1  # an entry must leave each prompt a token of its own
        for p in prompts[1:]:
            limit = min(limit, common_prefix_len(first, p))
        node, depth, best = self._root, 0, None
        while True:
            if node.entry is not None:
                best = node.entry
            if depth >= limit:
                return best
            child = node.children.get(first[depth])
            if child is None:
                return best
            end = depth + len(child.label)
            # a child reaching past the limit holds only entries too long for this batch
            if end > limit or tuple(first[depth:end]) != child.label:
                return best
            node, depth = child, end

    def add(self, entry: PrefixEntry) -> bool:
        """Store ``entry`` as the most recent, evicting the least recent ones over the budget.

        False (nothing stored, nothing evicted) when the entry alone exceeds ``capacity_bytes``.
        """
        tokens = tuple(entry.tokens)
        if not tokens:
            raise ValueError("a prefix entry needs at least one token; got an empty token tuple")
        size = entry.nbytes()
        if size > self.capacity_bytes:
            log.info(
                "prefix of %d tokens (%d bytes) exceeds the store's %d bytes: not stored",
                len(tokens),
                size,
                self.capacity_bytes,
            )
            return False
        if tokens in self.entries:
            self._remove(tokens)
        node = self._insert(tokens)
        node.entry = entry
        self.entries[tokens] = entry
        self._nodes[tokens] = (node, size)
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            oldest = next(iter(self.entries))  # never the new entry: it alone fits the budget
            self._remove(oldest)
            self.evictions += 1
        return True

    def _insert(self, tokens: tuple[int, ...]) -> _Node:
        """The node for ``tokens``, creating it (and splitting an edge) where needed."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                node.children[tokens[i]] = leaf
                return leaf
            m = common_prefix_len(child.label, tokens[i : i + len(child.label)])
            if m < len(child.label):  # the new prefix ends or branches inside the edge: split it
                mid = _Node(child.label[:m], node)
                node.children[tokens[i]] = mid
                child.label = child.label[m:]
                child.parent = mid
                mid.children[child.label[0]] = child
                child = mid
            node, i = child, i + m
        return node

    def _remove(self, tokens: tuple[int, ...]) -> None:
        """Drop the entry for ``tokens`` and the tree nodes nothing needs any more."""
        node, size = self._nodes.pop(tokens)
        del self.entries[tokens]
        self._bytes -= size
        node.entry = None
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.label[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            # a pass-through node: fold it into its only child to keep the tree compressed
            (child,) = node.children.values()
            child.label = node.label + child.label
            child.parent = node.parent
            node.parent.children[child.label[0]] = child

    def node_count(self) -> int:
        """Tree nodes below the root (at most twice the entries: the tree stays compressed)."""
        stack, n = list(self._root.children.values()), 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(node.children.values())
        return n


class Reservoir:
    """A uniform random sample of at most ``capacity`` values, with exact count, mean and maximum.

    Vitter's algorithm R: the i-th value replaces a random kept one with probability capacity / i,
    so every value seen so far is kept with the same probability. Quantiles are exact while fewer
    than ``capacity`` values have been added.
    """

    def __init__(self, capacity: int = 4096, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.samples: list[float] = []
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return self.count

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.max = max(self.max, value) if self.count > 1 else value
        if len(self.samples) < self.capacity:
            self.samples.append(value)
            return
        j = self._rng.randrange(self.count)
        if j < self.capacity:
            self.samples[j] = value

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the kept sample (0.0 when empty)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must lie in [0, 1], got {q}")
        kept = sorted(self.samples)
        return kept[min(len(kept) - 1, int(q * len(kept)))] if kept else 0.0

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0
