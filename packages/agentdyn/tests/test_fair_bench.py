"""The bench's fair baselines, load sizing, rotation and the comparison with the best fair baseline."""

import asyncio

import pytest

from agentdyn.bench import DEV_SEEDS, WorkloadConfig, _schedule, size_load, vs_fair
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


def test_cpu_aware_policy_pins_a_class_only_while_our_demand_exceeds_the_cores():
    from agentdyn.scheduler import CpuAwarePolicy

    pol = CpuAwarePolicy(_store(), [0, 1])
    pinned = pol.allocator.group_for("coding")

    async def place(extra_load):
        pol.admission.load["shared"] += extra_load  # demand other runs of ours already hold
        try:
            async with pol.tool_slot("r1", "coding", "run_tests") as g:
                return g
        finally:
            pol.admission.load["shared"] -= extra_load

    try:
        assert pinned is not None and pinned.cpus  # the plan gives coding a core set
        alone = asyncio.run(place(0.0))
        assert alone is not pinned and alone.cpus is None and alone.threads == pinned.threads
        crowded = asyncio.run(place(5.0))
        assert crowded is pinned
        d = pol.describe()
        assert d["pinned_runs"] == 1 and d["unpinned_runs"] == 1
    finally:
        pol.close()
    # one core: the plan's quota and weights always apply
    one = CpuAwarePolicy(_store(), [0])
    try:
        g = asyncio.run(_slot(one, "web_search", "web_search"))
        assert g is one.allocator.group_for("web_search")
    finally:
        one.close()


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


class _Pressure:
    """A sampler whose latest PSI ``cpu some`` the test sets."""

    def __init__(self, cpu_some):
        self.cpu_some = cpu_some

    def latest(self):
        from agentdyn.monitor import PressureSnapshot

        return PressureSnapshot(0.0, self.cpu_some, 0.0, 0.0, 0.0, 0.0, 1, 0.0, "psi")


def test_cpu_aware_policy_stands_down_while_neighbours_saturate_the_cpu():
    from agentdyn.scheduler import CpuAwarePolicy

    sampler = _Pressure(0.95)  # other tenants keep a task waiting for a CPU 95 % of the time
    pol = CpuAwarePolicy(_store(), [0, 1], sampler)
    try:
        g = asyncio.run(_slot(pol, "coding", "run_tests"))
        # fair share: no admission ticket, no core set, the class's thread count
        assert pol.admission.log == [] and g.cpus is None and g.threads == pol.allocator.group_for("coding").threads
        assert pol.describe()["stood_down_runs"] == 1
        sampler.cpu_some = 0.0  # the neighbours went quiet: measured while none of ours runs
        for _ in range(20):
            asyncio.run(_slot(pol, "coding", "run_tests"))
        assert not pol.neighbours_saturate() and len(pol.admission.log) >= 1
    finally:
        pol.close()
