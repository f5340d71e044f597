"""Task-aware allocation: learned split, cores by demand share, quota on one core, real placement."""

import asyncio
import os

import pytest

from agentdyn.allocation import TaskAwareAllocator, plan_allocation, split_threshold
from agentdyn.cgroups import CpuGroup, cpu_writable, cpuset_writable
from agentdyn.sandbox import Sandbox

PROFILES = {
    "coding": {"cpu_s": 2.0, "wall_s": 2.3, "cpu_intensity": 0.87},
    "rag_qa": {"cpu_s": 0.7, "wall_s": 0.9, "cpu_intensity": 0.8},
    "web_search": {"cpu_s": 0.3, "wall_s": 1.1, "cpu_intensity": 0.27},
}


def test_split_threshold_sits_in_the_largest_gap():
    t = split_threshold([0.1, 0.12, 0.8, 0.9])
    assert 0.12 < t < 0.8
    assert split_threshold([0.05, 0.06]) >= 0.2  # clamped


def test_cpu_sensitive_class_gets_own_core_on_two_cores():
    plan = plan_allocation(PROFILES, [0, 1])
    c, r, w = plan.classes["coding"], plan.classes["rag_qa"], plan.classes["web_search"]
    assert c.core_set != r.core_set and r.core_set == w.core_set
    assert set(c.cpus).isdisjoint(r.cpus) and sorted(c.cpus + r.cpus) == [0, 1]
    assert plan.capacity[c.core_set] == 1.0 and plan.capacity[r.core_set] == 1.0


def test_cores_follow_demand_share_and_mix():
    plan = plan_allocation(PROFILES, [0, 1, 2, 3])
    own = plan.classes["coding"].cpus
    assert len(own) == 3  # 0.67 of the demand of 4 cores
    # with far fewer coding requests in the mix its demand share shrinks, and so do its cores
    plan2 = plan_allocation(PROFILES, [0, 1, 2, 3], mix={"coding": 0.2, "rag_qa": 1.0, "web_search": 1.0})
    assert plan2.classes["coding"].core_set == "shared" or len(plan2.classes["coding"].cpus) < 3


def test_io_bound_class_never_gets_own_cores():
    prof = dict(PROFILES, web_search={"cpu_s": 5.0, "wall_s": 50.0, "cpu_intensity": 0.1})
    plan = plan_allocation(prof, [0, 1, 2, 3])
    assert plan.classes["web_search"].core_set == "shared"


def test_one_core_uses_quota_and_shares():
    plan = plan_allocation(PROFILES, [0])
    assert plan.classes["web_search"].quota_cores is not None and 0 < plan.classes["web_search"].quota_cores < 1
    assert plan.classes["coding"].shares > plan.classes["web_search"].shares


def test_two_equal_cpu_classes_split_the_cores_evenly():
    prof = {k: {"cpu_s": 1.0, "wall_s": 1.1, "cpu_intensity": 0.9} for k in ("a", "b")}
    plan = plan_allocation(prof, [0, 1])
    assert sorted(len(c.cpus) for c in plan.classes.values()) == [1, 1]
    assert set(plan.classes["a"].cpus).isdisjoint(plan.classes["b"].cpus)
    assert sum(plan.capacity.values()) == 2.0


def test_dominant_cpu_class_spills_onto_idle_shared_cores():
    prof = dict(PROFILES, coding={"cpu_s": 9.0, "wall_s": 9.2, "cpu_intensity": 0.98})
    plan = plan_allocation(prof, [0, 1])
    c, w = plan.classes["coding"], plan.classes["web_search"]
    assert c.own_cpus == [1] and c.cpus == [0, 1]  # own core, plus the shared core the others leave idle
    assert w.cpus == [0] and 1 not in plan.classes["rag_qa"].cpus  # nobody else runs on the own core
    assert plan.capacity[c.core_set] == 2.0 and c.threads == 1
    # with a demand share that fills only its own core, no spill (test above): capacity stays 1
    assert plan_allocation(PROFILES, [0, 1]).capacity["own-coding"] == 1.0


def test_bad_cores():
    with pytest.raises(ValueError, match="cores"):
        plan_allocation(PROFILES, [])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_tools_really_run_on_their_class_cores(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    alloc = TaskAwareAllocator(plan_allocation(PROFILES, cpus))
    try:

        async def go():
            sb = Sandbox()
            a = await sb.run("whereami", {}, str(tmp_path / "a"), group=alloc.group_for("coding"))
            b = await sb.run("whereami", {}, str(tmp_path / "b"), group=alloc.group_for("web_search"))
            return a, b

        a, b = asyncio.run(go())
        assert a.ok and b.ok, (a.error, b.error)
        assert a.output["cpus"] == alloc.plan.classes["coding"].cpus
        assert b.output["cpus"] == alloc.plan.classes["web_search"].cpus
        # each class's tools are told its thread count (libraries would otherwise start one per core)
        assert a.output["thread_env"]["OPENBLAS_NUM_THREADS"] == str(alloc.plan.classes["coding"].threads)
        if cpuset_writable():
            assert any("agentdyn-" in line and "cpuset" in line for line in a.output["cgroups"])
    finally:
        alloc.close()
    for g in alloc.groups.values():
        assert all(not p.exists() for p in g.cgroup.paths.values())  # groups removed on close


def test_cpu_group_quota_validation():
    with pytest.raises(ValueError, match="quota_cores"):
        CpuGroup("x", quota_cores=0)


@pytest.mark.skipif(not cpu_writable() or len(os.sched_getaffinity(0)) < 2, reason="needs cgroup cpu, 2 CPUs")
def test_weighted_tools_really_run_under_their_cpu_shares(tmp_path):
    from agentdyn.profiles import ProfileStore
    from agentdyn.scheduler import CpuAwarePolicy

    tool = {"n": 1, "n_alone": 1, "cpu_pressure": 0.0}
    store = ProfileStore.from_dict(
        {
            "tools": {
                "coding/run_tests": {**tool, "cpu_s": 6.0, "wall_s": 6.1},
                "web_search/web_search": {**tool, "cpu_s": 0.3, "wall_s": 1.0},
            },
            "requests": {"coding": 1, "web_search": 1},
        }
    )
    pol = CpuAwarePolicy(store, sorted(os.sched_getaffinity(0))[:2])
    try:

        async def go():
            sb = Sandbox()
            out = {}
            for tt, t in (("coding", "run_tests"), ("web_search", "web_search")):
                async with pol.tool_slot("r1", tt, t) as g:
                    out[t] = (g, await sb.run("whereami", {}, str(tmp_path / t), group=g))
            return out

        out = asyncio.run(go())
        for g, res in out.values():
            assert res.ok, res.error
            assert g.describe()["placed"] >= 1 and g.describe()["add_errors"] == 0
        light, lres = out["web_search"]
        cpu_line = next(line for line in lres.output["cgroups"] if "cpu" in line.split(":")[1].split(","))
        assert light.cgroup.name in cpu_line  # the light tool's process sat in its weighted group
        assert int((light.cgroup.paths["cpu"] / "cpu.shares").read_text()) == light.shares > 1024
        # the heavy run weighs as a plain process per thread (one run in flight)
        heavy, hres = out["run_tests"]
        cpu_line = next(line for line in hres.output["cgroups"] if "cpu" in line.split(":")[1].split(","))
        assert heavy.cgroup.name in cpu_line
        assert int((heavy.cgroup.paths["cpu"] / "cpu.shares").read_text()) == heavy.shares == 1024 * heavy.threads
    finally:
        pol.close()
