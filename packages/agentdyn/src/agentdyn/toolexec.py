"""The sandboxed side of a tool call: ``python -m agentdyn.toolexec`` (reads its spec on stdin).

Waits for one JSON line ``{"tool", "args", "limits"}`` (the parent joins it to its cgroup first),
sets rlimits, runs the tool with stdout redirected to stderr, and prints one JSON line:
``{"ok", "result", "error", "usage"}`` where usage covers this process and every child it reaped.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback


def _set_limits(limits: dict) -> None:
    pairs = [
        (resource.RLIMIT_AS, limits.get("address_space_bytes")),
        (resource.RLIMIT_FSIZE, limits.get("file_size_bytes")),
        (resource.RLIMIT_NOFILE, limits.get("open_files")),
        (resource.RLIMIT_CPU, limits.get("cpu_seconds")),
    ]
    for which, value in pairs:
        if value is None:
            continue
        soft, hard = resource.getrlimit(which)
        value = int(value)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(which, (value, hard))
        except (ValueError, OSError):
            pass


def main() -> int:
    t0 = time.monotonic()
    line = sys.stdin.readline()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # tool chatter goes to stderr; the result line alone goes to the real stdout
    try:
        spec = json.loads(line)
        _set_limits(spec.get("limits") or {})
        from .tools import TOOLS  # after the limits: imports count against them too

        name = spec["tool"]
        if name not in TOOLS:
            raise KeyError(f"unknown tool {name!r}; known: {', '.join(sorted(TOOLS))}")
        result = TOOLS[name](spec.get("args") or {}, os.getcwd())
        msg = {"ok": True, "result": result, "error": None}
    except MemoryError:
        msg = {"ok": False, "result": None, "error": "tool ran out of memory (address-space rlimit)"}
    except Exception as e:  # noqa: BLE001 - the error is the tool's answer
        tb = traceback.format_exc().strip().splitlines()
        msg = {"ok": False, "result": None, "error": f"{type(e).__name__}: {e}", "trace": tb[-3:]}
    from .monitor import self_usage

    msg["usage"] = self_usage(time.monotonic() - t0).to_dict()
    os.write(real_stdout, (json.dumps(msg, default=str) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
