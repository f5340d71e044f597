"""Tool and task-class profiles learned from the monitor: what each tool costs when it runs alone.

``ToolProfile`` keeps running means of CPU seconds, wall seconds, disk bytes, peak RSS and the CPU
pressure seen, per ``task_type/tool``. Intensity is CPU seconds per *uncontended* wall second
(wall minus the run-queue wait the monitor reads from schedstat), so it is learned from runs alone
and under load alike. Saved as JSON, atomically.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hwtopo

from .monitor import Usage

__all__ = ["ToolProfile", "ProfileStore"]


@dataclass
class ToolProfile:
    n: int = 0
    n_alone: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    peak_rss_bytes: float = 0.0
    cpu_pressure: float = 0.0
    calls_per_request: float = 0.0

    @property
    def cpu_intensity(self) -> float:
        return min(1.5, self.cpu_s / self.wall_s) if self.wall_s > 0 else 1.0

    def update(self, u: Usage, alone: bool, pressure: float = 0.0, alpha: float = 0.2) -> None:
        """Fold in one run; wall time is taken uncontended (minus run-queue wait), so runs made
        under contention still teach the intensity a run would have alone."""
        self.n += 1
        a = 1.0 / self.n if self.n <= 5 else alpha
        wall = max(u.cpu_s, u.wall_s - u.run_wait_s)
        self.cpu_s += a * (u.cpu_s - self.cpu_s)
        self.wall_s += a * (wall - self.wall_s)
        self.read_bytes += a * (u.read_bytes - self.read_bytes)
        self.write_bytes += a * (u.write_bytes - self.write_bytes)
        self.peak_rss_bytes = max(self.peak_rss_bytes, float(u.peak_rss_bytes))
        if alone:
            self.n_alone += 1
            b = 1.0 / self.n_alone if self.n_alone <= 5 else alpha
            self.cpu_pressure += b * (pressure - self.cpu_pressure)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_intensity"] = round(self.cpu_intensity, 4)
        return d


@dataclass
class ProfileStore:
    tools: dict[str, ToolProfile] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)  # mean latency of a request alone, per type

    @staticmethod
    def key(task_type: str, tool: str) -> str:
        return f"{task_type}/{tool}"

    def get(self, task_type: str, tool: str) -> ToolProfile | None:
        return self.tools.get(self.key(task_type, tool))

    def observe(self, task_type: str, tool: str, usage: Usage, alone: bool = False, pressure: float = 0.0) -> None:
        self.tools.setdefault(self.key(task_type, tool), ToolProfile()).update(usage, alone, pressure)

    def observe_request(self, task_type: str, latency_s: float | None = None) -> None:
        n = self.requests.get(task_type, 0) + 1
        self.requests[task_type] = n
        if latency_s is not None:
            prev = self.latency_s.get(task_type, latency_s)
            self.latency_s[task_type] = prev + (latency_s - prev) / n

    def cores_per_request(self) -> dict[str, float]:
        """Per type measured alone: the cores a request keeps busy while in flight (its tools' CPU
        seconds over its latency); what sizes a workload to an offered CPU load."""
        out = {}
        for t, c in self.classes().items():
            lat = self.latency_s.get(t)
            out[t] = c["cpu_s"] / lat if lat else c["cpu_intensity"]
        return out

    def classes(self) -> dict[str, dict]:
        """Per task type: CPU seconds and tool wall seconds per request, and the class's intensity."""
        out: dict[str, dict] = {}
        for k, p in self.tools.items():
            tt, tool = k.split("/", 1)
            nreq = max(1, self.requests.get(tt, 1))
            calls = p.n / nreq
            c = out.setdefault(tt, {"cpu_s": 0.0, "wall_s": 0.0, "read_bytes": 0.0, "write_bytes": 0.0})
            c["cpu_s"] += p.cpu_s * calls
            c["wall_s"] += p.wall_s * calls
            c["read_bytes"] += p.read_bytes * calls
            c["write_bytes"] += p.write_bytes * calls
        for c in out.values():
            c["cpu_intensity"] = c["cpu_s"] / c["wall_s"] if c["wall_s"] > 0 else 1.0
        return out

    def to_dict(self) -> dict:
        return {
            "tools": {k: v.to_dict() for k, v in self.tools.items()},
            "requests": dict(self.requests),
            "latency_s": dict(self.latency_s),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ProfileStore:
        names = set(ToolProfile.__dataclass_fields__)
        tools = {k: ToolProfile(**{f: v for f, v in p.items() if f in names}) for k, p in d.get("tools", {}).items()}
        return cls(tools, dict(d.get("requests", {})), dict(d.get("latency_s", {})))

    def save(self, path: str | Path) -> None:
        hwtopo.atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> ProfileStore:
        """Profiles saved by :meth:`save`; a file that is not one raises ValueError naming it."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not an agentdyn profiles file ({type(e).__name__}: {e})") from None
