"""The SSD store: one preallocated slab per SSD, the pool's own allocator and index, O_DIRECT I/O.

No file per chunk and no page cache: a unit (one (chunk, layer) of KV) is an extent of the slab
file ``<path>/kvpool.slab`` written and read with O_DIRECT through page-aligned (mmap) buffers.
Each extent starts with a 64-byte header (magic, a digest of the unit's name, payload length,
CRC32 of the payload, sequence number); every read checks all of them, so a corrupt, truncated or
reused extent is a miss, never wrong KV.

The index survives a killed process: every put/delete is appended to ``kvpool.journal`` as a
length+CRC framed record after the data write, and every ``snapshot_every`` records the whole index
is written atomically to ``kvpool.index`` (temp file + rename) and the journal restarts. A record's
number is taken when it is appended, so file order and number order agree however many threads
write; a unit becomes visible only once its record is appended, so what a reader finds (and every
acknowledged put) survives a kill. Reopening loads the snapshot, replays newer journal records and
cuts off a torn tail; a snapshot or journal record of the wrong shape (or a journal record failing
its CRC before the end) sets that file aside as ``<name>.bad`` with a warning and reopens from the
valid part. Power loss needs ``sync=True`` (fdatasync after each data write and journal append).

A slab that cannot be created (directory missing, disk full) raises ``DeviceUnavailable`` and
leaves no partly reserved file behind; the pool then runs without that device and says so. An
I/O error or a full disk while writing the slab or the journal (or reading the slab) marks the
store ``failed``: it takes no more writes, put/delete return False instead of raising, and its
index stays what the journal says. A second process opening the same slab gets a
clear error (flock); processes share a pool through ``kvpool serve``. Reads go through ``preadv``
(one call per run of adjacent units) or, with ``io_backend="io_uring"`` (``"auto"``: when the
kernel allows it), all runs of a read in flight at once on an io_uring (``uring.py``, raw system
calls). An SPDK backend would implement the same methods; it needs the SPDK library, hugepages and
an NVMe device unbound from the kernel, none of which exist here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from hashlib import blake2b
from pathlib import Path

import torch

from hwtopo import atomic_write_text

from .pagecache import resident_bytes
from .stores import ExtentAllocator, StoreStats, Throttling, as_bytes_tensor
from .uring import IoUring, buffer_address, iovec_array

__all__ = ["PassthroughStore", "DeviceUnavailable", "AlignedBuffer", "BufferPart", "ALIGN", "HEADER_BYTES"]

log = logging.getLogger(__name__)

ALIGN = 4096
HEADER_BYTES = 64
MAGIC = b"KVPU"
VERSION = 1
_HEADER = struct.Struct("<4sHH16sQIQ")  # magic, version, flags, name digest, length, crc32, seq
_FRAME = struct.Struct("<II")  # journal record: body length, crc32 of body
_DEVICE_ERRORS = (errno.ENOSPC, errno.EIO, errno.EROFS, errno.ENODEV, errno.EDQUOT)
SLAB, JOURNAL, SNAPSHOT = "kvpool.slab", "kvpool.journal", "kvpool.index"


class DeviceUnavailable(OSError):
    """The SSD path cannot serve as a pool device (missing, full, locked, refused)."""


def _digest(name: str) -> bytes:
    return blake2b(name.encode(), digest_size=16).digest()


def _count(v, what: str) -> int:
    """A non-negative integer from an index file, or ValueError naming the field."""
    if type(v) is not int or v < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {v!r}")
    return v


def _parse_snapshot(snap) -> tuple[dict[str, list[int]], int]:
    """``(entries, seq)`` of a decoded snapshot; ValueError naming the field when its shape is wrong."""
    if not isinstance(snap, dict):
        raise ValueError(f"the snapshot must be a JSON object, not {type(snap).__name__}")
    seq = _count(snap.get("seq"), "seq")
    raw = snap.get("entries")
    if not isinstance(raw, dict):
        raise ValueError(f"entries must be an object of name -> [offset, length, crc, seq], not {type(raw).__name__}")
    entries = {}
    for name, ent in raw.items():
        if not isinstance(ent, list) or len(ent) != 4:
            raise ValueError(f"entry {name!r} must be [offset, length, crc, seq], not {ent!r}")
        entries[name] = [_count(v, f"entry {name!r} {f}") for v, f in zip(ent, ("offset", "length", "crc", "seq"))]
    return entries, seq


def _parse_record(rec) -> dict:
    """A decoded journal record, checked; ValueError naming the field when its shape is wrong."""
    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, not {type(rec).__name__}")
    _count(rec.get("s"), "s (sequence number)")
    if not isinstance(rec.get("n"), str):
        raise ValueError(f"n (unit name) must be a string, not {rec.get('n')!r}")
    if rec.get("o") == "p":
        for f in ("off", "len", "crc", *(("u",) if "u" in rec else ())):
            _count(rec.get(f), f)
    elif rec.get("o") != "d":
        raise ValueError(f"o (operation) must be 'p' or 'd', not {rec.get('o')!r}")
    return rec


def _split_runs(pieces: list[tuple[list[int], list[int]]], target: int) -> list[tuple[list[int], list[int]]]:
    """Runs of adjacent units cut at unit boundaries into pieces of at least ``target`` bytes."""
    out = []
    for run, ex in pieces:
        start, acc = 0, 0
        for j, x in enumerate(ex):
            acc += x
            if acc >= target and j + 1 < len(ex):
                out.append((run[start : j + 1], ex[start : j + 1]))
                start, acc = j + 1, 0
        out.append((run[start:], ex[start:]))
    return out


class AlignedBuffer:
    """A page-aligned anonymous mapping, viewed as a uint8 tensor and a memoryview (for O_DIRECT)."""

    def __init__(self, nbytes: int):
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self._map = mmap.mmap(-1, self.nbytes)
        self.address = buffer_address(self._map)  # for io_uring's iovecs
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def parts(self, sizes: list[int]) -> list[BufferPart]:
        """Consecutive page-aligned pieces of this buffer, one per size (each rounded up to a page).

        Units adjacent in the slab land in adjacent pieces, so one ``preadv`` fills them all.
        """
        out, pos = [], 0
        for n in sizes:
            n = max(ALIGN, -(-n // ALIGN) * ALIGN)
            if pos + n > self.nbytes:
                raise ValueError(f"parts: {sum(sizes)} bytes do not fit a buffer of {self.nbytes}")
            out.append(BufferPart(self, pos, n))
            pos += n
        return out


class BufferPart:
    """A page-aligned piece of an :class:`AlignedBuffer`, usable wherever a staging buffer is."""

    def __init__(self, parent: AlignedBuffer, offset: int, nbytes: int):
        self.parent = parent  # keeps the mapping alive while the piece is in use
        self.nbytes = nbytes
        self.address = parent.address + offset
        self.view = parent.view[offset : offset + nbytes]
        self.tensor = parent.tensor[offset : offset + nbytes]


class PassthroughStore:
    """One SSD of the pool: slab + allocator + journaled index, O_DIRECT reads and writes."""

    kind = "ssd"
    align_bytes = ALIGN
    unit_overhead_bytes = HEADER_BYTES
    default_io_backend = "preadv"  # when the constructor is not told
    # a read of at least twice this many bytes goes in pieces of about this size, two in flight at
    # once, so the disk queue holds more than one request and checking overlaps reading
    pipeline_bytes = 2 << 20
    readahead_threads = 2

    def __init__(
        self,
        name: str,
        path: str | os.PathLike,
        capacity_bytes: int,
        throttle: Throttling | None = None,
        sync: bool = False,
        direct: bool = True,
        snapshot_every: int = 4096,
        io_backend: str | None = None,
    ):
        io_backend = io_backend or self.default_io_backend
        if io_backend not in ("preadv", "io_uring", "auto"):
            raise ValueError(f"io_backend must be 'preadv', 'io_uring' or 'auto', not {io_backend!r}")
        self.name = name
        self.dir = Path(path)
        self.throttle = throttle
        self.sync = sync
        self.snapshot_every = snapshot_every
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._local = threading.local()
        # reads: one preadv per run of adjacent units, or all runs in flight at once on an io_uring
        self.io_backend = "preadv"
        self.io_backend_why: str | None = None
        if io_backend != "preadv":
            why = IoUring.available()
            if why is None:
                self.io_backend = "io_uring"
            elif io_backend == "io_uring":
                raise DeviceUnavailable(errno.ENOSYS, f"SSD device {name!r}: io_uring backend unavailable ({why})")
            else:
                self.io_backend_why = why
                log.info("%s: io_uring unavailable (%s); reading with preadv", name, why)
        self._rings: list[IoUring] = []  # idle rings, one taken per concurrent read_many
        self._idle_bufs: list[AlignedBuffer] = []  # whole-chunk staging buffers handed back for reuse
        self._ra: ThreadPoolExecutor | None = None  # read-ahead threads of large reads, made when needed
        self._prefetch: ThreadPoolExecutor | None = None  # runs read_many_later, made when needed
        if capacity_bytes < ALIGN:
            raise ValueError(f"SSD device {name!r}: capacity_bytes must be at least {ALIGN}, not {capacity_bytes!r}")
        if not self.dir.is_dir():
            raise DeviceUnavailable(errno.ENOENT, f"SSD device {name!r}: path {str(self.dir)!r} is not a directory")
        self.capacity_bytes = int(capacity_bytes) // ALIGN * ALIGN
        self.slab_path = self.dir / SLAB
        self.journal_path = self.dir / JOURNAL
        self.snapshot_path = self.dir / SNAPSHOT
        self.direct = direct and hasattr(os, "O_DIRECT")
        flags = os.O_RDWR | os.O_CREAT
        self._fd: int | None = None
        try:
            self._fd = os.open(self.slab_path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise DeviceUnavailable(
                    e.errno, f"SSD device {name!r}: cannot open {self.slab_path}: {e.strerror}"
                ) from e
            log.warning("%s: O_DIRECT refused by the filesystem at %s; using buffered I/O", name, self.dir)
            self.direct = False
            self._fd = os.open(self.slab_path, flags, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            raise DeviceUnavailable(
                e.errno,
                f"SSD device {name!r}: {self.slab_path} is in use by another process (share it via kvpool serve)",
            ) from e
        try:
            on_disk = os.fstat(self.fd).st_size
            self._load_index(on_disk)
            if on_disk < self.capacity_bytes:
                self._reserve(on_disk)
            self.jfd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._jsize = os.fstat(self.jfd).st_size
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def fd(self) -> int:
        """The slab's descriptor, for this store's reads and writes; a closed store has none."""
        if self._fd is None:
            raise ValueError(f"SSD device {self.name!r} is closed")
        return self._fd

    def _reserve(self, on_disk: int) -> None:
        """Extend the slab to its capacity; when the disk cannot hold it, leave nothing behind."""
        try:
            os.posix_fallocate(self.fd, 0, self.capacity_bytes)
        except OSError as e:
            # a failed fallocate may have reserved part of the range: give it back, and remove a
            # slab this open created (an earlier slab keeps its size and contents)
            if on_disk == 0 and not self.journal_path.exists() and not self.snapshot_path.exists():
                self.slab_path.unlink(missing_ok=True)
            else:
                os.ftruncate(self.fd, on_disk)
            raise DeviceUnavailable(
                e.errno,
                f"SSD device {self.name!r}: cannot reserve {self.capacity_bytes} bytes at {self.dir}: {e.strerror}",
            ) from e

    # --- index -----------------------------------------------------------------------------------
    def _replay(self) -> tuple[dict[str, list[int]], int, int, int, str | None]:
        """What the snapshot and the journal on disk say, read-only.

        Returns ``(entries, seq, records replayed, end of the valid journal prefix, why the
        journal stopped early or None)``; ``entries``: name -> ``[off, length, crc, unit seq]``.
        A snapshot that cannot be read or has the wrong shape counts as absent.
        """
        entries: dict[str, list[int]] = {}
        seq = 0
        if self.snapshot_path.exists():
            try:
                entries, seq = _parse_snapshot(json.loads(self.snapshot_path.read_bytes()))
            except ValueError:  # _load_index sets it aside
                entries, seq = {}, 0
        raw = self.journal_path.read_bytes() if self.journal_path.exists() else b""
        pos, replayed, why = 0, 0, None
        while pos + _FRAME.size <= len(raw):
            ln, crc = _FRAME.unpack_from(raw, pos)
            if pos + _FRAME.size + ln > len(raw):
                break  # torn tail: killed mid-append
            body = raw[pos + _FRAME.size : pos + _FRAME.size + ln]
            try:
                if zlib.crc32(body) != crc:
                    raise ValueError("checksum mismatch")
                rec = _parse_record(json.loads(body))
            except ValueError as e:
                why = f"record at byte {pos}: {e}"
                break
            pos += _FRAME.size + ln
            if rec["s"] <= seq:  # already in the snapshot (killed between snapshot and truncation)
                continue
            seq = rec["s"]
            replayed += 1
            if rec["o"] == "p":
                entries[rec["n"]] = [rec["off"], rec["len"], rec["crc"], rec.get("u", rec["s"])]
            else:
                entries.pop(rec["n"], None)
        return entries, seq, replayed, pos, why

    def _set_aside(self, path: Path, why: str) -> None:
        """Rename a malformed index file next to itself (``<name>.bad``, ``.bad.1``, ...), with a warning."""
        dst = path.with_name(f"{path.name}.bad")
        i = 0
        while dst.exists():
            i += 1
            dst = path.with_name(f"{path.name}.bad.{i}")
        os.replace(path, dst)
        self.set_aside.append(str(dst))
        log.warning(
            "%s: %s is malformed (%s); set aside as %s, reopening from what is valid", self.name, path, why, dst
        )

    def _load_index(self, on_disk: int) -> None:
        self.set_aside: list[str] = []
        if self.snapshot_path.exists():
            try:
                _parse_snapshot(json.loads(self.snapshot_path.read_bytes()))
            except ValueError as e:
                self._set_aside(self.snapshot_path, str(e))
        entries, seq, replayed, good_end, why = self._replay()
        size = self.journal_path.stat().st_size if self.journal_path.exists() else 0
        if why is not None:
            self._set_aside(self.journal_path, why)
        elif good_end < size:
            log.warning(
                "%s: journal has a torn tail of %d bytes (killed mid-write); ignored", self.name, size - good_end
            )
            os.truncate(self.journal_path, good_end)
        self.alloc = ExtentAllocator(self.capacity_bytes, ALIGN)
        self.index: dict[str, tuple[int, int, int, int]] = {}
        dropped = 0
        for nm, (off, ln, crc, s) in sorted(entries.items(), key=lambda kv: kv[1][3]):
            ext = HEADER_BYTES + ln
            if off + self.alloc.round(ext) > on_disk or not self.alloc.reserve(off, ext):
                dropped += 1
                continue
            self.index[nm] = (off, ln, crc, s)
        if dropped:
            log.warning(
                "%s: %d index entries point past the slab's end or overlap (truncated slab?); dropped",
                self.name,
                dropped,
            )
        # new units are numbered above every unit on disk, so a stale header never matches
        self._seq = max([seq, *(e[3] for e in self.index.values())])
        self._since_snapshot = replayed
        self.dropped_on_open = dropped
        if why is not None:  # the valid prefix lives on in a snapshot; the journal starts empty
            try:
                self._write_snapshot()
            except OSError as e:
                raise DeviceUnavailable(e.errno, f"SSD device {self.name!r}: cannot rewrite its index: {e}") from e

    def _journal(self, rec: dict) -> None:
        """Append one record, numbered now (file order = number order, which replay relies on).

        Raises OSError with the journal unchanged (a partial append is cut off again). The caller
        applies the change to the index, then calls ``_maybe_snapshot``.
        """
        self._seq += 1
        body = json.dumps({"s": self._seq, **rec}, separators=(",", ":")).encode()
        frame = _FRAME.pack(len(body), zlib.crc32(body)) + body
        try:
            written = os.write(self.jfd, frame)
            if written != len(frame):
                raise OSError(errno.ENOSPC, f"short journal append ({written} of {len(frame)} bytes)")
            if self.sync:
                os.fdatasync(self.jfd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.jfd, self._jsize)
            raise
        self._jsize += len(frame)
        self._since_snapshot += 1

    def _maybe_snapshot(self) -> None:
        """Every ``snapshot_every`` records; called once the index includes the last record's change."""
        if self._since_snapshot < self.snapshot_every:
            return
        try:
            self.snapshot()
        except OSError as e:  # not fatal: the journal still holds every record
            self._since_snapshot = 0
            log.warning("%s: index snapshot failed (%s); the journal keeps the index", self.name, e)

    def _write_snapshot(self) -> None:
        data = {
            "version": VERSION,
            "seq": self._seq,
            "capacity_bytes": self.capacity_bytes,
            "entries": {k: list(v) for k, v in self.index.items()},
        }
        atomic_write_text(self.snapshot_path, json.dumps(data, separators=(",", ":")))

    def snapshot(self) -> None:
        """Write the whole index atomically and restart the journal."""
        with self._lock:
            self._write_snapshot()
            os.ftruncate(self.jfd, 0)
            self._jsize = 0
            self._since_snapshot = 0

    def _fail(self, e: OSError, what: str) -> None:
        """Mark the device failed: it takes no more writes, and the pool runs without it."""
        if self.failed is None:
            self.failed = e
            log.warning("%s: %s failed (%s); device marked failed", self.name, what, e.strerror or e)

    # --- buffers -------------------------------------------------------------------------------
    def staging(self, nbytes: int) -> AlignedBuffer:
        """A buffer large enough to read a unit of ``nbytes`` payload (one per reader thread)."""
        return AlignedBuffer(HEADER_BYTES + nbytes)

    def chunk_staging(self, unit_bytes: int, count: int) -> tuple[list[BufferPart], Callable[[], None]]:
        """``count`` adjacent staging pieces for units of ``unit_bytes`` payload (one chunk: a single
        ``preadv`` fills them all) and the function that hands their buffer back for reuse.

        Reusing buffers keeps fresh pages (the kernel zeroing them) out of every chunk read.
        """
        ext = self.alloc.round(HEADER_BYTES + unit_bytes)
        need = ext * count
        with self._lock:
            buf = next((b for b in self._idle_bufs if b.nbytes >= need), None)
            if buf is not None:
                self._idle_bufs.remove(buf)
        if buf is None:
            buf = AlignedBuffer(need)
        returned = threading.Event()

        def release() -> None:
            if returned.is_set():
                return
            returned.set()
            with self._lock:
                if len(self._idle_bufs) < 4:
                    self._idle_bufs.append(buf)

        return buf.parts([ext] * count), release

    def _write_buffer(self, ext: int) -> AlignedBuffer:
        buf = getattr(self._local, "wbuf", None)
        if buf is None or buf.nbytes < ext:
            buf = AlignedBuffer(ext)
            self._local.wbuf = buf
        return buf

    # --- data ----------------------------------------------------------------------------------
    def put(self, name: str, data) -> bool:
        """Store a unit. False when the slab has no room or the device failed; True if stored or present.

        The unit becomes visible (``read``, ``names``) only after its bytes are written and its
        journal record appended: what a reader finds survives a killed process.
        """
        src = as_bytes_tensor(data)
        n = src.numel()
        ext_bytes = HEADER_BYTES + n
        with self._lock:
            if name in self.index:
                return True
            if self.failed is not None:
                return False
            off = self.alloc.alloc(ext_bytes)
            if off is None:
                return False
            self._seq += 1
            seq = self._seq  # the header's stamp; the journal record gets its own number
        t0 = time.perf_counter()
        crc = self._write_unit(name, src, off, seq)
        if crc is None:
            with self._lock:
                self.alloc.free(off, ext_bytes)
            return False
        if self.throttle:
            self.throttle.after_write(self.alloc.round(ext_bytes), t0)
        with self._lock:
            if name in self.index:  # a concurrent put of the same name was published first
                self.alloc.free(off, ext_bytes)
                return True
            try:
                self._journal({"o": "p", "n": name, "off": off, "len": n, "crc": crc, "u": seq})
            except OSError as e:
                self.alloc.free(off, ext_bytes)
                self.stats.add(errors=1)
                self._fail(e, f"journal append for {name}")
                return False
            self.index[name] = (off, n, crc, seq)
            self._maybe_snapshot()
        self.stats.add(bytes_written=self.alloc.round(ext_bytes), writes=1, write_s=time.perf_counter() - t0)
        return True

    def _fill(self, buf: AlignedBuffer | BufferPart, name: str, src: torch.Tensor, seq: int) -> int:
        """Header + payload (+ zero padding to the page) of one unit into ``buf``; the payload's CRC32."""
        n = src.numel()
        ext_bytes = HEADER_BYTES + n
        ext = self.alloc.round(ext_bytes)
        buf.tensor[HEADER_BYTES : HEADER_BYTES + n].copy_(src)
        if ext > ext_bytes:
            buf.tensor[ext_bytes:ext].zero_()
        crc = zlib.crc32(buf.view[HEADER_BYTES : HEADER_BYTES + n])
        header = _HEADER.pack(MAGIC, VERSION, 0, _digest(name), n, crc, seq)
        buf.view[: len(header)] = header
        buf.view[len(header) : HEADER_BYTES] = bytes(HEADER_BYTES - len(header))
        return crc

    def _pwrite(self, view: memoryview, off: int, what: str) -> bool:
        """One O_DIRECT write of ``view`` at ``off``; False (and the device marked failed on a
        device error) when it does not complete."""
        try:
            written = os.pwrite(self.fd, view, off)
            if written != len(view):
                raise OSError(errno.EIO, f"short write ({written} of {len(view)} bytes)")
            if self.sync:
                os.fdatasync(self.fd)
        except OSError as e:
            self.stats.add(errors=1)
            log.warning("%s: write of %s failed (%s); not stored", self.name, what, e.strerror or e)
            if e.errno in _DEVICE_ERRORS:
                self._fail(e, f"slab write of {what}")
            return False
        return True

    def _write_unit(self, name: str, src: torch.Tensor, off: int, seq: int) -> int | None:
        """Header + payload at ``off`` (O_DIRECT from an aligned buffer); the payload's CRC32, or None on failure."""
        ext = self.alloc.round(HEADER_BYTES + src.numel())
        buf = self._write_buffer(ext)
        crc = self._fill(buf, name, src, seq)
        return crc if self._pwrite(buf.view[:ext], off, name) else None

    def put_many(self, items: list[tuple[str, object]]) -> bool:
        """Store several units (a chunk's layers) in one contiguous extent with one write.

        A later ``read_many`` of the same names then fetches them with one ``preadv``. Units
        already stored are kept; when no free extent holds them all, they are stored one by one
        wherever they fit. True once every unit is stored (visible only after its bytes are written
        and its journal record appended, as with ``put``).
        """
        srcs = [(name, as_bytes_tensor(data)) for name, data in items]
        with self._lock:
            todo = [(nm, t) for nm, t in srcs if nm not in self.index]
            if not todo:
                return True
            if self.failed is not None:
                return False
            exts = [self.alloc.round(HEADER_BYTES + t.numel()) for _, t in todo]
            off = self.alloc.alloc(sum(exts)) if len(todo) > 1 else None
            seqs = list(range(self._seq + 1, self._seq + 1 + len(todo)))
            if off is not None:
                self._seq += len(todo)
        if off is None:
            return all(self.put(nm, t) for nm, t in todo)
        t0 = time.perf_counter()
        total = sum(exts)
        buf = self._write_buffer(total)
        offs = [off + sum(exts[:i]) for i in range(len(todo))]
        parts = buf.parts(exts)
        crcs = [self._fill(part, nm, t, s) for part, (nm, t), s in zip(parts, todo, seqs)]
        if not self._pwrite(buf.view[:total], off, f"{len(todo)} units from {todo[0][0]}"):
            with self._lock:
                self.alloc.free(off, total)
            return False
        if self.throttle:
            self.throttle.after_write(total, t0)
        with self._lock:
            for i, ((nm, t), o, crc, s) in enumerate(zip(todo, offs, crcs, seqs)):
                if nm in self.index:  # a concurrent put of the same name was published first
                    self.alloc.free(o, exts[i])
                    continue
                try:
                    self._journal({"o": "p", "n": nm, "off": o, "len": t.numel(), "crc": crc, "u": s})
                except OSError as e:
                    for j in range(i, len(todo)):
                        self.alloc.free(offs[j], exts[j])
                    self.stats.add(errors=1)
                    self._fail(e, f"journal append for {nm}")
                    return False
                self.index[nm] = (o, t.numel(), crc, s)
                self._maybe_snapshot()
        self.stats.add(bytes_written=total, writes=len(todo), write_s=time.perf_counter() - t0)
        return True

    failed: OSError | None = None

    def read(self, name: str, staging: AlignedBuffer | BufferPart | None = None) -> torch.Tensor | None:
        """The unit's payload as a uint8 view into ``staging``; None on a miss or a failed check."""
        return self.read_many([name], [staging])[0]

    def read_many(
        self,
        names: list[str],
        stagings: Sequence[AlignedBuffer | BufferPart | None],
        max_run_bytes: int = 16 << 20,
        on_unit: Callable[[int, torch.Tensor], object] | None = None,
    ) -> list[torch.Tensor | None]:
        """Read several units; units adjacent in the slab are fetched by one ``preadv`` (one iovec each).

        Returns, per name, a uint8 view into its staging buffer (allocated when missing or too
        small), or None on a miss or a failed check. Every unit is checked on its own.
        ``on_unit(i, view)``: called on this thread for each unit that passed its check, while later
        pieces of a large read may still be in flight (a caller copies it out meanwhile).
        """
        with self._lock:
            ents = {i: e for i, nm in enumerate(names) if (e := self.index.get(nm)) is not None}
        out: list[torch.Tensor | None] = [None] * len(names)
        bufs: dict[int, AlignedBuffer | BufferPart] = {}  # a staging buffer for each unit found
        order = sorted(ents, key=lambda i: ents[i][0])
        misses = len(names) - len(order)
        if misses:
            self.stats.add(misses=misses)
        runs: list[list[int]] = []
        end = run_bytes = -1
        for i in order:
            off, n = ents[i][0], ents[i][1]
            ext = self.alloc.round(HEADER_BYTES + n)
            staging = stagings[i]
            bufs[i] = staging if staging is not None and staging.nbytes >= ext else AlignedBuffer(ext)
            if runs and off == end and run_bytes + ext <= max_run_bytes:
                runs[-1].append(i)
                run_bytes += ext
            else:
                runs.append([i])
                run_bytes = ext
            end = off + ext
        exts = [[self.alloc.round(HEADER_BYTES + ents[i][1]) for i in run] for run in runs]
        if self.io_backend == "io_uring" and runs:
            t0 = time.perf_counter()
            gots = self._uring_runs(runs, exts, ents, bufs)
            if self.throttle:
                self.throttle.after_read(sum(map(sum, exts)), t0)
            self.stats.add(read_s=time.perf_counter() - t0)
            for run, ex, got in zip(runs, exts, gots):
                self._check_run(names, run, ex, ents, bufs, got, out, on_unit)
            return out
        pieces = list(zip(runs, exts))
        if sum(map(sum, exts)) >= 2 * self.pipeline_bytes:
            pieces = _split_runs(pieces, self.pipeline_bytes)
        if len(pieces) == 1:
            run, ex = pieces[0]
            self._check_run(names, run, ex, ents, bufs, self._preadv_run(run, ex, ents, bufs), out, on_unit)
            return out
        # a large read: pieces in flight on the store's read-ahead threads, each of which checks
        # (CRC32) and hands out its piece as soon as it is in, while the disk reads the next ones
        pool = self._readahead()

        def piece(run: list[int], ex: list[int]) -> None:
            self._check_run(names, run, ex, ents, bufs, self._preadv_run(run, ex, ents, bufs), out, on_unit)

        futs = [pool.submit(piece, run, ex) for run, ex in pieces]
        wait(futs)  # every piece, even after a failure: no read may land in a buffer handed back
        for fut in futs:
            fut.result()
        return out

    def read_many_later(
        self, names: list[str], stagings: Sequence[AlignedBuffer | BufferPart | None]
    ) -> Future[list[torch.Tensor | None]]:
        """``read_many`` on the store's prefetch thread: the caller copies out earlier units meanwhile.

        The prefetch thread is not one of the read-ahead threads a large ``read_many`` splits into,
        so a prefetch waiting for its pieces can never hold up those pieces.
        """
        with self._lock:
            if self._prefetch is None:
                self._prefetch = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{self.name}-prefetch")
            pool = self._prefetch
        return pool.submit(self.read_many, names, stagings)

    def _preadv_run(self, run: list[int], ex: list[int], ents: dict[int, tuple[int, int, int, int]], bufs: dict) -> int:
        """One ``preadv`` of a run of adjacent units (caps included); bytes read, or -errno."""
        t0 = time.perf_counter()
        try:
            got = os.preadv(self.fd, [bufs[i].view[:x] for i, x in zip(run, ex)], ents[run[0]][0])
        except OSError as e:
            got = -(e.errno or errno.EIO)
        if self.throttle and got >= 0:
            self.throttle.after_read(sum(ex), t0)
        self.stats.add(read_s=time.perf_counter() - t0)
        return got

    def _readahead(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._ra is None:
                self._ra = ThreadPoolExecutor(max_workers=self.readahead_threads, thread_name_prefix=f"{self.name}-ra")
            return self._ra

    def _uring_runs(
        self,
        runs: list[list[int]],
        exts: list[list[int]],
        ents: dict[int, tuple[int, int, int, int]],
        bufs: dict[int, AlignedBuffer | BufferPart],
    ) -> list[int]:
        """All runs in flight at once on an idle ring of this store; bytes read (or -errno) per run."""
        with self._lock:
            ring = self._rings.pop() if self._rings else None
        if ring is None:
            ring = IoUring(64)
        try:
            iovs = [iovec_array([(bufs[i].address, x) for i, x in zip(run, ex)]) for run, ex in zip(runs, exts)]
            return ring.readv([(self.fd, ents[run[0]][0], iov, len(run)) for run, iov in zip(runs, iovs)])
        finally:
            with self._lock:
                self._rings.append(ring)

    def _check_run(
        self,
        names: list[str],
        run: list[int],
        ex: list[int],
        ents: dict[int, tuple[int, int, int, int]],
        bufs: dict[int, AlignedBuffer | BufferPart],
        got: int,
        out: list[torch.Tensor | None],
        on_unit: Callable[[int, torch.Tensor], object] | None = None,
    ) -> None:
        if got < 0:
            self.stats.add(errors=1, misses=len(run))
            log.warning("%s: read of %d unit(s) failed (%s); treated as misses", self.name, len(run), os.strerror(-got))
            if -got in _DEVICE_ERRORS:
                self._fail(OSError(-got, os.strerror(-got)), "slab read")
            return
        pos = 0
        for i, x in zip(run, ex):
            out[i] = view = self._check(names[i], ents[i], bufs[i], got - pos)
            if on_unit is not None and view is not None:
                on_unit(i, view)
            pos += x

    def _check(
        self, name: str, ent: tuple[int, int, int, int], staging: AlignedBuffer | BufferPart, got: int
    ) -> torch.Tensor | None:
        off, n, crc, seq = ent
        why = None
        if got < HEADER_BYTES + n:
            why = f"short read ({max(0, got)} of {HEADER_BYTES + n} bytes: truncated slab?)"
        else:
            magic, ver, _flags, dig, ln, hcrc, hseq = _HEADER.unpack_from(staging.view, 0)
            if magic != MAGIC or ver != VERSION or dig != _digest(name) or ln != n or hcrc != crc or hseq != seq:
                why = "header does not match the index"
            elif zlib.crc32(staging.view[HEADER_BYTES : HEADER_BYTES + n]) != crc:
                why = "checksum mismatch"
        if why is not None:
            log.warning("%s: unit %s is corrupt (%s); dropped, will be recomputed", self.name, name, why)
            with self._lock:
                if self.index.get(name) == ent:  # not replaced meanwhile
                    self.delete(name)
            self.stats.add(corrupt=1, misses=1)
            return None
        self.stats.add(bytes_read=self.alloc.round(HEADER_BYTES + n), reads=1, hits=1)
        return staging.tensor[HEADER_BYTES : HEADER_BYTES + n]

    def delete(self, name: str) -> bool:
        """Remove a unit. False when absent, or when the removal cannot be journaled (the unit then stays)."""
        with self._lock:
            ent = self.index.get(name)
            if ent is None:
                return False
            try:
                self._journal({"o": "d", "n": name})
            except OSError as e:
                self.stats.add(errors=1)
                self._fail(e, f"journal append for deleting {name}")
                return False
            del self.index[name]
            self.alloc.free(ent[0], HEADER_BYTES + ent[1])
            self._maybe_snapshot()
            return True

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> dict[str, int]:
        with self._lock:
            return {k: v[1] for k, v in self.index.items()}

    def page_cache_bytes(self) -> int:
        """Bytes of the slab resident in the page cache right now (mincore)."""
        return resident_bytes(self.slab_path)

    def close(self) -> None:
        if getattr(self, "_fd", None) is None:
            return
        try:
            self.snapshot()
        except OSError as e:
            log.warning("%s: final index snapshot failed (%s); the journal still holds the index", self.name, e)
        os.close(self.jfd)
        with self._lock:
            rings, self._rings = self._rings, []
        for ring in rings:
            ring.close()
        with self._lock:
            pools = [p for p in (self._prefetch, self._ra) if p is not None]  # prefetches wait on pieces
            self._prefetch = self._ra = None
        for p in pools:
            p.shutdown(wait=True)
        os.close(self.fd)  # releases the flock
        self._fd = None

    def __enter__(self) -> PassthroughStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "path": str(self.dir),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.alloc.used,
            "o_direct": self.direct,
            "io_backend": self.io_backend,
            "io_backend_fallback": self.io_backend_why,
            "units": len(self.index),
            "emulated_cap": self.throttle.describe() if self.throttle else None,
        }
