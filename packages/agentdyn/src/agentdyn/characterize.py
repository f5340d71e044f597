"""Characterization: each task type alone and mixed, at rising concurrency, LLM speeds and core
counts, with the latency of every request broken down into LLM wait, tool CPU, tool run-queue wait
(CPU contention), tool I/O and other waiting, and admission/limit queueing.

Core counts are emulated by pinning every tool to the first ``cores`` CPUs (a cpuset group);
LLM speed by the emulator's time to first token and tokens/s. Both are labelled emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hwtopo import usable_cpus

from .bench import WorkloadConfig, calibrate, task_input
from .cgroups import CpuGroup
from .emulator import EmulatorConfig
from .monitor import SystemSampler
from .runtime import AgentRequest, Harness
from .scheduler import NativePolicy

__all__ = ["CharacterizeConfig", "characterize", "breakdown", "PinnedPolicy"]


class PinnedPolicy(NativePolicy):
    """No control, but every tool runs on the given cores only (emulates a machine with fewer cores)."""

    name = "native-pinned"

    def __init__(self, cpus: list[int]):
        self.cpus = list(cpus)
        self.group = CpuGroup(f"pin{len(cpus)}", cpus=self.cpus)

    @contextlib.asynccontextmanager
    async def tool_slot(self, request_id: str, task_type: str, tool: str) -> AsyncIterator[CpuGroup | None]:
        yield self.group

    def describe(self) -> dict:
        return {"name": self.name, "cpus": self.cpus, "emulated": True, "group": self.group.describe()}

    def close(self) -> None:
        self.group.close()


@dataclass
class CharacterizeConfig:
    concurrency: tuple[int, ...] = (1, 2, 4)
    llm_ttft_s: tuple[float, ...] = (0.3, 0.05)
    cores: tuple[int, ...] = (1, 2)
    types: tuple[str, ...] = ("rag_qa", "web_search", "coding")
    mixed: bool = True
    coding_work: int = 40_000

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency: need integers >= 1")
        if not self.cores or min(self.cores) < 1:
            raise ValueError("cores: need integers >= 1")


def breakdown(results) -> dict:
    """Mean latency and its parts (seconds per request) over a list of ``AgentResult``."""
    n = len(results)
    if not n:
        return {}
    lat = statistics.fmean(r.latency_s for r in results)
    llm = sum(r.usage.llm_wait_s for r in results) / n
    queue = sum(r.usage.queue_wait_s for r in results) / n
    cpu = sum(r.usage.tools.cpu_s for r in results) / n
    runq = sum(r.usage.tools.run_wait_s for r in results) / n
    wall = sum(r.usage.tools.wall_s for r in results) / n
    io = max(0.0, wall - cpu - runq)
    return {
        "n": n,
        "failed": sum(not r.ok for r in results),
        "latency_s": lat,
        "llm_wait_s": llm,
        "tool_cpu_s": cpu,
        "tool_cpu_contention_s": runq,
        "tool_io_other_s": io,
        "queue_s": queue,
        "other_s": max(0.0, lat - llm - wall - queue),
        "read_bytes": sum(r.usage.tools.read_bytes for r in results) / n,
        "write_bytes": sum(r.usage.tools.write_bytes for r in results) / n,
        "peak_rss_bytes": max(r.usage.tools.peak_rss_bytes for r in results),
    }


async def characterize(cfg: CharacterizeConfig, progress=None) -> dict:
    """Run the grid; returns {"rows": [...], "profiles": ..., "config": ...}."""
    cpus = usable_cpus()
    wl = WorkloadConfig(coding_work=cfg.coding_work, types=tuple(cfg.types))
    rows: list[dict] = []
    sampler = SystemSampler(0.1).start()
    try:
        async with Harness(emulator=EmulatorConfig(ttft_s=cfg.llm_ttft_s[0], tokens_per_s=80.0), sampler=sampler) as h:
            store = await calibrate(h, wl, sampler)
            assert h.emulator is not None  # built from the EmulatorConfig above
            for ncores in cfg.cores:
                if ncores > len(cpus):
                    continue
                for ttft in cfg.llm_ttft_s:
                    h.emulator.config = EmulatorConfig(ttft_s=ttft, tokens_per_s=80.0 * (0.3 / max(ttft, 0.05)) ** 0.5)
                    pol = PinnedPolicy(cpus[:ncores])
                    h.set_policy(pol)
                    scenarios = [(t, (t,)) for t in cfg.types] + ([("mixed", cfg.types)] if cfg.mixed else [])
                    for name, types in scenarios:
                        for conc in cfg.concurrency:
                            if progress:
                                progress(f"cores={ncores} ttft={ttft}s {name} x{conc}")
                            reqs = [
                                AgentRequest(
                                    types[i % len(types)],
                                    task_input(types[i % len(types)], i, wl),
                                    request_id=f"ch-{name}-{ncores}-{conc}-{i}",
                                )
                                for i in range(conc if name != "mixed" else conc * len(types))
                            ]
                            t0 = time.monotonic()
                            res = await asyncio.gather(*(h.runtime.run(r) for r in reqs))
                            psum = sampler.summary(since=t0)
                            for t in types:
                                b = breakdown([r for r in res if r.task_type == t])
                                rows.append(
                                    {
                                        "cores": ncores,
                                        "llm_ttft_s": ttft,
                                        "scenario": name,
                                        "concurrency": conc,
                                        "task_type": t,
                                        **b,
                                        "cpu_pressure_mean": psum.get("cpu_some_mean"),
                                        "io_pressure_mean": psum.get("io_some_mean"),
                                        "mem_pressure_mean": psum.get("mem_some_mean"),
                                    }
                                )
            h.set_policy(NativePolicy())
    finally:
        sampler.stop()
    return {
        "rows": rows,
        "profiles": store.to_dict(),
        "classes": store.classes(),
        "config": {**cfg.__dict__, "emulated": {"cores": "cpuset pinning of tools", "llm": "agentdyn emulator"}},
        "sampler_overhead": sampler.overhead(),
        "pressure_source": sampler.source,
    }
