"""A minimal io_uring ring over raw system calls (no liburing): batched vectored reads, one syscall.

The passthrough store's ``io_uring`` backend uses it to put all of a read's runs in flight at once
(queue depth from one thread) instead of one ``preadv`` after another. Only what that needs:
``io_uring_setup``, the three ring mappings, ``IORING_OP_READV`` submissions and completion
reaping. ``IoUring.available()`` says why not where the kernel, the architecture or a seccomp
filter does not allow it; the store then falls back to ``preadv``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import threading

__all__ = ["IoUring", "iovec_array", "buffer_address"]

_SYSCALLS = {"x86_64": (425, 426), "aarch64": (425, 426), "arm64": (425, 426)}  # setup, enter
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
IORING_FEAT_SINGLE_MMAP = 1
IORING_ENTER_GETEVENTS = 1
IORING_OP_READV = 1
_SQE = struct.Struct("<BBHiQQIIQ")  # opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data (+ 24 pad)
_CQE = struct.Struct("<QiI")  # user_data, res, flags
_U32 = struct.Struct("<I")


class _SQOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped")] + [
        ("array", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _CQOff(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes")] + [
        ("flags", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SQOff),
        ("cq_off", _CQOff),
    ]


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def buffer_address(buf) -> int:
    """Address of a writable buffer (mmap, bytearray) without keeping it exported."""
    obj = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj


def iovec_array(pieces: list[tuple[int, int]]) -> ctypes.Array[_IOVec]:
    """A ctypes ``struct iovec[]`` of (address, length) pieces."""
    arr = (_IOVec * len(pieces))()
    for j, (addr, ln) in enumerate(pieces):
        arr[j].base, arr[j].len = addr, ln
    return arr


_libc = None
_probe: tuple[bool, str | None] | None = None
_probe_lock = threading.Lock()


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class IoUring:
    """One submission/completion ring. Not thread-safe: one user at a time (the store keeps a free list)."""

    def __init__(self, entries: int = 64):
        if platform.machine() not in _SYSCALLS or os.uname().sysname != "Linux":
            raise OSError(errno.ENOSYS, f"io_uring: not supported on {os.uname().sysname}/{platform.machine()}")
        p = _Params()
        fd = _c().syscall(ctypes.c_long(_SYSCALLS[platform.machine()][0]), ctypes.c_uint(entries), ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno() or errno.ENOSYS
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        try:
            self.sq_entries, self.cq_entries = p.sq_entries, p.cq_entries
            sq_size = p.sq_off.array + p.sq_entries * 4
            cq_size = p.cq_off.cqes + p.cq_entries * _CQE.size
            single = bool(p.features & IORING_FEAT_SINGLE_MMAP)
            if single:
                sq_size = cq_size = max(sq_size, cq_size)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self.sq = mmap.mmap(fd, sq_size, mmap.MAP_SHARED, prot, offset=IORING_OFF_SQ_RING)
            self.cq = self.sq if single else mmap.mmap(fd, cq_size, mmap.MAP_SHARED, prot, offset=IORING_OFF_CQ_RING)
            self.sqes = mmap.mmap(fd, p.sq_entries * 64, mmap.MAP_SHARED, prot, offset=IORING_OFF_SQES)
        except BaseException:
            os.close(fd)
            raise
        so, co = p.sq_off, p.cq_off
        self._sq_head, self._sq_tail, self._sq_array = so.head, so.tail, so.array
        self._sq_mask = _U32.unpack_from(self.sq, so.ring_mask)[0]
        self._cq_head, self._cq_tail, self._cqes = co.head, co.tail, co.cqes
        self._cq_mask = _U32.unpack_from(self.cq, co.ring_mask)[0]
        self.features = p.features

    @staticmethod
    def available() -> str | None:
        """None if a ring can be set up here, else why not (checked once)."""
        global _probe
        with _probe_lock:
            if _probe is None:
                try:
                    IoUring(2).close()
                    _probe = (True, None)
                except OSError as e:
                    _probe = (False, str(e))
            return _probe[1]

    def _enter(self, to_submit: int, min_complete: int) -> int:
        nr = _SYSCALLS[platform.machine()][1]
        while True:
            rc = _c().syscall(
                ctypes.c_long(nr),
                ctypes.c_int(self.fd),
                ctypes.c_uint(to_submit),
                ctypes.c_uint(min_complete),
                ctypes.c_uint(IORING_ENTER_GETEVENTS if min_complete else 0),
                None,
                ctypes.c_size_t(0),
            )
            if rc >= 0:
                return rc
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def readv(self, reqs: list[tuple[int, int, ctypes.Array[_IOVec], int]]) -> list[int]:
        """Vectored reads ``(fd, offset, iovec_array, n_iovecs)``, all in flight together.

        Returns per request the bytes read or ``-errno``, in request order. The iovec arrays and
        the buffers they point to must stay alive until this returns (they do: the caller holds them).
        """
        res: list[int | None] = [None] * len(reqs)
        nxt = unsubmitted = inflight = 0
        while nxt < len(reqs) or unsubmitted or inflight:
            tail = _U32.unpack_from(self.sq, self._sq_tail)[0]
            head = _U32.unpack_from(self.sq, self._sq_head)[0]
            added = 0
            while (
                nxt < len(reqs)
                and (tail - head) & 0xFFFFFFFF < self.sq_entries
                and inflight + unsubmitted + added < self.cq_entries
            ):
                fd, off, iov, n = reqs[nxt]
                idx = tail & self._sq_mask
                self.sqes[idx * 64 : idx * 64 + 64] = bytes(64)
                _SQE.pack_into(self.sqes, idx * 64, IORING_OP_READV, 0, 0, fd, off, ctypes.addressof(iov), n, 0, nxt)
                _U32.pack_into(self.sq, self._sq_array + 4 * idx, idx)
                tail = (tail + 1) & 0xFFFFFFFF
                nxt += 1
                added += 1
            if added:
                _U32.pack_into(self.sq, self._sq_tail, tail)  # publish after the entries are written
                unsubmitted += added
            done = self._enter(unsubmitted, 1 if (inflight + unsubmitted) else 0)
            unsubmitted -= done
            inflight += done
            ch = _U32.unpack_from(self.cq, self._cq_head)[0]
            ct = _U32.unpack_from(self.cq, self._cq_tail)[0]
            while ch != ct:
                user, r, _flags = _CQE.unpack_from(self.cq, self._cqes + (ch & self._cq_mask) * _CQE.size)
                res[user] = r
                inflight -= 1
                ch = (ch + 1) & 0xFFFFFFFF
            _U32.pack_into(self.cq, self._cq_head, ch)
        return [r if r is not None else -errno.EIO for r in res]

    def close(self) -> None:
        if self.fd is None:
            return
        for m in {id(x): x for x in (self.sqes, self.cq, self.sq)}.values():
            m.close()
        os.close(self.fd)
        self.fd = None
