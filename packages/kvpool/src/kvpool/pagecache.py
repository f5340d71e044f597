"""How many bytes of a file sit in the kernel page cache, measured with mincore(2).

``resident_bytes(path)`` maps the file read-only and asks the kernel which of its pages are
resident: the exact page-cache footprint of that file, independent of what else runs on the host.
``meminfo_cached_bytes()`` is the host-wide ``Cached`` figure of /proc/meminfo, a noisy secondary
measure on a shared machine. ``drop(path)`` asks the kernel to evict a file's clean pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os

__all__ = ["resident_bytes", "meminfo_cached_bytes", "drop", "mincore_available"]

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
_libc = None


def _lib():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def mincore_available() -> bool:
    try:
        return hasattr(_lib(), "mincore")
    except OSError:
        return False


def resident_bytes(path: str | os.PathLike) -> int:
    """Bytes of ``path`` resident in the page cache (0 for an empty or missing file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        lib = _lib()
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(b & 1 for b in bytes(vec))
        finally:
            lib.munmap(ctypes.c_void_p(addr), size)
        return min(size, resident * PAGE)
    finally:
        os.close(fd)


def meminfo_cached_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def drop(path: str | os.PathLike) -> None:
    """Evict ``path`` from the page cache: write back dirty pages (fsync), then POSIX_FADV_DONTNEED."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)  # DONTNEED skips dirty pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
