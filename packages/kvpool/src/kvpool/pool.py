"""The pool: keys + placement + device stores + layer-wise retrieval, behind put/lookup/retrieve.

Plumbing around ``placement`` (which decides) and the stores (which do the I/O): writes a request's
new chunks to the devices placement chose (one writer thread per device), deletes what it
evicted, moves what it promotes, takes failed devices out with a warning, and re-adopts the
chunks an SSD's index still holds after a restart.

A chunk being written or moved is held: lookups and reads miss it and eviction skips it until
every unit is stored, so a reader never sees half a chunk and never deletes one in flight. Writers
of one key take turns (the second waits for the first, then finds the chunk stored), and the first
writer wins: ``put_chunk`` with other bytes for a stored key raises ``ChunkConflict``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .keys import ChunkKey, KVLayout, chunk_keys, longest_prefix, unit_name
from .placement import DeviceInfo, Placement
from .retrieval import TORCH_DTYPES, KVBuffers, LayerwiseLoad

__all__ = ["KVPool", "ChunkConflict", "ChunkBytes"]

log = logging.getLogger(__name__)


def _nothing() -> None:
    """A release that has nothing to hand back."""


def _put_units(store, items: list[tuple[str, torch.Tensor]]) -> bool:
    """All of ``items`` stored on ``store``: in one contiguous extent where the store can, else one by one."""
    put_many = getattr(store, "put_many", None)
    if put_many is not None:
        return bool(put_many(items))
    return all(store.put(name, data) for name, data in items)


class _PinnedSender:
    """Copies each checked layer into one of two pinned host buffers and on to the device without
    blocking; a buffer is reused only once its previous copy to the device has finished. Calls may
    come from several read-ahead threads: they take turns."""

    def __init__(self, dest: torch.Tensor, unit_bytes: int):
        self.dest = dest
        self.pinned = [torch.empty(unit_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list = [None, None]
        self.lock = threading.Lock()

    def __call__(self, layer: int, view: torch.Tensor) -> None:
        with self.lock:
            self._send(layer, view)

    def _send(self, layer: int, view: torch.Tensor) -> None:
        slot = layer % 2
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        self.pinned[slot].copy_(view)
        self.dest[layer].copy_(self.pinned[slot], non_blocking=True)
        self.events[slot] = torch.cuda.Event()
        self.events[slot].record()


class ChunkConflict(ValueError):
    """A chunk key is already stored with other bytes: the first writer of a key wins."""


class ChunkBytes:
    """A chunk as read from its device: ``parts``, one uint8 view per layer in layer order.

    The views point into the store's staging buffer (an SSD) or its arena (a memory module); the
    chunk stays pinned (never evicted or moved) until ``release``, so a server can send the views
    as they are, without copying them into one buffer first.
    """

    def __init__(self, parts: list[torch.Tensor], release: Callable[[], None]):
        self.parts = parts
        self._release: Callable[[], None] | None = release

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def release(self) -> None:
        """Hand the staging buffer back and unpin the chunk (once; later calls do nothing)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> ChunkBytes:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KVPool:
    """One logical KV pool over memory modules and SSDs for one model and KV layout."""

    def __init__(
        self,
        stores: Sequence,
        layout: KVLayout,
        model_id: str,
        bandwidths: dict[str, float],
        latencies: dict[str, float] | None = None,
        promote_after: int = 2,
        promote: bool = True,
        ssd_readers: int = 1,
    ):
        if not stores:
            raise ValueError("KVPool needs at least one device store")
        self.layout = layout
        self.model_id = model_id
        self.stores = {s.name: s for s in stores}
        missing = [s.name for s in stores if s.name not in bandwidths]
        if missing:
            raise ValueError(f"bandwidths: no read bandwidth given for device(s) {missing}")
        latencies = latencies or {}
        self.placement = Placement(
            [
                DeviceInfo(
                    s.name,
                    s.kind,
                    float(bandwidths[s.name]),
                    int(s.capacity_bytes),
                    float(latencies.get(s.name, 0.0)),
                    int(s.align_bytes),
                    int(s.unit_overhead_bytes),
                )
                for s in stores
            ],
            promote_after=promote_after,
        )
        self.promote = promote
        # one reader per SSD: it reads a layer's adjacent units in one request while the next
        # layer's is already in flight (read-ahead); a second reader only splits that request
        self.readers = {"ssd": max(1, ssd_readers), "memory": 1}
        self.counters = {"lookups": 0, "hit_tokens": 0, "miss_tokens": 0, "chunks_stored": 0, "promotions": 0}
        self.counters.update({"evictions": 0, "lost_chunks": 0, "failed_writes": 0, "unplaced_chunks": 0})
        self.counters["conflicts"] = 0
        self.warnings: list[str] = []
        # guards placement decisions, pins and the writing state together
        self._lock = threading.RLock()
        self._written = threading.Condition(self._lock)  # notified when a held chunk is committed or dropped
        self._pins: Counter[str] = Counter()  # chunks being read: never evicted or moved meanwhile
        self._adopt()

    # --- restart -------------------------------------------------------------------------------
    def _adopt(self) -> None:
        """Chunks whose every layer is intact on one SSD come back into the pool after a restart."""
        L, ub = self.layout.num_layers, self.layout.unit_bytes
        for name, store in self.stores.items():
            units = store.names()
            chunks: dict[str, int] = {}
            for u, n in units.items():
                hx, _, layer = u.rpartition(".")
                if n == ub and layer.isdigit() and int(layer) < L:
                    chunks[hx] = chunks.get(hx, 0) + 1
            for hx, cnt in chunks.items():
                if cnt == L and self.placement.adopt(hx, self.layout.chunk_bytes, L, name):
                    continue
                for layer in range(L):
                    store.delete(unit_name(hx, layer))

    # --- keys and lookup -----------------------------------------------------------------------
    def keys(self, tokens) -> list[ChunkKey]:
        return chunk_keys(tokens, self.model_id, self.layout)

    def lookup(self, tokens, keys: Sequence[ChunkKey] | None = None) -> int:
        """Tokens of the longest cached prefix of ``tokens`` (a multiple of the chunk size)."""
        keys = self.keys(tokens) if keys is None else keys
        return longest_prefix(keys, self.placement) * self.layout.chunk_tokens

    # --- writing -------------------------------------------------------------------------------
    def put(self, tokens, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Store the full chunks of ``tokens`` not yet in the pool. ``kv``: per layer (K, V) of ``[1, H, >=T, D]``.

        Returns the number of chunks stored. Chunks that cannot be written (device full or failed)
        are left out, never half-stored; a chunk another writer is storing right now is left to it.
        Chunks already present are kept as they are (first writer wins; recomputed KV may differ
        from the stored one in the last bits).
        """
        L = self.layout.num_layers
        if len(kv) != L:
            raise ValueError(f"kv: expected {L} layers of (K, V), got {len(kv)}")
        keys = self.keys(tokens)
        dtype = TORCH_DTYPES[self.layout.dtype]
        want = (1, self.layout.kv_heads, self.layout.head_dim)
        for i, (k_layer, v_layer) in enumerate(kv):
            for name, t in (("K", k_layer), ("V", v_layer)):
                if (t.shape[0], t.shape[1], t.shape[3]) != want or t.shape[2] < len(keys) * self.layout.chunk_tokens:
                    raise ValueError(
                        f"kv[{i}] {name}: shape {tuple(t.shape)} does not match the layout "
                        f"[1, {want[1]}, >= {len(keys) * self.layout.chunk_tokens}, {want[2]}]"
                    )
                if t.dtype != dtype:
                    raise ValueError(f"kv[{i}] {name}: dtype {t.dtype} does not match the layout's {self.layout.dtype}")
        with self._lock:
            present = [k.hex for k in keys if k.hex in self.placement]
            new = [k for k in keys if self.placement.state(k.hex) is None]
            plan = self._reserve([k.hex for k in new], present)
        by_dev: dict[str, list[ChunkKey]] = {}
        for k in new:
            if k.hex in plan.assign:
                by_dev.setdefault(plan.assign[k.hex], []).append(k)
        n = self.layout.chunk_tokens

        def write(dev: str, ks: list[ChunkKey]) -> int:
            # layer-major: a layer's units of consecutive chunks end up adjacent in the slab, so a
            # reader fetches them with one preadv
            store, failed, finished = self.stores[dev], set(), False
            try:
                for layer, (k, v) in enumerate(kv):
                    for key in ks:
                        if key.hex in failed:
                            continue
                        s, e = key.index * n, (key.index + 1) * n
                        unit = torch.stack([k[0, :, s:e], v[0, :, s:e]]).contiguous()
                        if not store.put(unit_name(key, layer), unit):
                            failed.add(key.hex)
                            if getattr(store, "failed", None) is not None:
                                failed.update(x.hex for x in ks)  # the device is gone: stop writing to it
                finished = True
            finally:
                hexes = [x.hex for x in ks]
                done = self._finish_writes(dev, hexes, failed if finished else set(hexes))
            if getattr(store, "failed", None) is not None:
                self._fail_device(dev, store.failed)
            return done

        with ThreadPoolExecutor(max_workers=max(1, len(by_dev))) as ex:
            stored = sum(ex.map(lambda item: write(*item), by_dev.items()))
        with self._lock:
            self.counters["chunks_stored"] += stored
        return stored

    def _reserve(self, hexes: Sequence[str], context: Sequence[str]):
        """Place new chunks (held: invisible until written), evicting LRU chunks no one is reading.

        Called with ``_lock`` held, so no reader can pin a chunk between the choice of victims
        and the deletion of their units, and no writer can claim a victim's key in between.
        """
        L = self.layout.num_layers
        plan = self.placement.place(
            [(h, self.layout.chunk_bytes, L) for h in hexes], context=context, protect=self._pins
        )
        self.placement.hold(plan.assign)
        for r in plan.evicted:
            self._delete_units(r.device, r.key)
        self.counters["evictions"] += len(plan.evicted)
        if plan.unplaced:
            self.counters["unplaced_chunks"] += len(plan.unplaced)
            log.info("no room for %d chunk(s) even after eviction (the rest is in use)", len(plan.unplaced))
        return plan

    def _finish_writes(self, dev: str, hexes: Sequence[str], failed: set[str]) -> int:
        """Make the written chunks visible; forget the failed ones and delete what they wrote. Returns chunks made visible."""
        done = 0
        with self._written:
            for hx in hexes:
                if hx not in failed and self.placement.commit(hx, dev):
                    done += 1
                    continue
                # not stored, or its device was taken out meanwhile: nothing of it may stay behind
                self.placement.remove(hx, device=dev, ready=False)
                self._delete_units(dev, hx)
                self.counters["failed_writes"] += 1
            self._written.notify_all()
        return done

    def put_chunk(self, hx: str, chunk: torch.Tensor, context: Sequence[str] = ()) -> bool:
        """Store one chunk given as ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` under key ``hx``.

        ``context``: keys of the same request already stored (they count in the striping balance).
        True once the chunk is stored (readable, and on an SSD journaled); False when no device has
        room. The first writer of a key wins: the same bytes again return True, other bytes raise
        ``ChunkConflict``. A writer of a key another writer is storing waits for it to finish. A
        device that fails during the write is taken out and the chunk goes to another one.
        """
        L, H, n, D = self.layout.num_layers, self.layout.kv_heads, self.layout.chunk_tokens, self.layout.head_dim
        if tuple(chunk.shape) != (L, 2, H, n, D) or chunk.dtype != TORCH_DTYPES[self.layout.dtype]:
            raise ValueError(
                f"chunk: expected shape {(L, 2, H, n, D)} of {self.layout.dtype}, got {tuple(chunk.shape)} of {chunk.dtype}"
            )
        for _ in range(len(self.stores) + 1):
            dev = self._claim(hx, context)
            if dev is None:
                stored = self.get_chunk(hx)
                if stored is None:  # unreadable, dropped by that read: write it again
                    continue
                if stored.view(-1).view(torch.uint8).equal(chunk.contiguous().view(-1).view(torch.uint8)):
                    return True
                with self._lock:
                    self.counters["conflicts"] += 1
                raise ChunkConflict(f"chunk {hx} is already stored with different bytes (the first writer wins)")
            if dev == "":
                return False
            store, ok = self.stores[dev], False
            try:
                ok = _put_units(store, [(unit_name(hx, layer), chunk[layer]) for layer in range(L)])
            finally:
                ok = self._finish_writes(dev, [hx], set() if ok else {hx}) == 1
            if ok:
                with self._lock:
                    self.counters["chunks_stored"] += 1
                return True
            if getattr(store, "failed", None) is None and dev not in self.placement.disabled:
                return False  # the store itself had no room
            if getattr(store, "failed", None) is not None:
                self._fail_device(dev, store.failed)
        return False

    def _claim(self, hx: str, context: Sequence[str]) -> str | None:
        """Wait while another writer holds ``hx``; then None if it is stored, else the device
        reserved for this writer ("" when there is no room)."""
        with self._written:
            while self.placement.state(hx) == "writing":
                self._written.wait(1.0)
            if hx in self.placement:
                return None
            plan = self._reserve([hx], list(context))
            return plan.assign.get(hx, "")

    def pinned(self) -> set[str]:
        with self._lock:
            return {k for k, n in self._pins.items() if n > 0}

    def _unpin(self, hexes: Sequence[str]) -> None:
        with self._lock:
            self._pins.subtract(hexes)
            for h in hexes:
                if self._pins[h] <= 0:
                    del self._pins[h]

    def get_chunk(self, hx: str) -> torch.Tensor | None:
        """One chunk as ``[layers, 2, kv_heads, chunk_tokens, head_dim]``, or None (absent, being written, or failed check)."""
        L, H, n, D = self.layout.num_layers, self.layout.kv_heads, self.layout.chunk_tokens, self.layout.head_dim
        out = torch.empty(L, 2, H, n, D, dtype=TORCH_DTYPES[self.layout.dtype])
        flat = out.view(L, -1).view(torch.uint8)
        # each layer is copied out as soon as it is checked, while later layers are still being read
        got = self.read_chunk(hx, on_unit=lambda layer, view: flat[layer].copy_(view))
        if got is None:
            return None
        got.release()
        return out

    def load_chunk_into(self, hx: str, out: torch.Tensor) -> bool:
        """Load one chunk into ``out`` (``[layers, 2, kv_heads, chunk_tokens, head_dim]``, on the CPU or
        a CUDA device); False when the chunk is not readable (``out`` is then undefined).

        A CUDA ``out`` is filled layer by layer through two pinned host buffers: each layer is
        copied from the store's staging into pinned memory as soon as it passed its check, and sent
        to the device asynchronously while the next one arrives. A CPU ``out`` is filled directly.
        """
        L, H, n, D = self.layout.num_layers, self.layout.kv_heads, self.layout.chunk_tokens, self.layout.head_dim
        dtype = TORCH_DTYPES[self.layout.dtype]
        if tuple(out.shape) != (L, 2, H, n, D) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out: expected a contiguous {(L, 2, H, n, D)} tensor of {self.layout.dtype}, "
                f"got {tuple(out.shape)} of {out.dtype}"
            )
        flat = out.view(L, -1).view(torch.uint8)
        if out.device.type != "cuda":
            got = self.read_chunk(hx, on_unit=lambda layer, view: flat[layer].copy_(view))
        else:
            got = self.read_chunk(hx, on_unit=_PinnedSender(flat, self.layout.unit_bytes))
        if got is None:
            return False
        got.release()
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)  # the last copies were issued without waiting
        return True

    def read_chunk(self, hx: str, on_unit: Callable[[int, torch.Tensor], object] | None = None) -> ChunkBytes | None:
        """A chunk's bytes in its device's staging buffer (release when done), or None like ``get_chunk``.

        All layer units of the chunk are read at once: a chunk stored by ``put_chunk`` sits in one
        extent of its SSD's slab, so one ``preadv`` (or one io_uring submission) fetches it whole;
        a large one goes in pieces, a few in flight at once. ``on_unit(layer, view)`` sees each
        layer as soon as it has passed its check.
        """
        with self._lock:
            dev = self.placement.location(hx)
            if dev is None:
                return None
            self._pins[hx] += 1  # under the lock that eviction decisions take: it cannot go meanwhile
        give_back: Callable[[], None] = _nothing
        try:
            parts, give_back = self._read_units(hx, dev, on_unit)
        except BaseException:
            give_back()
            self._unpin([hx])
            raise
        if parts is None:
            give_back()
            self._unpin([hx])
            return None

        def release() -> None:
            give_back()
            self._unpin([hx])

        return ChunkBytes(parts, release)

    def _read_units(
        self, hx: str, dev: str, on_unit: Callable[[int, torch.Tensor], object] | None = None
    ) -> tuple[list[torch.Tensor] | None, Callable[[], None]]:
        """Every layer unit of ``hx`` on ``dev`` in one ``read_many``; None (and the chunk dropped) when any fails."""
        L, ub = self.layout.num_layers, self.layout.unit_bytes
        store = self.stores[dev]
        stage = getattr(store, "chunk_staging", None)
        stagings, give_back = stage(ub, L) if stage is not None else ([None] * L, _nothing)
        names = [unit_name(hx, layer) for layer in range(L)]
        try:
            views = store.read_many(names, stagings, max_run_bytes=L * (ub + 2 * store.align_bytes), on_unit=on_unit)
        except BaseException:
            give_back()
            raise
        if any(v is None or v.numel() != ub for v in views):
            give_back()
            self._drop_unreadable(dev, hx)
            return None, _nothing
        self.placement.touch([hx])
        return [v for v in views if v is not None], give_back

    def _drop_unreadable(self, dev: str, hx: str) -> None:
        """Forget a chunk a reader found unreadable on ``dev`` (only that copy, never a newer one)."""
        with self._lock:
            if self.placement.remove(hx, device=dev, ready=True) is not None:
                self._delete_units(dev, hx)
                self.counters["lost_chunks"] += 1
        failed = getattr(self.stores[dev], "failed", None)
        if failed is not None:
            self._fail_device(dev, failed)

    def cached_chunks(self, hexes: Sequence[str]) -> int:
        """Leading keys of ``hexes`` present in the pool (the longest cached prefix, in chunks)."""
        n = 0
        for h in hexes:
            if h not in self.placement:
                break
            n += 1
        return n

    def _delete_units(self, dev: str, hx: str) -> None:
        store = self.stores[dev]
        for layer in range(self.layout.num_layers):
            store.delete(unit_name(hx, layer))

    def _fail_device(self, dev: str, why) -> None:
        with self._lock:
            if dev in self.placement.disabled:
                return
            lost = self.placement.disable(dev)
            lost = [r for r in lost if r.ready]  # held ones were never acknowledged; their writers see the failure
            self.counters["lost_chunks"] += len(lost)
            self._written.notify_all()
        msg = f"device {dev} failed ({why}); running without it, {len(lost)} chunk(s) lost and will be recomputed"
        self.warnings.append(msg)
        log.warning("%s", msg)

    # --- reading -------------------------------------------------------------------------------
    def retrieve(
        self,
        tokens,
        max_tokens: int | None = None,
        keys: Sequence[ChunkKey] | None = None,
        extra_tokens: int | None = 0,
        out: KVBuffers | None = None,
    ) -> LayerwiseLoad:
        """Start loading the longest cached prefix (at most ``max_tokens``); returns the load in flight.

        ``extra_tokens``: room to leave after the prefix in the destination tensors (the suffix);
        None leaves room for the rest of ``tokens``. ``out``: reusable destination buffers.
        """
        keys = self.keys(tokens) if keys is None else list(keys)
        with self._lock:
            m = longest_prefix(keys, self.placement)
            if max_tokens is not None:
                m = min(m, max_tokens // self.layout.chunk_tokens)
            hit = keys[:m]
            where: dict[str, str] = {}
            for k in hit:
                dev = self.placement.location(k.hex)
                assert dev is not None  # longest_prefix found it ready, under this same lock
                where[k.hex] = dev
            self.counters["lookups"] += 1
            self.counters["hit_tokens"] += m * self.layout.chunk_tokens
            self.counters["miss_tokens"] += max(0, len(tokens) - m * self.layout.chunk_tokens)
            self.placement.touch([k.hex for k in hit])
            pins = [k.hex for k in hit]
            self._pins.update(pins)
        extra = max(0, len(tokens) - len(hit) * self.layout.chunk_tokens) if extra_tokens is None else extra_tokens
        return LayerwiseLoad(
            self.stores,
            self.layout,
            hit,
            where,
            extra_tokens=extra,
            readers=self.readers,
            out=out,
            on_done=lambda: self._unpin(pins),
        )

    def forget_lost(self, load: LayerwiseLoad) -> None:
        """Drop the chunks a load could not read (corrupt or missing) so they are rewritten later."""
        where = {i: dev for dev, group in load.groups.items() for i, _ in group}
        for i in sorted(load.lost):
            self._drop_unreadable(where[i], load.keys[i].hex)

    def promote_hot(self, keys: Sequence[ChunkKey] | None = None, max_moves: int = 8) -> int:
        """Move hot SSD chunks (hit ``promote_after`` times) of ``keys`` into memory. Returns moves done.

        Moved chunks are held (invisible, a miss) from the plan until their copy is stored.
        """
        if not self.promote:
            return 0
        with self._lock:
            hexes = [k.hex for k in keys] if keys is not None else list(self.placement.records)
            busy = set(self._pins)
            moves = self.placement.plan_promotions([h for h in hexes if h not in busy], max_moves=max_moves, busy=busy)
            self.placement.hold({m.key for m in moves})
        if not moves:
            return 0
        # read every moved chunk first (a swap frees the room its partner needs), then rewrite
        data: dict[str, list[torch.Tensor]] = {}
        for mv in moves:
            src = self.stores[mv.src]
            units = []
            for layer in range(self.layout.num_layers):
                view = src.read(unit_name(mv.key, layer))
                if view is None:
                    break
                units.append(view.clone())
            data[mv.key] = units
        for mv in moves:
            self._delete_units(mv.src, mv.key)
        done = 0
        for mv in moves:
            units = data[mv.key]
            dst = self.stores[mv.dst]
            ok = len(units) == self.layout.num_layers and all(
                dst.put(unit_name(mv.key, layer), u) for layer, u in enumerate(units)
            )
            if self._finish_writes(mv.dst, [mv.key], set() if ok else {mv.key}):
                done += 1
            else:
                with self._lock:
                    self.counters["lost_chunks"] += 1
        with self._lock:
            self.counters["promotions"] += sum(1 for m in moves if m.reason == "promote")
        return done

    # --- reporting -----------------------------------------------------------------------------
    def page_cache_bytes(self) -> int:
        return sum(s.page_cache_bytes() for s in self.stores.values())

    def stats(self) -> dict:
        looked = self.counters["hit_tokens"] + self.counters["miss_tokens"]
        return {
            "model_id": self.model_id,
            "layout": self.layout.tag(),
            "counters": dict(self.counters),
            "hit_rate_tokens": self.counters["hit_tokens"] / looked if looked else None,
            "devices": {
                name: {**info, "io": self.stores[name].stats.as_dict(), "store": self.stores[name].describe()}
                for name, info in self.placement.snapshot().items()
            },
            "page_cache_bytes": self.page_cache_bytes(),
            "warnings": list(self.warnings),
        }

    def close(self) -> None:
        for s in self.stores.values():
            s.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
