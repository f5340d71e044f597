"""Linux isolation of one tool process, set up from inside it before the tool runs (``agentdyn.toolexec``).

``enter(spec)`` is called by the tool wrapper, which the service starts as root inside the tool's
cgroup. It unshares mount, PID, network, IPC and UTS namespaces and forks: the wrapper stays
outside and only waits; the child is PID 1 of the new namespace, so when it exits the kernel kills
every process it left behind (a ``setsid sleep`` included). The child then

- makes every mount private and read-only (and nosuid), covers the places that hold other users'
  data (``hide``: /root, /home, /tmp, the service's work root, ...) with empty read-only tmpfs,
  binds back what the tool needs from under them (the Python installation: ``keep``) read-only and
  its own work directory read-write, and mounts a fresh /proc that shows only its own processes;
- leaves the network namespace without interfaces, or, for a tool that needs the network, brings
  up loopback and relays each ``forward`` port to a Unix socket the service listens on, which reaches
  only the tool's configured site;
- sets hard rlimits (soft = hard: the tool cannot raise them), switches to the unprivileged
  ``uid``/``gid`` with no supplementary groups and no capabilities, and sets no_new_privs.

Any step that fails raises ``JailError`` naming its layer: the tool never runs half-isolated.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import resource
import select
import signal
import socket
import struct
import threading

__all__ = ["JailError", "enter", "NAMESPACES"]

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = {
    "mount namespace": CLONE_NEWNS,
    "pid namespace": CLONE_NEWPID,
    "network namespace": CLONE_NEWNET,
    "ipc namespace": CLONE_NEWIPC,
    "uts namespace": CLONE_NEWUTS,
}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_OPTION_FLAGS = {
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
# mount_setattr(2) (Linux 5.12) has the same number on every architecture listed here
_MOUNT_SETATTR = 442 if platform.machine() in ("x86_64", "aarch64", "riscv64", "ppc64le", "s390x") else None
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
RLIMITS = {
    "cpu_seconds": resource.RLIMIT_CPU,
    "address_space_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "open_files": resource.RLIMIT_NOFILE,
    "file_size_bytes": resource.RLIMIT_FSIZE,
}

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(RuntimeError):
    """A layer of the sandbox could not be set up; ``layer`` names it."""

    def __init__(self, layer: str, detail: str):
        super().__init__(f"sandbox layer {layer!r} could not be set up: {detail}")
        self.layer = layer


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _ok(rc: int, layer: str, what: str) -> None:
    if rc != 0:
        raise JailError(layer, f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> int:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    return _libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _prctl(option: int, arg: int) -> int:
    return _libc.prctl(
        ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
    )


def enter(spec: dict) -> None:
    """Isolate this process as ``spec`` says. Returns only in the isolated child, as the
    unprivileged user in ``spec["workdir"]``; the calling process waits for it and exits with its status."""
    if _libc.unshare(ctypes.c_int(sum(NAMESPACES.values()))) != 0:
        err = os.strerror(ctypes.get_errno())
        for layer, flag in NAMESPACES.items():  # name the namespace the host refuses
            _ok(_libc.unshare(ctypes.c_int(flag)), layer, "unshare")
        raise JailError("mount namespace", f"unshare of all five namespaces at once: {err}")
    alive_r, alive_w = os.pipe()  # the wrapper holds the write end until it dies
    child = os.fork()
    if child:
        os.close(alive_r)
        _wait_and_exit(child)
    # PID 1 of the new namespace from here on (its parent, outside it, has no pid here)
    os.close(alive_w)
    _die_with(alive_r)
    listeners = _build(spec)
    _drop(spec["uid"], spec["gid"])
    _die_with(alive_r)  # the uid change disarmed the death signal
    os.close(alive_r)
    os.chdir(spec["workdir"])
    for srv, path in listeners:
        threading.Thread(target=_accept, args=(srv, path), daemon=True).start()


def _die_with(alive_r: int) -> None:
    """SIGKILL this process when the wrapper dies (and so the namespace with every tool process),
    or exit now if it already has (the read end of its pipe sees EOF)."""
    _ok(_prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "pid namespace", "PR_SET_PDEATHSIG")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(1)


def _wait_and_exit(child: int) -> None:
    """The wrapper: outside the namespaces' PID space, it only waits for the jailed child."""
    os.close(0)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _build(spec: dict) -> list[tuple[socket.socket, str]]:
    """Mounts, host name, network and limits, all as root inside the new namespaces."""
    _mounts(spec)
    try:
        socket.sethostname(spec.get("hostname", "agentdyn-tool"))
    except OSError as e:
        raise JailError("uts namespace", f"sethostname: {e.strerror}") from None
    listeners = _network(spec.get("forward") or [])
    _rlimits(spec["limits"])
    return listeners


