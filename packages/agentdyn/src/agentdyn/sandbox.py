"""Run one tool call as a real subprocess in a sandbox and measure it.

Every tool call runs in ``python -m agentdyn.toolexec``, started in its own session, placed in its
cgroups before it reads its spec, under these layers (``LAYERS``):

- **an unprivileged user**: a uid/gid of its own per work directory (from ``UID_BASE``; no
  supplementary groups, no capabilities, no_new_privs), so it can read only what any user may
  (not /etc/shadow), write only its work directory (mode 0700, its own) and signal only its own
  processes;
- **mount, PID, network, IPC and UTS namespaces** (``agentdyn.jail``): every mount read-only, the
  places that hold other data (``DEFAULT_HIDE`` and the work root) covered by empty tmpfs, the
  request's work directory the one writable place; a /proc showing only the tool's own processes
  (not the service's environment); no network, except that a tool in ``net`` (``web_search``)
  reaches its configured site's port on loopback through a relay and nothing else;
- **an allow-listed environment** (``ENV_ALLOW``): no tokens or API keys of the service;
- **hard rlimits** (soft = hard): CPU seconds, address space, processes, open files, file size;
- **a cgroup per tool call** (memory, pids, CPU accounting; nested in its task class's CPU group)
  that is killed as a whole when the tool ends or times out, so nothing it started outlives it.

``missing_layers()`` names the layers this host does not permit (probed once per process with a
real sandboxed run). ``Sandbox(isolation="strict")`` refuses to start without every layer
(``SandboxUnavailable``), ``"auto"`` runs with those present and logs the rest, ``"off"`` (the
service's ``--unsafe-no-sandbox``) keeps only the environment, rlimits and process-group kill.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

import hwtopo

from .cgroups import CpuGroup
from .monitor import GroupWatcher, Usage, group_pids

__all__ = [
    "SandboxLimits",
    "ToolResult",
    "Sandbox",
    "SandboxUnavailable",
    "missing_layers",
    "zombie_children",
    "ToolTimeout",
    "tool_env",
    "LAYERS",
    "ENV_ALLOW",
]

log = logging.getLogger(__name__)

JAIL_LAYERS = (
    "unprivileged user",
    "mount namespace",
    "pid namespace",
    "network namespace",
    "ipc namespace",
    "uts namespace",
    "read-only filesystem",
)
CGROUP_LAYERS = {"memory": "cgroup memory", "pids": "cgroup pids", "freezer": "cgroup kill"}
LAYERS = (*JAIL_LAYERS, "rlimits", *CGROUP_LAYERS.values())
ISOLATION = ("strict", "auto", "off")
UID_BASE = 2_000_000_000  # far above any distribution's user and subordinate-uid ranges
UID_POOL = 1_000_000
DEFAULT_HIDE = (
    "/root",
    "/home",
    "/tmp",
    "/var/tmp",
    "/run",
    "/dev/shm",
    "/mnt",
    "/media",
    "/srv",
    "/opt",
    "/var/lib",
    "/var/log",
    "/var/mail",
    "/var/spool",
    "/var/cache",
)
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
ENV_ALLOW = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED"}
    | {"PYTHONIOENCODING", "PYTHONUTF8", *THREAD_VARS}
)
MAX_RESULT_BYTES = 16 << 20  # a tool's result line; more is an error, not memory the service spends
STDERR_TAIL_BYTES = 64 << 10


class ToolTimeout(Exception):
    """A tool ran past its timeout and everything it started was killed."""


class SandboxUnavailable(RuntimeError):
    """The host does not permit every sandbox layer; ``missing`` maps each missing one to why."""

    def __init__(self, missing: dict[str, str]):
        detail = "; ".join(f"{layer}: {why}" for layer, why in missing.items())
        super().__init__(
            f"the tool sandbox cannot start: missing layer(s) {', '.join(missing)} ({detail}); "
            "--unsafe-no-sandbox runs tools without them"
        )
        self.missing = dict(missing)


def _processes_default() -> int:
    # threads count too: numerical libraries may start one per core in each process
    return max(256, 4 * (os.cpu_count() or 1))


@dataclass
class SandboxLimits:
    """Resource limits of one tool run: rlimits (soft = hard) and its cgroup's memory and pids."""

    timeout_s: float = 60.0
    address_space_bytes: int = 4 << 30
    memory_bytes: int = 2 << 30
    processes: int = field(default_factory=_processes_default)
    file_size_bytes: int = 512 << 20
    open_files: int = 1024
    cpu_seconds: int | None = None  # default: 2 x timeout + 5

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s!r}")
        for name in ("address_space_bytes", "memory_bytes", "processes", "file_size_bytes", "open_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {v!r}")
        if self.memory_bytes < 1 << 20:
            raise ValueError(f"memory_bytes must be at least 1 MiB, not {self.memory_bytes!r}")

    def to_dict(self) -> dict:
        return {
            "address_space_bytes": self.address_space_bytes,
            "file_size_bytes": self.file_size_bytes,
            "open_files": self.open_files,
            "processes": self.processes,
            "cpu_seconds": self.cpu_seconds or int(2 * self.timeout_s + 5),
        }


