"""The bench's fair baselines, load sizing, rotation and the comparison with the best fair baseline."""

import asyncio

import pytest

from agentdyn.bench import DEV_SEEDS, WorkloadConfig, _schedule, size_load, vs_fair
from agentdyn.cgroups import cpu_writable
from agentdyn.scheduler import FairPolicy


def test_size_load_fits_below_and_oversubscribes_above_the_target():
    cpr = {"coding": 0.5, "rag_qa": 0.2, "web_search": 0.1}  # 0.8 cores per set of one each
    assert size_load(0.8, cpr, 2, 8) == (2, pytest.approx(0.8))
    assert size_load(2.0, cpr, 2, 8) == (5, pytest.approx(2.0))
    n, offered = size_load(0.7, cpr, 2, 8)  # 1.75 sets: one fits, two would not
    assert n == 1 and offered <= 0.7
    n, offered = size_load(2.1, cpr, 2, 8)  # 5.25 sets: six reach it
    assert n == 6 and offered >= 2.1
    assert size_load(2.0, cpr, 2, 3)[0] == 3  # capped
    assert size_load(0.1, cpr, 2, 8)[0] == 1  # at least one request per type


def test_rotation_puts_every_variant_first_once():
    vs = ("fair", "fair_semaphore", "cgroup_split", "optimized")
    orders = [_schedule(vs, k) for k in range(4)]
    assert {o[0] for o in orders} == set(vs)
    assert all(sorted(o) == sorted(vs) for o in orders)


def _summary(mean, cpu, per_seed):
    return {
        "mean_latency_s": mean,
        "cpu_task_mean_latency_s": cpu,
        "per_seed": {s: {"mean_latency_s": m, "cpu_task_mean_latency_s": c} for s, (m, c) in per_seed.items()},
    }


def test_vs_fair_divides_by_the_best_baseline_per_figure_and_per_seed():
    res = {
        "fair": _summary(10.0, 20.0, {"1": (9.0, 22.0), "2": (11.0, 18.0)}),
        "fair_semaphore": _summary(12.0, 16.0, {"1": (13.0, 15.0), "2": (11.0, 17.0)}),
        "cgroup_split": _summary(11.0, 18.0, {"1": (8.0, 19.0), "2": (14.0, 17.0)}),
        "optimized": _summary(8.0, 8.0, {"1": (8.0, 7.5), "2": (8.0, 8.5)}),
    }
    c = vs_fair(res)
    assert c["best_fair_baseline"] == {"cpu_task": "fair_semaphore", "mean": "fair"}
    assert c["cpu_task_latency_ratio"] == pytest.approx(16.0 / 8.0)
    assert c["mixed_avg_latency_reduction"] == pytest.approx(1 - 8.0 / 10.0)
    # per seed, each against its own best: seed 1's best mean is cgroup_split's 8.0 (no gain)
    assert c["per_seed"]["1"]["mixed_avg_latency_reduction"] == pytest.approx(0.0)
    assert c["per_seed"]["1"]["cpu_task_latency_ratio"] == pytest.approx(15.0 / 7.5)
    assert c["per_seed"]["2"]["cpu_task_latency_ratio"] == pytest.approx(17.0 / 8.5)
    # a worse policy reads below 1 and negative, not clipped
    res["optimized"] = _summary(20.0, 32.0, {"1": (20.0, 30.0), "2": (20.0, 34.0)})
    c = vs_fair(res)
    assert c["cpu_task_latency_ratio"] == pytest.approx(0.5) and c["mixed_avg_latency_reduction"] == pytest.approx(-1.0)
    assert vs_fair({"fair": res["fair"]}) is None


def test_workload_config_marks_development_seeds_and_checks_loads():
    assert WorkloadConfig().to_dict()["seeds_held_out"] is True
    d = WorkloadConfig(seeds=(DEV_SEEDS[0], 101)).to_dict()
    assert d["seeds_held_out"] is False and d["dev_seeds"] == list(DEV_SEEDS)
    with pytest.raises(ValueError, match="loads"):
        WorkloadConfig(loads=(("fit", 0.8), ("fit", 2.0)))
    with pytest.raises(ValueError, match="seeds"):
        WorkloadConfig(seeds=())


