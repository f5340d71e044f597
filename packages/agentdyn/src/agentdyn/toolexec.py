"""The sandboxed side of a tool call: ``python -m agentdyn.toolexec`` (reads its spec on stdin).

Waits for one JSON line ``{"tool", "args", "limits", "jail"}`` (the parent joins it to its cgroups
first). With a ``jail`` it isolates itself (``agentdyn.jail``: namespaces, read-only filesystem, hard
rlimits, an unprivileged user) and runs the tool in the isolated child; without one (the service's
``--unsafe-no-sandbox``) it only sets hard rlimits. The tool's stdout goes to stderr; the result is
one JSON line on the real stdout: ``{"ok", "result", "error", "usage"}`` (``"layer"`` too when a
sandbox layer could not be set up), where usage covers the tool process and every child it reaped.
The wrapper dies with the service (PR_SET_PDEATHSIG), so no tool outlives a killed service either.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback


def _limits_without_jail(limits: dict) -> None:
    """Without a jail: the same hard limits (soft = hard), as far as the current hard ones allow."""
    from .jail import RLIMITS

    for key, which in RLIMITS.items():
        value = limits.get(key)
        if value is None or which == resource.RLIMIT_NPROC:
            continue  # NPROC counts every process of the service's user, not of this tool
        _, hard = resource.getrlimit(which)
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass


def _die_with_parent() -> None:
    import ctypes

    from .jail import PR_SET_PDEATHSIG

    parent = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:
        os._exit(1)  # the service died before the signal was armed


def _run(spec: dict) -> dict:
    """Isolate (or limit) this process, then run the tool; the result or the reason it did not run."""
    from .jail import JailError, enter

    jail = spec.get("jail")
    try:
        if jail:
            enter({**jail, "limits": spec.get("limits") or {}})
        else:
            _limits_without_jail(spec.get("limits") or {})
    except JailError as e:
        return {"ok": False, "result": None, "error": str(e), "layer": e.layer}
    try:
        from .tools import TOOLS  # after the limits: imports count against them too

        name = spec["tool"]
        if name not in TOOLS:
            raise KeyError(f"unknown tool {name!r}; known: {', '.join(sorted(TOOLS))}")
        return {"ok": True, "result": TOOLS[name](spec.get("args") or {}, os.getcwd()), "error": None}
    except MemoryError:
        return {"ok": False, "result": None, "error": "tool ran out of memory (address-space or cgroup limit)"}
    except Exception as e:  # noqa: BLE001 - the error is the tool's answer
        tb = traceback.format_exc().strip().splitlines()
        return {"ok": False, "result": None, "error": f"{type(e).__name__}: {e}", "trace": tb[-3:]}


def main() -> int:
    t0 = time.monotonic()
    _die_with_parent()
    line = sys.stdin.readline()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # tool chatter goes to stderr; the result line alone goes to the real stdout
    try:
        spec = json.loads(line)
        if not isinstance(spec, dict):
            raise ValueError("the spec must be a JSON object")
    except ValueError as e:
        msg: dict[str, object] = {"ok": False, "result": None, "error": f"bad tool spec: {e}"}
    else:
        msg = _run(spec)
    from .monitor import self_usage

    try:
        msg["usage"] = self_usage(time.monotonic() - t0).to_dict()
    except (OSError, MemoryError):
        msg["usage"] = {}
    data = memoryview((json.dumps(msg, default=str) + "\n").encode())
    while data:
        data = data[os.write(real_stdout, data) :]
    return 0


if __name__ == "__main__":
    sys.exit(main())
