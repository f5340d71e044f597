"""NUMA binding for memory modules: an arena's pages on one node, its reader thread on that node's CPUs.

Linux only, no library needed: node topology from ``/sys/devices/system/node``, the memory policy
set with the ``mbind`` system call (``MPOL_BIND``) on a fresh anonymous mapping before its pages are
first touched, and ``move_pages`` (query mode) to check on which node each page really landed.
Where any of this is missing (another OS, an unknown architecture, a node that is not online, a
seccomp filter, a node without room) the arena is an ordinary unbound one and ``NumaArena.why``
says why; nothing fails.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
from pathlib import Path

import torch

from hwtopo.probe import parse_cpulist  # the kernel's list format, "0-3,8,10-11"

__all__ = [
    "online_nodes",
    "node_cpus",
    "parse_cpulist",
    "NumaArena",
    "page_nodes",
    "pin_thread_to_node",
    "policy_of",
    "supported",
]

log = logging.getLogger(__name__)

NODE_ROOT = Path("/sys/devices/system/node")
MPOL_BIND = 2
MPOL_F_ADDR = 2
# (mbind, move_pages, get_mempolicy) system call numbers
_SYSCALLS = {"x86_64": (237, 279, 239), "aarch64": (235, 239, 236), "arm64": (235, 239, 236)}
_PAGE = mmap.PAGESIZE


def online_nodes(root: Path | None = None) -> list[int]:
    """Ids of the online NUMA nodes ([0] where the platform does not say)."""
    root = root or NODE_ROOT
    try:
        return parse_cpulist((root / "online").read_text()) or [0]
    except (OSError, ValueError):
        return [0]


def node_cpus(node: int, root: Path | None = None) -> list[int]:
    """CPUs of ``node`` ([] if unknown)."""
    root = root or NODE_ROOT
    try:
        return parse_cpulist((root / f"node{node}" / "cpulist").read_text())
    except (OSError, ValueError):
        return []


def _node_free_bytes(node: int, root: Path | None = None) -> int | None:
    root = root or NODE_ROOT
    try:
        for line in (root / f"node{node}" / "meminfo").read_text().splitlines():
            if "MemFree:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def supported() -> str | None:
    """None if NUMA binding can be attempted here, else why not."""
    if not os.uname().sysname == "Linux":
        return f"NUMA binding needs Linux (this is {os.uname().sysname})"
    if platform.machine() not in _SYSCALLS:
        return f"no mbind system call number known for {platform.machine()}"
    if _libc() is None:
        return "the C library cannot be loaded"
    return None


def _address(buf: mmap.mmap) -> int:
    obj = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj


def _mbind(addr: int, length: int, node: int) -> int:
    """``mbind(addr, length, MPOL_BIND, {node})``; returns 0 or an errno."""
    libc = _libc()
    nr = _SYSCALLS[platform.machine()][0]
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    rc = libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(length),
        ctypes.c_int(MPOL_BIND),
        mask,
        ctypes.c_ulong(words * 64 + 1),  # the kernel reads maxnode - 1 bits
        ctypes.c_uint(0),
    )
    return 0 if rc == 0 else (ctypes.get_errno() or errno.EINVAL)


def page_nodes(tensor: torch.Tensor, max_pages: int = 4096) -> list[int]:
    """NUMA node of each page under ``tensor`` (sampled evenly, at most ``max_pages``), via move_pages.

    Negative values are errnos (e.g. -14 for a page not yet touched). Empty if unsupported.
    """
    if supported() is not None or tensor.numel() == 0:
        return []
    start = tensor.data_ptr() // _PAGE * _PAGE
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    n_all = max(1, -(-(end - start) // _PAGE))
    step = max(1, n_all // max_pages)
    addrs = [start + i * _PAGE for i in range(0, n_all, step)]
    pages = (ctypes.c_void_p * len(addrs))(*addrs)
    status = (ctypes.c_int * len(addrs))()
    nr = _SYSCALLS[platform.machine()][1]
    rc = _libc().syscall(
        ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(len(addrs)), pages, None, status, ctypes.c_int(0)
    )
    if rc != 0:
        return []
    return list(status)


def policy_of(tensor: torch.Tensor) -> tuple[int, list[int]] | None:
    """The memory policy (mode, nodes) governing ``tensor``'s first page (get_mempolicy), or None.

    Mode 0 is the default policy (local allocation), 2 is ``MPOL_BIND``.
    """
    if supported() is not None:
        return None
    mode = ctypes.c_int(-1)
    words = 16
    mask = (ctypes.c_ulong * words)()
    nr = _SYSCALLS[platform.machine()][2]
    rc = _libc().syscall(
        ctypes.c_long(nr),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(words * 64 + 1),
        ctypes.c_void_p(tensor.data_ptr()),
        ctypes.c_ulong(MPOL_F_ADDR),
    )
    if rc != 0:
        return None
    return mode.value, [i for i in range(words * 64) if mask[i // 64] >> (i % 64) & 1]


class NumaArena:
    """``nbytes`` of pre-touched memory as a uint8 tensor, bound to ``node`` where possible.

    ``bound`` says whether the pages are under an ``MPOL_BIND`` policy for ``node``; ``why`` says
    why not otherwise. Pages are touched here (after the policy is set), not in the middle of a request.
    """

    def __init__(self, nbytes: int, node: int | None):
        self.nbytes = int(nbytes)
        self.node = node
        self.bound = False
        self.why: str | None = None
        size = max(_PAGE, -(-self.nbytes // _PAGE) * _PAGE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if node is None:
            self.why = "no node requested"
        else:
            self.why = self._bind(size, node)
            self.bound = self.why is None
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[: self.nbytes]
        self.tensor.fill_(0)  # first touch: the pages are allocated now, on the bound node

    def _bind(self, size: int, node: int) -> str | None:
        why = supported()
        if why is not None:
            return why
        nodes = online_nodes()
        if node not in nodes:
            return f"NUMA node {node} is not online on this host (online: {nodes})"
        free = _node_free_bytes(node)
        if free is not None and size > free:
            return f"NUMA node {node} has {free} bytes free, fewer than the arena's {size}"
        err = _mbind(_address(self._map), size, node)
        if err:
            return f"mbind to NUMA node {node} failed: {os.strerror(err)}"
        return None

    def describe(self) -> dict:
        return {"node": self.node, "bound": self.bound, "why_unbound": self.why}


def pin_thread_to_node(node: int | None) -> bool:
    """Restrict the calling thread to ``node``'s CPUs (within its current affinity). False if not done.

    Done only where the host has more than one node (on one node it would change nothing).
    """
    if node is None or not hasattr(os, "sched_setaffinity") or len(online_nodes()) < 2:
        return False
    try:
        allowed = os.sched_getaffinity(0)
        cpus = set(node_cpus(node)) & allowed
        if not cpus or cpus == allowed:
            return False
        os.sched_setaffinity(0, cpus)  # pid 0: the calling thread only
        return True
    except OSError as e:
        log.debug("could not pin the reader thread to node %s: %s", node, e)
        return False