def test_fair_semaphore_holds_tool_calls_beyond_the_cores():
    pol = FairPolicy("fair_semaphore", {"coding": 1, "rag_qa": 2}, cores=2)
    held, seen = [], []

    async def call(i):
        async with pol.tool_slot(f"r{i}", "coding" if i % 2 else "rag_qa", "t") as g:
            held.append(i)
            seen.append((len(held), g.threads))
            await asyncio.sleep(0.01)
            held.remove(i)

    async def go():
        await asyncio.gather(*(call(i) for i in range(7)))

    try:
        asyncio.run(go())
        assert max(n for n, _ in seen) == 2 and pol.max_in_flight == 2 and len(seen) == 7
        assert {t for _, t in seen} == {1, 2}  # each class's tools told its thread count
        assert pol.describe()["workers"] == 2
    finally:
        pol.close()


def test_fair_and_cgroup_split_admit_everything_at_once():
    for kind in ("fair", "cgroup_split"):
        pol = FairPolicy(kind, {"coding": 1}, cores=2)

        async def go(p):
            async with _Held(p, 6):
                pass

        try:
            asyncio.run(go(pol))
            assert pol.max_in_flight == 6 and pol.workers is None
            g = pol.groups["coding"]
            assert g.shares == (1024 if kind == "cgroup_split" else None) and g.threads == 1
        finally:
            pol.close()
    with pytest.raises(ValueError, match="kind must be one of"):
        FairPolicy("native", {}, cores=2)


class _Held:
    """Holds ``n`` tool slots of ``pol`` at once (entered concurrently)."""

    def __init__(self, pol, n):
        self.pol, self.n, self.slots = pol, n, []

    async def __aenter__(self):
        self.slots = [self.pol.tool_slot(f"r{i}", "coding", "t") for i in range(self.n)]
        await asyncio.gather(*(s.__aenter__() for s in self.slots))

    async def __aexit__(self, *exc):
        for s in self.slots:
            await s.__aexit__(None, None, None)


def _store():
    from agentdyn.profiles import ProfileStore

    tool = {"n": 1, "n_alone": 1, "cpu_pressure": 0.0}
    return ProfileStore.from_dict(
        {
            "tools": {
                "coding/run_tests": {**tool, "cpu_s": 6.0, "wall_s": 6.1},
                "rag_qa/rag_index": {**tool, "cpu_s": 0.9, "wall_s": 1.0},
                "web_search/web_search": {**tool, "cpu_s": 0.3, "wall_s": 1.0},
            },
            "requests": {"coding": 1, "rag_qa": 1, "web_search": 1},
        }
    )


def test_cpu_aware_policy_weights_each_tool_by_its_profile():
    from agentdyn.allocation import DEFAULT_SHARES, MAX_SHARE_RATIO
    from agentdyn.scheduler import CpuAwarePolicy

    pol = CpuAwarePolicy(_store(), [0, 1])
    try:
        heavy = asyncio.run(_slot(pol, "coding", "run_tests"))
        light = asyncio.run(_slot(pol, "web_search", "web_search"))
        mid = asyncio.run(_slot(pol, "rag_qa", "rag_index"))
        # one heavy run weighs as a plain process per thread, shorter ones more: 6 s / 0.3 s, capped; 6 / 0.9
        assert heavy.shares == DEFAULT_SHARES * heavy.threads and pol.shares["coding/run_tests"] == DEFAULT_SHARES
        assert light.shares == DEFAULT_SHARES * min(MAX_SHARE_RATIO, 20)
        assert mid.shares == round(DEFAULT_SHARES * 6.0 / 0.9)
        # on any core, with the thread count the plan gives the class
        plan = pol.allocator.plan.classes
        assert heavy.cpus is None and heavy.threads == plan["coding"].threads
        assert light.threads == plan["web_search"].threads
        assert asyncio.run(_slot(pol, "coding", "run_tests")) is heavy  # one group per tool
        d = pol.describe()
        assert d["admission_stats"]["heavy_admitted"] == 2 and d["admission_stats"]["admitted"] == 4
        assert sum(d["runs_by_group"].values()) == 4 and d["runs_by_group"][heavy.name] == 2
    finally:
        pol.close()
    # one core: the plan's quota and weights always apply
    one = CpuAwarePolicy(_store(), [0])
    try:
        g = asyncio.run(_slot(one, "web_search", "web_search"))
        assert g is one.allocator.group_for("web_search")
    finally:
        one.close()
    # without admission (an ablation) the plan's core sets place each class
    plain = CpuAwarePolicy(_store(), [0, 1], admission=False)
    try:
        g = asyncio.run(_slot(plain, "coding", "run_tests"))
        assert g is plain.allocator.group_for("coding") and g.cpus
    finally:
        plain.close()


