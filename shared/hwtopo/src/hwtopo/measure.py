"""Light microbenchmarks (seconds, not minutes) whose results attach to the model.

matmul throughput per thread count (torch, else numpy), memory copy bandwidth (stdlib memcpy of a
bytearray), and disk read/write bandwidth on a path, buffered and with O_DIRECT.
"""

from __future__ import annotations

import logging
import mmap
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .model import Disk, Machine

__all__ = [
    "MatmulResult",
    "DiskResult",
    "matmul_flops",
    "memcpy_bandwidth",
    "disk_bandwidth",
    "attach",
]

log = logging.getLogger(__name__)
ALIGN = 4096


@dataclass(frozen=True)
class MatmulResult:
    flops: float
    threads: int
    size: int
    backend: str


@dataclass(frozen=True)
class DiskResult:
    path: str
    bytes: int
    write_bytes_per_s: float
    read_bytes_per_s: float
    direct: bool
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self)


def _timeit(fn, seconds: float, min_reps: int = 3) -> float:
    """Median seconds per call of fn over ~``seconds`` of wall time (after one warm-up)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return statistics.median(times)


def matmul_flops(size: int = 512, threads: int | None = None, seconds: float = 0.5) -> MatmulResult:
    """FLOP/s of a square fp32 matmul at ``threads`` intra-op threads (torch, else numpy)."""
    flop = 2.0 * size**3
    try:
        import torch

        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            a = torch.randn(size, size)
            b = torch.randn(size, size)
            t = _timeit(lambda: torch.mm(a, b), seconds)
            return MatmulResult(flop / t, torch.get_num_threads(), size, "torch")
        finally:
            torch.set_num_threads(old)
    except ImportError:
        pass
    try:
        import numpy as np
    except ImportError:
        raise RuntimeError("matmul_flops needs torch or numpy; pip install 'mlsyskit-hwtopo[measure]'") from None
    x = np.random.rand(size, size).astype("float32")
    y = np.random.rand(size, size).astype("float32")
    t = _timeit(lambda: x @ y, seconds)
    return MatmulResult(flop / t, threads or 0, size, "numpy")


def memcpy_bandwidth(nbytes: int = 64 << 20, seconds: float = 0.3) -> float:
    """Bytes/s of a large in-memory copy (read + write counted once, like `STREAM copy`)."""
    src = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    dst = bytearray(len(src))
    mv_src, mv_dst = memoryview(src), memoryview(dst)

    def copy() -> None:
        mv_dst[:] = mv_src

    return len(src) / _timeit(copy, seconds)


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous buffer (what O_DIRECT needs)."""
    return mmap.mmap(-1, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


def disk_bandwidth(
    path: str | os.PathLike, nbytes: int = 64 << 20, direct: bool = True, block: int = 4 << 20
) -> DiskResult:
    """Write then read ``nbytes`` in a temp file under ``path``.

    With ``direct`` the file is opened with O_DIRECT (falls back to buffered I/O with a note when the
    filesystem refuses it); buffered reads first evict the file from the page cache so they hit the
    disk.
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"disk_bandwidth: {str(d)!r} is not a directory")
    nbytes = max(block, nbytes // block * block)
    notes: list[str] = []
    f = d / f".hwtopo-measure-{os.getpid()}"
    buf = _aligned(block)
    buf.write(os.urandom(block))
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    use_direct = direct and hasattr(os, "O_DIRECT")
    if direct and not use_direct:
        notes.append("O_DIRECT not available on this platform: buffered I/O")
    try:
        try:
            fd = os.open(f, flags | (os.O_DIRECT if use_direct else 0), 0o600)
        except OSError as e:
            if not use_direct:
                raise
            notes.append(f"O_DIRECT refused ({e.strerror}): buffered I/O")
            use_direct = False
            fd = os.open(f, flags, 0o600)
        try:
            t0 = time.perf_counter()
            for off in range(0, nbytes, block):
                os.pwrite(fd, buf, off)
            os.fsync(fd)
            t_write = time.perf_counter() - t0
            if not use_direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, nbytes, block):
                os.preadv(fd, [buf], off)
            t_read = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        f.unlink(missing_ok=True)
        buf.close()
    return DiskResult(str(d), nbytes, nbytes / t_write, nbytes / t_read, use_direct, tuple(notes))


def attach(machine: Machine, matmul: MatmulResult | None = None, disks: dict[str, DiskResult] | None = None) -> Machine:
    """Return ``machine`` with measured flops and disk bandwidths filled in."""
    changes: dict = {}
    if matmul is not None:
        changes["flops"] = matmul.flops
    if disks:
        new = []
        for disk in machine.disks:
            r = disks.get(disk.name)
            if r is not None:
                disk = Disk(
                    name=disk.name,
                    path=disk.path,
                    rotational=disk.rotational,
                    capacity_bytes=disk.capacity_bytes,
                    read_bandwidth_bytes_per_s=r.read_bytes_per_s,
                    write_bandwidth_bytes_per_s=r.write_bytes_per_s,
                )
            new.append(disk)
        changes["disks"] = tuple(new)
    return machine.with_(**changes)
