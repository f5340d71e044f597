"""Parallel, layer-wise retrieval: one reader thread per device into preallocated tensors.

Every device reads its own chunks (as placed by ``placement``) layer by layer: all of its layer-0
units, then layer 1, and so on. A layer is ready when every device has finished it, so the model
can compute layer 0 of the uncached suffix while later layers are still on their way. Reads use
``os.preadv`` (O_DIRECT) or tensor copies, both of which release the GIL, so the threads overlap.
A unit that fails its checks marks its chunk as lost: ``valid_tokens`` then says how much of the
prefix is intact, and the caller recomputes the rest (never wrong KV).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import wait

import torch

from .keys import ChunkKey, KVLayout, unit_name
from .numa import pin_thread_to_node

__all__ = ["LayerwiseLoad", "KVBuffers", "TORCH_DTYPES"]

log = logging.getLogger(__name__)
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class KVBuffers:
    """Preallocated, pre-touched destination tensors: per layer K and V of ``[1, H, capacity, D]``.

    Reusing one set across requests keeps page faults (the kernel zeroing fresh pages) out of the
    retrieval; the caller must be done with the previous request's KV before reusing it.
    """

    def __init__(self, layout: KVLayout, capacity_tokens: int):
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (1, layout.kv_heads, capacity_tokens, layout.head_dim)
        self.capacity_tokens = capacity_tokens
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]

    def fits(self, layout: KVLayout, tokens: int) -> bool:
        return (
            tokens <= self.capacity_tokens
            and len(self.k) == layout.num_layers
            and self.k[0].shape[1] == layout.kv_heads
            and self.k[0].shape[3] == layout.head_dim
            and self.k[0].dtype == TORCH_DTYPES[layout.dtype]
        )


class LayerwiseLoad:
    """A retrieval in flight: ``wait(layer)`` returns that layer's (K, V) once every device has it."""

    def __init__(
        self,
        stores: dict,
        layout: KVLayout,
        keys: Sequence[ChunkKey],
        placement: dict[str, str],
        staging: dict | None = None,
        extra_tokens: int = 0,
        readers: dict[str, int] | None = None,
        out: KVBuffers | None = None,
        on_done=None,
    ):
        self.layout = layout
        self.keys = list(keys)
        self.tokens = len(self.keys) * layout.chunk_tokens
        L, H, D = layout.num_layers, layout.kv_heads, layout.head_dim
        dtype = TORCH_DTYPES[layout.dtype]
        # preallocated with room for ``extra_tokens`` more (the suffix the model computes next)
        cap = self.tokens + max(0, extra_tokens)
        if out is not None and out.fits(layout, cap):
            self.kbuf, self.vbuf = out.k, out.v
        else:
            self.kbuf = [torch.empty(1, H, cap, D, dtype=dtype) for _ in range(L)]
            self.vbuf = [torch.empty(1, H, cap, D, dtype=dtype) for _ in range(L)]
        self.k = [b[:, :, : self.tokens] for b in self.kbuf]
        self.v = [b[:, :, : self.tokens] for b in self.vbuf]
        per_dev: dict[str, list[tuple[int, ChunkKey]]] = {}
        for i, k in enumerate(self.keys):
            per_dev.setdefault(placement[k.hex], []).append((i, k))
        self.groups = per_dev
        # ``readers[kind]`` threads per device (queue depth); each takes a contiguous run of the
        # device's chunks, whose units of one layer the pool wrote next to each other in the slab
        readers = readers or {}
        groups: dict[tuple[str, int], list[tuple[int, ChunkKey]]] = {}
        for d, g in per_dev.items():
            r = max(1, min(len(g), int(readers.get(getattr(stores[d], "kind", ""), 1))))
            for j in range(r):
                groups[(d, j)] = g[j * len(g) // r : (j + 1) * len(g) // r]
        self.ready = [threading.Event() for _ in range(L)]
        self._left = [len(groups)] * L
        self._lock = threading.Lock()
        self._threads_left = len(groups)
        self._on_done = on_done
        self.lost: set[int] = set()
        self.device_bytes = {d: 0 for d in per_dev}
        self.device_s = {d: 0.0 for d in per_dev}
        self.blocked_s = 0.0
        self.errors: list[str] = []
        self.t_start = time.perf_counter()
        self.t_done: float | None = None
        staging = staging or {}
        self.threads = [
            threading.Thread(
                target=self._worker,
                args=(stores[d], d, g, staging.get(d) if j == 0 else None),
                name=f"kvpool-read-{d}-{j}",
                daemon=True,
            )
            for (d, j), g in groups.items()
        ]
        if not groups:
            for e in self.ready:
                e.set()
            self.t_done = self.t_start
            if on_done is not None:
                on_done()
        for t in self.threads:
            t.start()

    def _staging_sets(self, store, count: int, staging) -> tuple[list[list], list]:
        """Staging for ``count`` units: two sets where the store reads ahead (layer l+1 lands in
        one while layer l is copied out of the other), else one; and the functions handing them back.

        An SSD lends its reused buffers (``chunk_staging``): a fresh mapping per request would
        have the kernel map and zero its pages during the retrieval, on every request.
        """
        ub = self.layout.unit_bytes
        later = getattr(store, "read_many_later", None)
        lend = getattr(store, "chunk_staging", None)
        sets, releases = [], []
        for _ in range(2 if later is not None else 1):
            if lend is not None:
                parts, release = lend(ub, count)
                sets.append(list(parts))
                releases.append(release)
            else:
                sets.append([store.staging(ub) for _ in range(count)])
        if staging is not None and count:
            sets[0][0] = staging  # the caller's own buffer for the first unit
        return sets, releases

    def _worker(self, store, dev: str, group: list[tuple[int, ChunkKey]], staging) -> None:
        later = getattr(store, "read_many_later", None)
        sets, releases = self._staging_sets(store, len(group), staging)
        pin_thread_to_node(getattr(store, "numa_node", None))  # a memory module's reader on its node
        t0 = time.perf_counter()
        L = self.layout.num_layers
        pending: list[tuple] = []

        def issue(layer: int) -> tuple:
            todo = [(j, i, key) for j, (i, key) in enumerate(group) if i not in self.lost]
            names = [unit_name(key, layer) for _, _, key in todo]
            bufs = [sets[layer % len(sets)][j] for j, _, _ in todo]
            return todo, (later(names, bufs) if later is not None else None), names, bufs

        try:
            # with read-ahead, two layers are in flight before the first is waited for, and layer
            # l+2 goes out as soon as layer l is copied out of its set: the disk has the next read
            # queued even while this thread waits to be scheduled again (a busy CPU), where one in
            # flight left it idle from the end of a read until this thread had issued the next
            pending.extend(issue(layer) for layer in range(min(2, L)))
            for layer in range(L):
                todo, fut, names, bufs = pending.pop(0)
                try:
                    views = fut.result() if fut is not None else store.read_many(names, bufs)
                except Exception as e:  # a broken device must not hang the request
                    self.errors.append(f"{dev}: {e}")
                    views = [None] * len(todo)
                self._copy_layer(dev, layer, todo, views)
                if layer + 2 < L:
                    pending.append(issue(layer + 2))  # into the set just copied out
                self._layer_done(layer)
        finally:
            wait([p[1] for p in pending if p[1] is not None])  # reads in flight land before their buffers go back
            for release in releases:
                release()
            with self._lock:
                self.device_s[dev] = max(self.device_s[dev], time.perf_counter() - t0)
            self._finish_thread()

    def _copy_layer(self, dev: str, layer: int, todo: list, views: list) -> None:
        """Copy one layer's checked units into K and V; a unit missing or failing marks its chunk lost."""
        n, H, D = self.layout.chunk_tokens, self.layout.kv_heads, self.layout.head_dim
        dtype = TORCH_DTYPES[self.layout.dtype]
        for (_, i, _key), view in zip(todo, views):
            if i in self.lost:  # lost in an earlier layer after this read was already issued
                continue
            if view is None or view.numel() != self.layout.unit_bytes:
                self.lost.add(i)
                continue
            unit = view.view(dtype).view(2, H, n, D)
            self.k[layer][0, :, i * n : (i + 1) * n].copy_(unit[0])
            self.v[layer][0, :, i * n : (i + 1) * n].copy_(unit[1])
            with self._lock:
                self.device_bytes[dev] += view.numel()

    def _layer_done(self, layer: int) -> None:
        with self._lock:
            self._left[layer] -= 1
            if self._left[layer] == 0:
                self.ready[layer].set()

    def _finish_thread(self) -> None:
        with self._lock:
            self._threads_left -= 1
            last = self._threads_left == 0
            if last:
                self.t_done = time.perf_counter()
                for e in self.ready:  # a worker that died early must not leave waiters hanging
                    e.set()
        if last and self._on_done is not None:
            self._on_done()  # e.g. the pool unpins the chunks this load was reading

    def wait(self, layer: int, timeout: float | None = 600.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until layer ``layer`` is loaded on every device; returns its (K, V) ``[1, H, T, D]``."""
        t0 = time.perf_counter()
        if not self.ready[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} of the cached prefix did not load within {timeout} s")
        self.blocked_s += time.perf_counter() - t0
        return self.k[layer], self.v[layer]

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The preallocated (K, V) of ``layer`` with room for the suffix: ``[1, H, tokens + extra, D]``."""
        return self.kbuf[layer], self.vbuf[layer]

    def join(self, timeout: float | None = 600.0) -> LayerwiseLoad:
        for layer in range(self.layout.num_layers):
            self.wait(layer, timeout)
        for t in self.threads:
            t.join(timeout)
        if self.t_done is None:
            self.t_done = time.perf_counter()
        return self

    @property
    def valid_tokens(self) -> int:
        """Tokens of the prefix whose KV is intact (all layers): up to the first lost chunk."""
        first = min(self.lost) if self.lost else len(self.keys)
        return first * self.layout.chunk_tokens

    @property
    def elapsed_s(self) -> float:
        return (self.t_done or time.perf_counter()) - self.t_start

    @property
    def bytes_read(self) -> int:
        return sum(self.device_bytes.values())

    def describe(self) -> dict:
        return {
            "tokens": self.tokens,
            "valid_tokens": self.valid_tokens,
            "bytes": self.bytes_read,
            "elapsed_s": self.elapsed_s,
            "blocked_s": self.blocked_s,
            "per_device": {
                d: {
                    "chunks": len(self.groups[d]),
                    "bytes": self.device_bytes[d],
                    "seconds": self.device_s[d],
                    "bytes_per_s": self.device_bytes[d] / self.device_s[d] if self.device_s[d] else None,
                }
                for d in self.groups
            },
        }
