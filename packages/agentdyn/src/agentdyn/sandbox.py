"""Run one tool call as a real subprocess in a sandbox and measure it.

The tool runs in ``python -m agentdyn.toolexec``: its own session and process group, rlimits
(address space, file size, open files, CPU seconds), a private working directory, and the task
class's cgroup (cpuset/quota) joined *before* the tool starts (the wrapper waits for its spec on
stdin until the parent has placed it). A timeout or a cancellation kills the whole process group
(SIGTERM, then SIGKILL) and reaps it, so no tool leaves processes or zombies behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from .cgroups import CpuGroup
from .monitor import GroupWatcher, Usage, group_pids

__all__ = ["SandboxLimits", "ToolResult", "Sandbox", "zombie_children", "ToolTimeout", "tool_env"]

log = logging.getLogger(__name__)


class ToolTimeout(Exception):
    """A tool ran past its timeout and its process group was killed."""


@dataclass
class SandboxLimits:
    """Resource limits of one tool run."""

    timeout_s: float = 60.0
    address_space_bytes: int = 4 << 30
    file_size_bytes: int = 512 << 20
    open_files: int = 1024
    cpu_seconds: int | None = None  # default: 2 x timeout + 5

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s!r}")

    def to_dict(self) -> dict:
        return {
            "address_space_bytes": self.address_space_bytes,
            "file_size_bytes": self.file_size_bytes,
            "open_files": self.open_files,
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


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def tool_env(base: dict, tool_threads: int | str | None = None) -> dict:
    """The environment tools run with. ``tool_threads``: ``None`` inherits ``base`` (one OpenMP
    thread when it sets none: the polite default on a shared machine); ``"default"`` removes the
    thread caps, so numerical libraries start one thread per core the tool may run on, as in an
    unconstrained container; an int caps every library at that many threads."""
    env = dict(base)
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


class Sandbox:
    """Starts sandboxed tool processes; one per runtime, shared by all requests."""

    def __init__(
        self,
        watcher: GroupWatcher | None = None,
        python: str | None = None,
        env: dict | None = None,
        tool_threads: int | str | None = None,
    ):
        self.watcher = watcher or GroupWatcher()
        self.python = python or sys.executable
        self.tool_threads = tool_threads
        self.env = tool_env(os.environ if env is None else env, tool_threads)
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = src + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        self.live: set[int] = set()

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
        start = time.monotonic()
        env = self.env
        if group is not None and getattr(group, "threads", None):
            env = tool_env(env, int(group.threads))  # the class's allocation, told to its libraries
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
        pgid = proc.pid
        self.live.add(pgid)
        if group is not None:
            group.add(proc.pid)
        self.watcher.register(pgid)
        spec = json.dumps({"tool": tool, "args": args, "limits": limits.to_dict()}).encode() + b"\n"
        killed = False
        out = err = b""
        try:
            out, err = await asyncio.wait_for(proc.communicate(spec), timeout=limits.timeout_s)
        except asyncio.TimeoutError:
            killed = True
            await self._kill(proc, pgid)
        except BaseException:
            killed = True
            await self._kill(proc, pgid)
            raise
        finally:
            sampled = self.watcher.unregister(pgid)
            # stragglers that left the leader (daemonized grandchildren) still share the group
            _kill_group(pgid, signal.SIGKILL)
            self.live.discard(pgid)
        end = time.monotonic()
        if killed:
            sampled.wall_s = end - start
            return ToolResult(
                tool,
                False,
                None,
                f"tool {tool!r} timed out after {limits.timeout_s:g}s; its process group {pgid} was killed",
                sampled,
                start,
                end,
                killed=True,
                group=group.name if group else None,
            )
        return self._parse(tool, out, err, proc.returncode, sampled, start, end, group)

    def _parse(self, tool, out, err, rc, sampled: Usage, start, end, group) -> ToolResult:
        line = out.decode(errors="replace").strip().splitlines()[-1:] if out else []
        try:
            msg = json.loads(line[0]) if line else None
        except json.JSONDecodeError:
            msg = None
        if not isinstance(msg, dict):
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            usage = sampled
            usage.wall_s = end - start
            return ToolResult(
                tool,
                False,
                None,
                f"tool {tool!r} exited with code {rc} without a result: {' | '.join(tail) or 'no output'}",
                usage,
                start,
                end,
                group=group.name if group else None,
            )
        u = msg.get("usage") or {}
        usage = Usage(
            cpu_s=float(u.get("cpu_s", sampled.cpu_s)),
            wall_s=end - start,
            read_bytes=int(u.get("read_bytes", sampled.read_bytes)),
            write_bytes=int(u.get("write_bytes", sampled.write_bytes)),
            peak_rss_bytes=max(int(u.get("peak_rss_bytes", 0)), sampled.peak_rss_bytes),
            run_wait_s=max(float(u.get("run_wait_s", 0.0)), sampled.run_wait_s),
        )
        return ToolResult(
            tool,
            bool(msg.get("ok")),
            msg.get("result"),
            msg.get("error"),
            usage,
            start,
            end,
            group=group.name if group else None,
        )

    async def _kill(self, proc: asyncio.subprocess.Process, pgid: int) -> None:
        _kill_group(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass
        _kill_group(pgid, signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), timeout=5)
        except asyncio.TimeoutError:
            log.warning("tool process %d did not exit after SIGKILL", proc.pid)
        # members other than the leader are reparented to init and reaped there
        for _ in range(50):
            if not group_pids(pgid):
                break
            _kill_group(pgid, signal.SIGKILL)
            await asyncio.sleep(0.02)

    def kill_all(self) -> None:
        """SIGKILL every live tool group (used on forced shutdown)."""
        for pgid in list(self.live):
            _kill_group(pgid, signal.SIGKILL)