@dataclass
class ToolResult:
    """What a tool returned (or why it failed) and what it cost."""

    tool: str
    ok: bool
    output: dict | None
    error: str | None
    usage: Usage
    start: float
    end: float
    killed: bool = False
    group: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "tool": self.tool,
            "ok": self.ok,
            "error": self.error,
            "usage": self.usage.to_dict(),
            "killed": self.killed,
            "group": self.group,
        }


def zombie_children(parent: int | None = None) -> list[int]:
    """Pids in zombie state whose parent is ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2 :].split()
        if rest[0] == "Z" and int(rest[1]) == parent:
            out.append(int(d))
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (empty where the kernel does not list them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tool_env(base: Mapping[str, str], tool_threads: int | str | None = None) -> dict:
    """The environment tools run with: only the ``ENV_ALLOW`` variables (and ``LC_*``) of ``base``,
    never its tokens or keys. ``tool_threads``: ``None`` inherits ``base``'s thread caps (one
    OpenMP thread when it sets none: the polite default on a shared machine); ``"default"`` removes
    them, so numerical libraries start one thread per core the tool may run on, as in an
    unconstrained container; an int caps every library at that many threads."""
    env = {k: v for k, v in base.items() if k in ENV_ALLOW or k.startswith("LC_")}
    if tool_threads is None:
        env.setdefault("OMP_NUM_THREADS", "1")
    elif tool_threads == "default":
        for k in THREAD_VARS:
            env.pop(k, None)
    elif isinstance(tool_threads, int) and not isinstance(tool_threads, bool) and tool_threads >= 1:
        env.update({k: str(tool_threads) for k in THREAD_VARS})
    else:
        raise ValueError(f"tool_threads must be None, 'default' or an integer >= 1, not {tool_threads!r}")
    return env


def keep_paths() -> list[str]:
    """What a sandboxed tool must still read where ``DEFAULT_HIDE`` covers it: this Python and every
    directory on its import path (the interpreter may live under /root or /opt)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, here}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    out: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths}, key=len):
        if p != "/" and not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    return out


_probed: dict[int, dict[str, str]] = {}
_probe_lock = threading.Lock()


def missing_layers(refresh: bool = False) -> dict[str, str]:
    """Each sandbox layer this host does not permit -> why; empty when every layer is there.
    Probed once per process: a real sandboxed run of a tool, and a cgroup with every limit."""
    with _probe_lock:
        if refresh or os.geteuid() not in _probed:
            missing = {}
            if os.geteuid() != 0:
                why = (
                    f"the service runs as uid {os.geteuid()}, not root, so it can neither switch tools "
                    "to an unprivileged user nor give them namespaces"
                )
                missing = {layer: why for layer in JAIL_LAYERS}
            else:
                missing = _probe_jail()
            missing.update(_probe_cgroups())
            _probed[os.geteuid()] = missing
        return dict(_probed[os.geteuid()])


def _probe_cgroups() -> dict[str, str]:
    g = hwtopo.CGroup("agentdyn-probe", memory_bytes=64 << 20, pids_max=64, killable=True)
    try:
        return {
            layer: (
                "no cgroup v1 freezer nor a writable cgroup v2 hierarchy to kill a tool's processes at once"
                if c == "freezer"
                else f"no writable cgroup {c} controller (v1, or v2 with it in cgroup.subtree_control)"
            )
            for c, layer in CGROUP_LAYERS.items()
            if c in g.missing
        }
    finally:
        g.close()


