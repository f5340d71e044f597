"""Baselines in the same harness: recompute, and file-per-chunk tiers as KV offloading libraries run them.

``SerialTiers`` by default follows the design the paper measures against: a host-memory tier
first, then one local-disk tier holding one buffered file per chunk written with ``torch.save``; a
lookup walks the tiers in order and the first hit wins; chunks are loaded one after another by the
calling thread (which is blocked for all of it). Every filesystem call of the disk tier is timed:
``os.stat`` (existence check), ``open``, the read/deserialize and ``close``, so the share of time
in open/stat/close is measured rather than assumed.

The same class also gives the stronger baselines a user with the same devices would run: files
spread over every disk (``disk_dirs``, one path per disk, chunk ``i`` on disk ``i mod n``, each disk
with its own cap), raw bytes read with buffered ``readinto`` instead of ``torch.load``
(``fmt="raw"``), and layer-wise loading on background threads, one per disk plus one for the
memory tier, the model waiting per layer as LMCache's layer-wise mode and vLLM's offloading
connector do (``loader="layerwise"``, raw files: layer ``l`` of a chunk is one ``pread``).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from .keys import KVLayout, chunk_keys
from .pagecache import drop, resident_bytes
from .retrieval import TORCH_DTYPES, KVBuffers
from .stores import Throttling

__all__ = ["SerialTiers", "SerialLoad", "ThreadedLoad"]


def _thread_stime() -> float:
    """System (kernel) CPU seconds of the calling thread."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_stime
    except (AttributeError, OSError):
        return 0.0


class SerialLoad:
    """A finished serialized retrieval: per-layer (K, V) plus where the time went."""

    def __init__(self, layout: KVLayout, chunks: int, extra_tokens: int = 0, out: KVBuffers | None = None):
        n = chunks * layout.chunk_tokens
        self.layout = layout
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (1, layout.kv_heads, n + max(0, extra_tokens), layout.head_dim)
        self.tokens = n
        # same preallocated destination as kvpool's, so the compute path after retrieval is identical
        if out is not None and out.fits(layout, shape[2]):
            self.kbuf, self.vbuf = out.k, out.v
        else:
            self.kbuf = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
            self.vbuf = [torch.empty(shape, dtype=dtype) for _ in range(layout.num_layers)]
        self.k = [b[:, :, :n] for b in self.kbuf]
        self.v = [b[:, :, :n] for b in self.vbuf]
        self.timing = {"memory_s": 0.0, "disk_s": 0.0, "stat_s": 0.0, "open_s": 0.0, "read_s": 0.0, "close_s": 0.0}
        self.timing["disk_kernel_cpu_s"] = 0.0  # system CPU time of the reading thread in the disk tier
        self.bytes = {"memory": 0, "disk": 0}
        self.elapsed_s = 0.0

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]  # already loaded: the caller waited for all of it

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kbuf[layer], self.vbuf[layer]

    @property
    def blocked_s(self) -> float:
        return self.elapsed_s  # the caller does every read itself

    def join(self, timeout: float | None = None) -> SerialLoad:
        return self  # already loaded

    def _copy_in(self, i: int, layer: int, unit: torch.Tensor) -> None:
        """Chunk ``i``'s layer ``layer`` (``[2, H, n, D]``) into the destination tensors."""
        n = self.layout.chunk_tokens
        self.k[layer][0, :, i * n : (i + 1) * n].copy_(unit[0])
        self.v[layer][0, :, i * n : (i + 1) * n].copy_(unit[1])

    @property
    def fs_time_frac(self) -> float | None:
        t = self.timing
        return (t["stat_s"] + t["open_s"] + t["close_s"]) / t["disk_s"] if t["disk_s"] > 0 else None

    @property
    def kernel_time_frac(self) -> float | None:
        """Share of the disk tier's wall time the reading thread spent in the kernel (getrusage)."""
        t = self.timing
        return t["disk_kernel_cpu_s"] / t["disk_s"] if t["disk_s"] > 0 else None

    def describe(self) -> dict:
        return {
            "kernel_time_frac": self.kernel_time_frac,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed_s,
            "bytes": dict(self.bytes),
            "timing": dict(self.timing),
            "fs_time_frac": self.fs_time_frac,
        }


