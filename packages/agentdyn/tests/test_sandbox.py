"""Sandbox: own process group and session, rlimits, timeouts that kill the whole group, no zombies."""

import asyncio
import os

import pytest

from agentdyn.monitor import group_pids
from agentdyn.sandbox import Sandbox, SandboxLimits, tool_env, zombie_children


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_tool_runs_in_its_own_process_group_and_session(tmp_path):
    res = asyncio.run(Sandbox().run("whereami", {}, str(tmp_path)))
    assert res.ok, res.error
    assert res.output["pgid"] == res.output["pid"] == res.output["sid"]
    assert res.output["pgid"] != os.getpgid(0)


def test_hung_tool_is_killed_with_its_whole_group(tmp_path):
    async def go():
        sb = Sandbox()
        return await sb.run("sleep", {"seconds": 60, "children": 2}, str(tmp_path), SandboxLimits(timeout_s=4)), sb

    res, sb = asyncio.run(go())
    assert not res.ok and res.killed
    assert "timed out after 4s" in res.error and "process group" in res.error
    kids = [int(x) for x in (tmp_path / "children.pids").read_text().split()]
    assert len(kids) == 2
    assert not any(_alive(k) for k in kids)
    assert not sb.live
    assert zombie_children() == []
    assert res.usage.wall_s >= 4


def test_cancelled_tool_is_cleaned_up(tmp_path):
    async def go():
        sb = Sandbox()
        task = asyncio.create_task(sb.run("sleep", {"seconds": 60}, str(tmp_path), SandboxLimits(timeout_s=60)))
        await asyncio.sleep(1.0)
        pg = next(iter(sb.live))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return pg

    pg = asyncio.run(go())
    assert [p for p in group_pids(pg) if _alive(p)] == []
    assert zombie_children() == []


def test_memory_rlimit_stops_a_runaway_tool(tmp_path):
    lim = SandboxLimits(timeout_s=30, address_space_bytes=600 << 20)
    res = asyncio.run(Sandbox().run("burn", {"cpu_s": 0.01, "alloc_mb": 2000}, str(tmp_path), lim))
    assert not res.ok and "memory" in res.error


def test_unknown_tool_and_tool_errors_are_reported(tmp_path):
    async def go():
        sb = Sandbox()
        return (
            await sb.run("no_such_tool", {}, str(tmp_path)),
            await sb.run("rag_query", {"query": ""}, str(tmp_path)),
        )

    a, b = asyncio.run(go())
    assert not a.ok and "unknown tool 'no_such_tool'" in a.error
    assert not b.ok and "args.query" in b.error


def test_killed_tool_still_has_sampled_usage(tmp_path):
    res = asyncio.run(Sandbox().run("burn", {"cpu_s": 30, "alloc_mb": 50}, str(tmp_path), SandboxLimits(timeout_s=3)))
    assert res.killed
    assert res.usage.cpu_s > 0.1  # sampled from /proc while it ran
    assert res.usage.peak_rss_bytes >= 50 << 20


def test_tool_env_thread_caps():
    base = {"PATH": "/bin", "OPENBLAS_NUM_THREADS": "3"}
    assert tool_env({"PATH": "/bin"})["OMP_NUM_THREADS"] == "1"  # polite default when unset
    assert tool_env(base)["OPENBLAS_NUM_THREADS"] == "3"  # inherited as is
    free = tool_env(base, "default")
    assert "OPENBLAS_NUM_THREADS" not in free and "OMP_NUM_THREADS" not in free and free["PATH"] == "/bin"
    assert tool_env(base, 2)["MKL_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="tool_threads"):
        tool_env(base, 0)


def test_default_threads_reach_the_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = asyncio.run(Sandbox(tool_threads="default").run("whereami", {}, str(tmp_path)))
    assert res.ok, res.error
    assert res.output["thread_env"]["OMP_NUM_THREADS"] is None