def _probe_jail() -> dict[str, str]:
    """Run ``whereami`` in a full jail as the probe uid and check what it sees."""
    uid = UID_BASE + UID_POOL - 1  # kept out of the pool: never a tool's
    taken = [p.pw_name for p in pwd.getpwall() if UID_BASE <= p.pw_uid < UID_BASE + UID_POOL]
    if taken:
        return {"unprivileged user": f"user(s) {', '.join(taken)} have uids in the sandbox's range from {UID_BASE}"}
    root = tempfile.mkdtemp(prefix="agentdyn-probe-")
    work = os.path.join(root, "w")
    os.mkdir(work, 0o700)
    os.chown(work, uid, uid)
    spec = {
        "tool": "whereami",
        "args": {},
        "limits": SandboxLimits().to_dict(),
        "jail": _jail(uid, work, [*DEFAULT_HIDE, root], keep_paths(), []),
    }
    env = tool_env(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        p = subprocess.run(
            [sys.executable, "-m", "agentdyn.toolexec"],
            input=json.dumps(spec) + "\n",
            capture_output=True,
            text=True,
            cwd=work,
            env=env,
            timeout=60,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    try:
        msg = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = " | ".join(p.stderr.strip().splitlines()[-2:])
        return {"mount namespace": f"the sandboxed probe exited {p.returncode} without a result: {tail}"}
    if not msg.get("ok"):
        return {msg.get("layer") or "mount namespace": msg.get("error") or "the sandboxed probe failed"}
    out = msg["result"]
    if out.get("uid") != uid or out.get("gid") != uid:
        return {"unprivileged user": f"the probe ran as uid {out.get('uid')}, not {uid}"}
    if out.get("pid") != 1:
        return {"pid namespace": f"the probe saw itself as pid {out.get('pid')}, not 1"}
    return {}


def _jail(uid: int, workdir: str, hide: list[str], keep: list[str], forward: list) -> dict:
    return {
        "uid": uid,
        "gid": uid,
        "workdir": workdir,
        "hide": hide,
        "keep": keep,
        "forward": forward,
        "hostname": "agentdyn-tool",
    }


def _check_net(net: dict) -> dict[str, list[tuple[str, int]]]:
    """``{tool: [origin, ...]}`` -> ``{tool: [(host, port), ...]}``; only loopback http origins,
    which a sandboxed tool reaches through a relay (it has no other network)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for tool, origins in net.items():
        out[tool] = []
        for origin in origins:
            u = urllib.parse.urlsplit(str(origin))
            host = u.hostname or ""
            try:
                loop = host == "localhost" or ipaddress.IPv4Address(host).is_loopback
                port = u.port
            except ValueError:
                loop, port = False, None
            if u.scheme != "http" or not loop or not port:
                raise ValueError(
                    f"net[{tool!r}]: {origin!r} is not an http://<loopback IPv4 or localhost>:<port> origin "
                    "(a sandboxed tool reaches only such sites, through a relay)"
                )
            out[tool].append(("127.0.0.1" if host == "localhost" else host, port))
    return out


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_uid_next = [os.getpid() * 7919 % (UID_POOL - 1)]


def _claim_uid() -> int:
    """A uid of the pool no live work directory of this process holds (the pid spreads processes)."""
    with _uid_lock:
        for _ in range(UID_POOL - 1):
            uid = UID_BASE + _uid_next[0]
            _uid_next[0] = (_uid_next[0] + 1) % (UID_POOL - 1)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError(f"every one of the sandbox's {UID_POOL - 1} uids is in use")


class Sandbox:
    """Starts sandboxed tool processes; one per runtime, shared by all requests.

    ``isolation``: ``"strict"`` (every layer or ``SandboxUnavailable``), ``"auto"`` (the layers this
    host permits) or ``"off"``. ``net``: ``{tool: [origin, ...]}``, the only sites those tools
    reach. ``hide``: directories a sandboxed tool sees as empty (plus every work directory's parent).
    """

    def __init__(
        self,
        watcher: GroupWatcher | None = None,
        python: str | None = None,
        env: dict | None = None,
        tool_threads: int | str | None = None,
        isolation: str = "auto",
        net: dict | None = None,
        hide: tuple[str, ...] = DEFAULT_HIDE,
    ):
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}, not {isolation!r}")
        self.net = _check_net(net or {})
        self.missing = missing_layers() if isolation != "off" else {}
        if isolation == "strict" and self.missing:
            raise SandboxUnavailable(self.missing)
        if isolation == "auto" and self.missing:
            log.warning(
                "tools run without sandbox layer(s): %s", "; ".join(f"{k}: {v}" for k, v in self.missing.items())
            )
        self.isolation = isolation
        self.jailed = isolation != "off" and not set(self.missing) & set(JAIL_LAYERS)
        self.cgroups = isolation != "off" and len(set(self.missing) & set(CGROUP_LAYERS.values())) < len(CGROUP_LAYERS)
        self.watcher = watcher or GroupWatcher()
        self.python = python or sys.executable
        self.tool_threads = tool_threads
        self.env = tool_env(os.environ if env is None else env, tool_threads)
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = src + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.hide = tuple(hide)
        self.keep = keep_paths()
        self.live: dict[int, hwtopo.CGroup | None] = {}  # the wrapper's pgid -> the tool's cgroup
        self._uids: dict[str, int] = {}
        self._relays: dict[tuple[str, int], tuple[str, asyncio.AbstractServer]] = {}
        self._state: str | None = None
        # remount each mount read-only instead of one mount_setattr (what kernels before 5.12 get)
        self.legacy_mounts = False

    def describe(self) -> dict:
        """Which layers tools run under here, and which are missing (with why)."""
        present = [
            layer for layer in LAYERS if self.isolation != "off" and layer not in self.missing or layer == "rlimits"
        ]
        return {"isolation": self.isolation, "layers": present, "missing": dict(self.missing)}

    # ------------------------------------------------------------ work directories

    def workdir(self, root: str) -> str:
        """A new work directory under ``root``, named by the server, owned by a uid of its own."""
        path = tempfile.mkdtemp(prefix="req-", dir=root)
        self.claim(path)
        return path

    def claim(self, workdir: str) -> int | None:
        """The uid tools of ``workdir`` run as (given the directory, mode 0700); None unjailed."""
        workdir = os.path.realpath(workdir)
        if not self.jailed:
            return None
        if workdir not in self._uids:
            uid = _claim_uid()
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            self._uids[workdir] = uid
        return self._uids[workdir]

    def release(self, workdir: str, remove: bool = True) -> None:
        """Give ``workdir``'s uid back (its tools have ended) and remove the directory."""
        uid = self._uids.pop(os.path.realpath(workdir), None)
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)
        if remove:
            shutil.rmtree(workdir, ignore_errors=True)

    # ------------------------------------------------------------ network relays

    async def _relay(self, host: str, port: int) -> str:
        """The Unix socket a jailed tool reaches ``host:port`` through (started once)."""
        if (host, port) not in self._relays:
            if self._state is None:
                self._state = tempfile.mkdtemp(prefix="agentdyn-sandbox-")  # 0700: host users stay out
            netdir = os.path.join(self._state, "net")
            os.makedirs(netdir, exist_ok=True)
            os.chmod(netdir, 0o755)
            name = f"{host}_{port}.sock"
            # a socket's path must fit in 108 bytes, which a long TMPDIR exceeds: bound through
            # the directory's descriptor
            fd = os.open(netdir, os.O_PATH | os.O_CLOEXEC)
            try:
                relay = functools.partial(_relay_conn, host, port)
                server = await asyncio.start_unix_server(relay, path=f"/proc/self/fd/{fd}/{name}")
            finally:
                os.close(fd)
            path = os.path.join(netdir, name)
            os.chmod(path, 0o666)
            self._relays[(host, port)] = (path, server)
        return self._relays[(host, port)][0]

    async def _jail_spec(self, tool: str, workdir: str) -> dict:
        forward = [[h, p, await self._relay(h, p)] for h, p in self.net.get(tool, [])]
        uid = self.claim(workdir)
        assert uid is not None  # a jail spec is made only when tools are jailed
        hide = [*self.hide, os.path.dirname(workdir)] + ([self._state] if self._state else [])
        # a forwarded port has its relay socket under the state directory
        keep = self.keep + ([os.path.join(self._state, "net")] if forward and self._state else [])
        return _jail(uid, workdir, hide, keep, forward) | {"legacy_mounts": self.legacy_mounts}

    # ------------------------------------------------------------ running a tool

    def _tool_group(self, tool: str, limits: SandboxLimits, group: CpuGroup | None) -> hwtopo.CGroup | None:
        if not self.cgroups:
            return None
        parent = group.cgroup if group is not None and not group.closed and group.cgroup.paths else None
        return hwtopo.CGroup(
            "agentdyn-" + re.sub(r"[^A-Za-z0-9_.-]", "_", tool)[:40],
            memory_bytes=limits.memory_bytes,
            pids_max=limits.processes,
            killable=True,
            account=True,
            parent=parent,
            strict=self.isolation == "strict",
        )

    def _place(self, pid: int, group: CpuGroup | None, cg: hwtopo.CGroup | None) -> str | None:
        """Put the (waiting) wrapper into its class group and its own; the error where it cannot."""
        if group is not None:
            group.add(pid)
        if cg is None:
            return None
        try:
            cg.add(pid)
        except OSError as e:
            if self.isolation == "strict":
                return f"sandbox layer 'cgroup' could not be set up: joining {cg.name}: {e.strerror or e}"
            log.warning("tool runs outside its cgroup %s: %s", cg.name, e)
        return None

    async def run(
        self,
        tool: str,
        args: dict,
        workdir: str,
        limits: SandboxLimits | None = None,
        group: CpuGroup | None = None,
    ) -> ToolResult:
        """Run ``tool(args)`` in ``workdir``; never raises for tool failures (see ``ToolResult.error``)."""
        limits = limits or SandboxLimits()
        os.makedirs(workdir, exist_ok=True)
        workdir = os.path.realpath(workdir)
        start = time.monotonic()
        spec = {"tool": tool, "args": args, "limits": limits.to_dict()}
        if self.jailed:
            spec["jail"] = await self._jail_spec(tool, workdir)
        threads = getattr(group, "threads", None) if group is not None else None
        env = tool_env(self.env, int(threads)) if threads else self.env  # the class's allocation, told to its libraries
        env = dict(env, HOME=workdir, TMPDIR=workdir)
        if self.jailed:  # its uid has no passwd entry: getpass.getuser() reads these instead
            env.update(USER="agentdyn-tool", LOGNAME="agentdyn-tool")
        cg = self._tool_group(tool, limits, group)
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                "agentdyn.toolexec",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            if cg is not None:
                cg.close()
            raise
        pgid = proc.pid
        self.live[pgid] = cg
        self.watcher.register(pgid)
        reader = asyncio.ensure_future(_collect(proc))
        killed, refused = False, None
        try:
            refused = self._place(proc.pid, group, cg)
            if refused is None:
                killed = not await _exchange(proc, spec, limits.timeout_s)
        finally:
            sampled = self.watcher.unregister(pgid)
            cpu_s = await self._end(proc, pgid, cg)
            out, err = await _finish(reader)
        end = time.monotonic()
        sampled.wall_s = end - start
        if cpu_s is not None:
            sampled.cpu_s = max(sampled.cpu_s, cpu_s)
        name = group.name if group else None
        if refused or killed:
            error = refused or (
                f"tool {tool!r} timed out after {limits.timeout_s:g}s; it and every process it started were killed"
            )
            return ToolResult(tool, False, None, error, sampled, start, end, killed=killed, group=name)
        return _parse(tool, out, err, proc.returncode, sampled, cpu_s, start, end, name)

    async def _end(self, proc: asyncio.subprocess.Process, pgid: int, cg: hwtopo.CGroup | None) -> float | None:
        """Kill whatever the tool left (its jail, its wrapper's session, then its whole cgroup),
        reap the wrapper, remove the group; the group's CPU seconds (None where not accounted)."""
        if proc.returncode is None and self.jailed:
            # the jail's init first: the kernel ends its namespace and the waiting wrapper reaps it
            for pid in _children(proc.pid):
                _kill(pid)
            try:
                await asyncio.wait_for(proc.wait(), timeout=2)
            except asyncio.TimeoutError:
                pass
        _kill_group(pgid, signal.SIGKILL)
        if cg is not None and cg.paths:
            await asyncio.to_thread(cg.kill)
        try:
            await asyncio.wait_for(proc.wait(), timeout=5)
        except asyncio.TimeoutError:
            log.warning("tool process %d did not exit after SIGKILL", proc.pid)
        # unjailed and without a group, members other than the leader are reparented to init
        for _ in range(50):
            if not [p for p in group_pids(pgid) if hwtopo.pid_alive(p)]:
                break
            _kill_group(pgid, signal.SIGKILL)
            await asyncio.sleep(0.02)
        cpu_s = None
        if cg is not None:
            cpu_s = cg.usage().cpu_s
            await asyncio.to_thread(cg.close)
        self.live.pop(pgid, None)
        return cpu_s

    def kill_all(self) -> None:
        """SIGKILL every live tool and everything it started (used on forced shutdown)."""
        for pgid, cg in list(self.live.items()):
            _kill_group(pgid, signal.SIGKILL)
            if cg is not None and cg.paths:
                cg.kill()

    async def close(self) -> None:
        """Kill live tools, stop the relays, give back every uid, remove the relay sockets."""
        self.kill_all()
        for _, server in self._relays.values():
            server.close()
            await server.wait_closed()
        self._relays.clear()
        for workdir in list(self._uids):
            self.release(workdir, remove=False)
        if self._state is not None:
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None


async def _relay_conn(host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection of a jailed tool to its site: bytes both ways until either side closes."""
    try:
        up_r, up_w = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, RuntimeError):
            pass

    try:
        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))
    finally:
        up_w.close()
        writer.close()


async def _exchange(proc: asyncio.subprocess.Process, spec: dict, timeout_s: float) -> bool:
    """Hand the wrapper its spec and wait for it to exit; False when it ran past ``timeout_s``."""
    stdin = proc.stdin
    assert stdin is not None  # started with stdin=PIPE
    try:
        stdin.write(json.dumps(spec).encode() + b"\n")
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # it died already; its exit status and stderr say why
    try:
        await asyncio.wait_for(proc.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


async def _collect(proc: asyncio.subprocess.Process) -> tuple[bytes | None, bytes]:
    """The wrapper's stdout (None when over ``MAX_RESULT_BYTES``) and the last ``STDERR_TAIL_BYTES``
    of its stderr, read until both close: whatever the tool writes, the service holds little of it."""

    async def head(stream: asyncio.StreamReader, cap: int) -> bytes | None:
        buf, over = bytearray(), False
        while chunk := await stream.read(1 << 16):
            over = over or len(buf) + len(chunk) > cap
            if not over:
                buf += chunk
        return None if over else bytes(buf)

    async def tail(stream: asyncio.StreamReader, cap: int) -> bytes:
        buf = bytearray()
        while chunk := await stream.read(1 << 16):
            buf = (buf + chunk)[-cap:]
        return bytes(buf)

    assert proc.stdout is not None and proc.stderr is not None  # started with both piped
    out, err = await asyncio.gather(head(proc.stdout, MAX_RESULT_BYTES), tail(proc.stderr, STDERR_TAIL_BYTES))
    return out, err


async def _finish(reader: asyncio.Future) -> tuple[bytes, bytes]:
    """What ``_collect`` read; pipes a process outside the tool's reach still holds are given up on."""
    try:
        return await asyncio.wait_for(asyncio.shield(reader), timeout=2.0)
    except asyncio.TimeoutError:
        reader.cancel()
        return b"", b""


def _parse(tool, out, err, rc, sampled: Usage, cpu_s, start, end, group) -> ToolResult:
    if out is None:
        error = f"tool {tool!r} wrote more than {MAX_RESULT_BYTES >> 20} MiB of result"
        return ToolResult(tool, False, None, error, sampled, start, end, group=group)
    line = out.decode(errors="replace").strip().splitlines()[-1:] if out else []
    try:
        msg = json.loads(line[0]) if line else None
    except json.JSONDecodeError:
        msg = None
    if not isinstance(msg, dict):
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        error = f"tool {tool!r} exited with code {rc} without a result: {' | '.join(tail) or 'no output'}"
        return ToolResult(tool, False, None, error, sampled, start, end, group=group)
    u = msg.get("usage") or {}
    usage = Usage(
        cpu_s=max(float(u.get("cpu_s", 0.0)), sampled.cpu_s, cpu_s or 0.0),
        wall_s=end - start,
        read_bytes=int(u.get("read_bytes", sampled.read_bytes)),
        write_bytes=int(u.get("write_bytes", sampled.write_bytes)),
        peak_rss_bytes=max(int(u.get("peak_rss_bytes", 0)), sampled.peak_rss_bytes),
        run_wait_s=max(float(u.get("run_wait_s", 0.0)), sampled.run_wait_s),
    )
    extra = {"layer": msg["layer"]} if msg.get("layer") else {}
    return ToolResult(
        tool, bool(msg.get("ok")), msg.get("result"), msg.get("error"), usage, start, end, group=group, extra=extra
    )