class SerialTiers:
    """Memory tier (LRU, ``memory_bytes``) then disk tiers of one file per chunk.

    ``disk_dirs`` (or the single ``disk_dir``): one directory per disk, with ``throttles`` (or the
    single ``throttle``) as their emulated caps. ``fmt``: "torch" (``torch.save``/``torch.load``) or
    "raw" (the chunk's bytes, read with buffered ``readinto``). ``loader``: "serial" (the caller
    reads chunk after chunk) or "layerwise" (background threads, needs ``fmt="raw"``).
    """

    def __init__(
        self,
        layout: KVLayout,
        model_id: str,
        memory_bytes: int,
        disk_dir: str | os.PathLike | None = None,
        throttle: Throttling | None = None,
        disk_dirs: Sequence[str | os.PathLike] | None = None,
        throttles: Sequence[Throttling | None] | None = None,
        fmt: str = "torch",
        loader: str = "serial",
    ):
        if (disk_dir is None) == (disk_dirs is None):
            raise ValueError("SerialTiers: give exactly one of disk_dir and disk_dirs")
        dirs = [Path(disk_dir)] if disk_dir is not None else [Path(d) for d in disk_dirs or ()]
        if not dirs:
            raise ValueError("SerialTiers: disk_dirs must name at least one directory")
        caps = list(throttles) if throttles is not None else [throttle] * len(dirs)
        if len(caps) != len(dirs):
            raise ValueError(f"SerialTiers: throttles has {len(caps)} entries for {len(dirs)} disk_dirs")
        if fmt not in ("torch", "raw"):
            raise ValueError(f"SerialTiers: fmt must be 'torch' or 'raw', not {fmt!r}")
        if loader not in ("serial", "layerwise"):
            raise ValueError(f"SerialTiers: loader must be 'serial' or 'layerwise', not {loader!r}")
        if loader == "layerwise" and fmt != "raw":
            raise ValueError("SerialTiers: loader='layerwise' reads one layer of a file at a time and needs fmt='raw'")
        self.layout = layout
        self.model_id = model_id
        self.memory_bytes = int(memory_bytes)
        self.dirs = dirs
        self.dir = dirs[0]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.throttles = caps
        self.throttle = caps[0]
        self.fmt, self.loader = fmt, loader
        self.memory: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.memory_used = 0

    def _file(self, hx: str, index: int = 0) -> Path:
        ext = "pt" if self.fmt == "torch" else "kv"
        return self.dirs[index % len(self.dirs)] / f"{self.model_id}@{hx}.{ext}"

    def _save(self, chunk: torch.Tensor, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        if self.fmt == "torch":
            torch.save(chunk, tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(chunk.reshape(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, path)

    def put(self, tokens, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write-through: every chunk to disk; to memory while it has room.

        Room is made by evicting the least recently used chunks of other requests; a request's own
        chunks fill memory in order (its head stays in memory, the rest is only on disk).
        """
        n = self.layout.chunk_tokens
        stored = 0
        keys = chunk_keys(tokens, self.model_id, self.layout)
        mine = {k.hex for k in keys}
        for key in keys:
            s, e = key.index * n, (key.index + 1) * n
            chunk = torch.stack([torch.stack([k[0, :, s:e], v[0, :, s:e]]) for k, v in kv]).contiguous()
            path = self._file(key.hex, key.index)
            if not path.exists():
                self._save(chunk, path)
                stored += 1
            size = chunk.numel() * chunk.element_size()
            if key.hex in self.memory:
                self.memory.move_to_end(key.hex)
                continue
            for old_key in [k for k in self.memory if k not in mine]:
                if self.memory_used + size <= self.memory_bytes:
                    break
                old = self.memory.pop(old_key)
                self.memory_used -= old.numel() * old.element_size()
            if self.memory_used + size <= self.memory_bytes:
                self.memory[key.hex] = chunk
                self.memory_used += size
        return stored

    def lookup(self, tokens) -> int:
        n = 0
        for key in chunk_keys(tokens, self.model_id, self.layout):
            if key.hex not in self.memory and not self._file(key.hex, key.index).exists():
                break
            n += 1
        return n * self.layout.chunk_tokens

    def retrieve(
        self, tokens, max_tokens: int | None = None, extra_tokens: int | None = 0, out: KVBuffers | None = None
    ) -> SerialLoad:
        """Load the longest cached prefix: chunk by chunk on the calling thread, or (``loader=
        "layerwise"``) layer by layer on background threads, returning while they run."""
        keys = chunk_keys(tokens, self.model_id, self.layout)
        if max_tokens is not None:
            keys = keys[: max_tokens // self.layout.chunk_tokens]
        t_start = time.perf_counter()
        found: list[tuple[int, torch.Tensor | None, Path | None]] = []
        lookup_stat_s = 0.0
        for key in keys:  # lookup: first hit wins, stop at the first miss
            if key.hex in self.memory:
                found.append((key.index, self.memory[key.hex], None))
                continue
            t0 = time.perf_counter()
            path = self._file(key.hex, key.index)
            ok = os.path.exists(path)
            lookup_stat_s += time.perf_counter() - t0
            if not ok:
                break
            found.append((key.index, None, path))
        if extra_tokens is None:
            extra_tokens = max(0, len(tokens) - len(found) * self.layout.chunk_tokens)
        if self.loader == "layerwise":
            return ThreadedLoad(self, found, extra_tokens, out, t_start, lookup_stat_s)
        load = SerialLoad(self.layout, len(found), extra_tokens, out)
        tm = load.timing
        tm["stat_s"] += lookup_stat_s
        tm["disk_s"] += lookup_stat_s
        for i, mem, file in found:
            t0 = time.perf_counter()
            if mem is not None:
                chunk = mem
            else:
                assert file is not None  # a chunk not in memory was found on disk
                chunk = self._load_file(file, i, load)
            for layer in range(self.layout.num_layers):
                load._copy_in(i, layer, chunk[layer])
            dt = time.perf_counter() - t0
            if mem is not None:
                tm["memory_s"] += dt
                load.bytes["memory"] += chunk.numel() * chunk.element_size()
            else:
                tm["disk_s"] += dt
        load.elapsed_s = time.perf_counter() - t_start
        return load

    def _load_file(self, file: Path, index: int, load: SerialLoad) -> torch.Tensor:
        """One chunk file, every filesystem call timed into ``load.timing``."""
        tm = load.timing
        k0 = _thread_stime()
        ts = time.perf_counter()
        size = os.stat(file).st_size
        to = time.perf_counter()
        f = open(file, "rb")  # noqa: SIM115 - open/close are timed separately
        tr = time.perf_counter()
        if self.fmt == "torch":
            chunk = torch.load(f, weights_only=True)
        else:
            L, H, n, D = self.layout.num_layers, self.layout.kv_heads, self.layout.chunk_tokens, self.layout.head_dim
            chunk = torch.empty(L, 2, H, n, D, dtype=TORCH_DTYPES[self.layout.dtype])
            f.readinto(chunk.reshape(-1).view(torch.uint8).numpy().data)
        tc = time.perf_counter()
        f.close()
        te = time.perf_counter()
        tm["disk_kernel_cpu_s"] += _thread_stime() - k0
        throttle = self.throttles[index % len(self.throttles)]
        if throttle:
            throttle.after_read(size, ts)
        tm["stat_s"] += to - ts
        tm["open_s"] += tr - to
        tm["read_s"] += tc - tr
        tm["close_s"] += te - tc
        load.bytes["disk"] += size
        return chunk

    def files(self) -> list[Path]:
        return sorted(p for d in self.dirs for p in d.glob(f"*.{'pt' if self.fmt == 'torch' else 'kv'}"))

    def drop_page_cache(self) -> None:
        for p in self.files():
            drop(p)

    def page_cache_bytes(self) -> int:
        return sum(resident_bytes(p) for p in self.files())

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())


class ThreadedLoad(SerialLoad):
    """A layer-wise retrieval on background threads: one per disk, one for the memory tier.

    Each disk thread opens its chunk files, then reads layer 0 of every one (one buffered
    ``pread`` each), then layer 1, and so on; ``wait(layer)`` returns once every thread has that
    layer, so the model computes early layers while later ones load. Filesystem calls are timed
    as in the serialized load; ``blocked_s`` is what the caller spent waiting.
    """

    def __init__(self, tiers: SerialTiers, found, extra_tokens: int, out, t_start: float, lookup_stat_s: float):
        super().__init__(tiers.layout, len(found), extra_tokens, out)
        self.tiers = tiers
        L = tiers.layout.num_layers
        self.timing["stat_s"] += lookup_stat_s
        self.timing["disk_s"] += lookup_stat_s
        groups: dict[int, list] = {}
        for i, mem, file in found:
            groups.setdefault(-1 if mem is not None else i % len(tiers.dirs), []).append((i, mem, file))
        self.ready = [threading.Event() for _ in range(L)]
        self._left = [len(groups)] * L
        self._threads_left = len(groups)
        self._lock = threading.Lock()
        self._blocked = 0.0
        self.errors: list[str] = []
        self.t_start = t_start
        self.threads = [
            threading.Thread(target=self._run, args=(d, g), name=f"baseline-read-{d}", daemon=True)
            for d, g in groups.items()
        ]
        if not groups:
            for e in self.ready:
                e.set()
            self.elapsed_s = time.perf_counter() - t_start
        for t in self.threads:
            t.start()

    def _run(self, disk: int, group: list) -> None:
        t0 = time.perf_counter()
        try:
            if disk < 0:
                for layer in range(self.layout.num_layers):
                    for i, mem, _ in group:
                        self._copy_in(i, layer, mem[layer])
                    self._layer_done(layer)
                with self._lock:
                    self.bytes["memory"] += sum(m.numel() * m.element_size() for _, m, _ in group)
                    self.timing["memory_s"] += time.perf_counter() - t0
            else:
                self._read_disk(disk, group)
                with self._lock:
                    self.timing["disk_s"] += time.perf_counter() - t0
        except Exception as e:  # a failing disk must not leave the caller waiting forever
            self.errors.append(f"disk {disk}: {e}")
        finally:
            with self._lock:
                self._threads_left -= 1
                if self._threads_left == 0:
                    self.elapsed_s = time.perf_counter() - self.t_start
                    for ev in self.ready:
                        ev.set()

    def _read_disk(self, disk: int, group: list) -> None:
        lay, tm = self.layout, {"stat_s": 0.0, "open_s": 0.0, "read_s": 0.0, "close_s": 0.0}
        ub = lay.unit_bytes
        throttle = self.tiers.throttles[disk]
        k0 = _thread_stime()
        fds = []
        for i, _, file in group:
            ts = time.perf_counter()
            os.stat(file)
            to = time.perf_counter()
            fds.append((i, os.open(file, os.O_RDONLY)))
            tm["stat_s"] += to - ts
            tm["open_s"] += time.perf_counter() - to
        staging = torch.empty(ub, dtype=torch.uint8)
        unit = staging.view(TORCH_DTYPES[lay.dtype]).view(2, lay.kv_heads, lay.chunk_tokens, lay.head_dim)
        try:
            for layer in range(lay.num_layers):
                for i, fd in fds:
                    tr = time.perf_counter()
                    got = os.preadv(fd, [staging.numpy().data], layer * ub)
                    if got != ub:
                        raise OSError(f"short read of chunk {i} layer {layer} ({got} of {ub} bytes)")
                    if throttle:
                        throttle.after_read(ub, tr)
                    tm["read_s"] += time.perf_counter() - tr
                    self._copy_in(i, layer, unit)
                self._layer_done(layer)
        finally:
            for _, fd in fds:
                tc = time.perf_counter()
                os.close(fd)
                tm["close_s"] += time.perf_counter() - tc
            with self._lock:
                for k, v in tm.items():
                    self.timing[k] += v
                self.timing["disk_kernel_cpu_s"] += _thread_stime() - k0
                self.bytes["disk"] += len(fds) * lay.chunk_bytes

    def _layer_done(self, layer: int) -> None:
        with self._lock:
            self._left[layer] -= 1
            if self._left[layer] == 0:
                self.ready[layer].set()

    def wait(self, layer: int, timeout: float | None = 600.0) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        if not self.ready[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} of the cached prefix did not load within {timeout} s")
        self._blocked += time.perf_counter() - t0
        if self.errors:
            raise RuntimeError(f"baseline load failed: {self.errors[0]}")
        return self.k[layer], self.v[layer]

    @property
    def blocked_s(self) -> float:
        return self._blocked

    def join(self, timeout: float | None = 600.0) -> ThreadedLoad:
        for layer in range(self.layout.num_layers):
            self.wait(layer, timeout)
        for t in self.threads:
            t.join(timeout)
        return self