async def _slot(pol, task_type, tool):
    async with pol.tool_slot("r1", task_type, tool) as g:
        return g


def test_host_check_flags_a_host_whose_neighbours_stall_runs_made_alone():
    from agentdyn.bench import QUIET_RUN_QUEUE_SHARE, host_check

    store = _store()
    h = host_check(store, {"cpu_some_mean": 0.1})
    assert h["quiet"] is True and h["alone_run_queue_share"] == 0.0
    for p in store.tools.values():
        p.cpu_pressure = 0.8  # 80 % of each run alone spent waiting for a core
    h = host_check(store, {"cpu_some_mean": 1.0})
    assert h["quiet"] is False and h["alone_run_queue_share"] > QUIET_RUN_QUEUE_SHARE
    for p in store.tools.values():
        p.cpu_pressure = 1.5  # two threads each waiting most of the run
    assert host_check(store, {})["alone_run_queue_share"] == 1.0


def test_admitted_heavy_runs_carry_the_weight_of_those_waiting():
    from agentdyn.allocation import DEFAULT_SHARES
    from agentdyn.scheduler import CpuAwarePolicy

    pol = CpuAwarePolicy(_store(), [0, 1])

    async def go():
        slots = [pol.tool_slot(f"r{i}", "coding", "run_tests") for i in range(3)]
        groups = [await s.__aenter__() for s in slots[:2]]
        third = asyncio.create_task(slots[2].__aenter__())
        await asyncio.sleep(0.05)
        assert not third.done()  # two heavy runs fill the two cores
        g = groups[0]
        seen = g.shares
        await slots[0].__aexit__(None, None, None)
        await asyncio.wait_for(third, 1)
        after = g.shares
        for s in slots[1:]:
            await s.__aexit__(None, None, None)
        return g, seen, after

    try:
        g, seen, after = asyncio.run(go())
        # three runs in flight (two admitted, one held): the weight three plain processes would have
        assert seen == 3 * DEFAULT_SHARES * g.threads and after == 2 * DEFAULT_SHARES * g.threads
    finally:
        pol.close()


def test_cpu_aware_policy_learns_the_share_of_a_core_its_heavy_runs_get():
    from agentdyn.monitor import Usage
    from agentdyn.scheduler import CpuAwarePolicy

    pol = CpuAwarePolicy(_store(), [0, 1], apply_cgroups=False)  # no weights to carry the held runs'

    async def run(task_type, tool, usage):
        async with pol.tool_slot("r1", task_type, tool):
            pol.observe(task_type, tool, usage)

    try:
        assert pol.admission.scale == 1.0
        for _ in range(30):  # each heavy run waited half its time for a core
            asyncio.run(run("coding", "run_tests", Usage(cpu_s=3.0, wall_s=6.0, run_wait_s=3.0)))
        assert pol.admission.scale == pytest.approx(0.5, abs=0.01)
        before = pol.admission.scale
        asyncio.run(run("web_search", "web_search", Usage(cpu_s=0.3, wall_s=3.0, run_wait_s=2.7)))
        assert pol.admission.scale == before  # a light run says nothing about the heavy runs' share
        pol.observe("coding", "run_tests", Usage(cpu_s=1.0, wall_s=6.0, run_wait_s=5.0))
        assert pol.admission.scale == before  # nor a run seen outside an admission

        async def crowded():
            pol.admission.scale = 0.5  # up to 4 heavy runs on the 2 cores
            slots = [pol.tool_slot(f"r{i}", "coding", "run_tests") for i in range(3)]
            for s in slots:
                await s.__aenter__()
            pol.observe("coding", "run_tests", Usage(cpu_s=2.0, wall_s=6.0, run_wait_s=4.0))
            for s in slots:
                await s.__aexit__(None, None, None)

        asyncio.run(crowded())  # its wait was for our own runs past the cores: not the neighbours'
        assert pol.admission.scale == 0.5 and not pol.reweighed
    finally:
        pol.close()
    if cpu_writable():  # where the held runs' weight moves to the admitted ones, the cores suffice
        pol = CpuAwarePolicy(_store(), [0, 1])
        try:
            for _ in range(5):
                asyncio.run(run("coding", "run_tests", Usage(cpu_s=3.0, wall_s=6.0, run_wait_s=3.0)))
            assert pol.reweighed and pol.admission.scale == 1.0
        finally:
            pol.close()