def _mounts(spec: dict) -> None:
    layer = "read-only filesystem"
    _ok(_mount(None, "/", None, MS_REC | MS_PRIVATE), "mount namespace", "making every mount private")
    # outer before inner, the work directory last: a later bind is never covered by an earlier one
    binds = [(p, False) for p in sorted(spec.get("keep", []), key=len)] + [(spec["workdir"], True)]
    # open what will be bound before the tmpfs mounts hide it; bound from /proc/self/fd
    sources = []
    for path, rw in binds:
        try:
            sources.append((os.open(path, os.O_PATH | os.O_CLOEXEC), path, rw))
        except OSError as e:
            raise JailError(layer, f"opening {path}: {e.strerror}") from None
    os.umask(0o022)
    for path in _outermost(spec.get("hide", [])):
        _ok(
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755"),
            layer,
            f"hiding {path}",
        )
    for fd, path, rw in sources:
        if not rw and not any(_under(path, h) for h in spec.get("hide", [])):
            os.close(fd)
            continue  # visible (read-only) anyway
        os.makedirs(path, exist_ok=True)
        _ok(_mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | (0 if rw else MS_REC)), layer, f"binding {path}")
        os.close(fd)
    legacy = bool(spec.get("legacy_mounts"))
    _readonly_tree(layer, legacy)
    _writable(spec["workdir"], layer, legacy)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
    _ok(_mount("proc", "/proc", "proc", flags), "pid namespace", "mounting /proc for the new PID namespace")


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _outermost(paths: list[str]) -> list[str]:
    """Existing directories of ``paths`` not inside another of them (covering that covers them too)."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths}, key=len):
        if os.path.isdir(p) and not os.path.islink(p) and not any(_under(p, q) for q in out):
            out.append(p)
    return out


def _readonly_tree(layer: str, legacy: bool = False) -> None:
    """Every mount of this namespace read-only and nosuid (mount_setattr, else one remount each)."""
    if _MOUNT_SETATTR is not None and not legacy:
        attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
        rc = _libc.syscall(
            ctypes.c_long(_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(b"/"),
            ctypes.c_uint(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        if rc == 0:
            return
        if ctypes.get_errno() not in (38, 22):  # ENOSYS, EINVAL: an older kernel; remount one by one
            _ok(rc, layer, "mount_setattr on /")
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    points = [_unescape(r[4]) for r in rows]
    for i, (row, point) in enumerate(zip(rows, points)):
        if point in points[i + 1 :]:
            continue  # covered by a later mount at the same place: unreachable
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for opt in row[5].split(","):
            flags |= _OPTION_FLAGS.get(opt, 0)
        _ok(_mount(None, point, None, flags), layer, f"remounting {point} read-only")


def _unescape(path: str) -> str:
    """/proc/self/mountinfo writes spaces, tabs, newlines and backslashes as octal escapes."""
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _writable(path: str, layer: str, legacy: bool = False) -> None:
    """The work directory's bind mount read-write again (nosuid, nodev, noexec: nothing the tool
    writes is run as a program; Python reads its .py files, it does not execute them)."""
    if _MOUNT_SETATTR is not None and not legacy:
        attr = _MountAttr(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC, MOUNT_ATTR_RDONLY, 0, 0)
        rc = _libc.syscall(
            ctypes.c_long(_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.c_uint(0),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        if rc == 0:
            return
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC
    _ok(_mount(None, path, None, flags), layer, f"making {path} writable")


def _network(forward: list) -> list[tuple[socket.socket, str]]:
    """Loopback up and a listener per forwarded port, for a tool that needs its site; else nothing."""
    if not forward:
        return []
    layer = "network namespace"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
        out = []
        for host, port, path in forward:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.bind((host, int(port)))
            srv.listen(64)
            # a socket's path must fit in 108 bytes; its directory's descriptor keeps it short
            fd = os.open(os.path.dirname(path), os.O_PATH | os.O_CLOEXEC)
            out.append((srv, f"/proc/self/fd/{fd}/{os.path.basename(path)}"))
        return out
    except OSError as e:
        raise JailError(layer, f"loopback relay: {e}") from None


def _accept(srv: socket.socket, path: str) -> None:
    while True:
        conn, _ = srv.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(path)
        except OSError:
            conn.close()
            up.close()
            continue
        threading.Thread(target=_pump, args=(conn, up), daemon=True).start()
        threading.Thread(target=_pump, args=(up, conn), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _rlimits(limits: dict) -> None:
    """Hard limits (soft = hard), set while still root so that the tool cannot raise them."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, which in RLIMITS.items():
        value = limits.get(key)
        if value is None:
            continue
        try:
            resource.setrlimit(which, (int(value), int(value)))
        except (ValueError, OSError) as e:
            raise JailError("rlimits", f"{key}={value}: {e}") from None


def _drop(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` for good: no groups, no capabilities, no way back (no_new_privs)."""
    layer = "unprivileged user"
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise JailError(layer, f"switching to uid {uid}: {e.strerror}") from None
    _ok(_prctl(PR_SET_NO_NEW_PRIVS, 1), layer, "PR_SET_NO_NEW_PRIVS")
    # the uid change made this process undumpable, which hands its /proc/self files to root; the
    # tool's own processes (same uid, same PID namespace) are all that could attach to it
    _ok(_prctl(PR_SET_DUMPABLE, 1), layer, "PR_SET_DUMPABLE")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k.startswith("Cap")}
    if os.getresuid() != (uid, uid, uid) or any(int(caps.get(k, "0"), 16) for k in ("CapPrm", "CapEff", "CapAmb")):
        raise JailError(layer, f"still privileged after the switch to uid {uid}: {caps}")
    try:
        os.setuid(0)
    except OSError:
        return
    raise JailError(layer, "the tool could switch back to root")