def _profiled(with_rag: bool = True):
    from agentdyn.monitor import Usage
    from agentdyn.profiles import ProfileStore

    st = ProfileStore()
    runs = [
        ("coding", "run_tests", 8.0, 8.0),
        ("coding", "read_file", 0.15, 0.2),
        ("web_search", "web_search", 0.2, 0.5),
    ]
    if with_rag:
        runs += [("rag_qa", "rag_index", 0.5, 0.55), ("rag_qa", "rag_query", 0.2, 0.23)]
    for t, tool, cpu, wall in runs:
        st.observe(t, tool, Usage(cpu_s=cpu, wall_s=wall), alone=True)
    for t in {r[0] for r in runs}:
        st.observe_request(t, 5.0)
    return st


def test_cpu_sensitive_classes_are_cpu_bound_and_never_held():
    from agentdyn.bench import cpu_sensitive_tasks

    sensitive, heavy, rule = cpu_sensitive_tasks(_profiled(), 2)
    # rag_qa: CPU-bound short runs; coding: CPU-bound too, but its test runs are held by admission;
    # web_search: mostly waiting on the site
    assert (sensitive, heavy) == (["rag_qa"], ["coding"]) and "no tool held" in rule
    sensitive, heavy, rule = cpu_sensitive_tasks(_profiled(with_rag=False), 2)
    assert (sensitive, heavy) == (["coding"], ["coding"]) and "highest CPU demand" in rule


def test_vs_fair_reports_the_heavy_class_against_its_own_best_baseline():
    def summary(mean, cpu, heavy):
        one = {"mean_latency_s": mean, "cpu_task_mean_latency_s": cpu, "cpu_heavy_task_mean_latency_s": heavy}
        return {**one, "per_seed": {"7": dict(one)}}

    res = {
        "fair": summary(10.0, 6.0, 30.0),
        "cgroup_split": summary(12.0, 5.0, 40.0),
        "optimized": summary(8.0, 4.0, 32.0),
    }
    c = vs_fair(res)
    assert c["best_fair_baseline"] == {"cpu_task": "cgroup_split", "cpu_heavy_task": "fair", "mean": "fair"}
    assert c["cpu_task_latency_ratio"] == pytest.approx(5.0 / 4.0)
    # a class the policy made slower reads below 1
    assert c["cpu_heavy_task_latency_ratio"] == pytest.approx(30.0 / 32.0)
    assert c["per_seed"]["7"]["cpu_heavy_task_latency_ratio"] == pytest.approx(30.0 / 32.0)


def test_ratio_bound_divides_the_best_fair_baseline_by_the_fit_loads_fastest():
    from agentdyn.bench import _ratio_bound

    def r(cpu):
        return {"cpu_task_mean_latency_s": cpu}

    results = {
        "fit": {"fair": r(6.0), "optimized": r(5.0)},
        "oversubscribed": {"fair": r(8.0), "cgroup_split": r(7.0), "optimized": r(6.5)},
    }
    # the policy's own figure does not move its bound
    assert _ratio_bound(results) == pytest.approx(7.0 / 5.0)
    assert _ratio_bound({"oversubscribed": results["oversubscribed"]}) is None


def test_groups_are_made_with_the_policy_not_by_a_tool_call():
    from agentdyn.scheduler import CpuAwarePolicy

    fair = FairPolicy("cgroup_split", {"coding": 1, "rag_qa": 1}, cores=2)
    opt = CpuAwarePolicy(_store(), [0, 1])
    try:
        assert set(fair.groups) == {"coding", "rag_qa"}
        assert set(opt.describe()["weighted_groups"]) == set(opt.shares)
        assert opt.describe()["runs_by_group"] == {}
        # a tool call then takes the group made for it
        g = asyncio.run(_slot(opt, "web_search", "web_search"))
        assert g is opt._weighted_groups["web_search/web_search"] and g.shares == opt.shares["web_search/web_search"]
    finally:
        fair.close()
        opt.close()
