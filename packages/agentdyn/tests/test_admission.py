"""CPU-aware admission: capacity, light runs, pressure gate, closest-to-done order, bounded waits."""

import asyncio

import pytest

from agentdyn.admission import AdmissionPolicy, CpuAdmission
from agentdyn.monitor import PressureSnapshot, Usage
from agentdyn.profiles import ProfileStore


def snap(cpu_some, runnable=1):
    return PressureSnapshot(0.0, cpu_some, 0, 0, 0, 0, runnable, 0.0, "test")


def run(coro):
    return asyncio.run(coro)


def test_heavy_runs_wait_for_capacity_light_runs_do_not():
    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5, max_wait_s=60), {"s": 1.0})
        a = await adm.acquire("r1", "t/heavy", "s", 0.9)
        b_task = asyncio.create_task(adm.acquire("r2", "t/heavy", "s", 0.9))
        light = await asyncio.wait_for(adm.acquire("r3", "t/light", "s", 0.2), 1)  # admitted at once
        await asyncio.sleep(0.05)
        assert not b_task.done()
        assert light.t_admit is not None and not light.heavy
        assert adm.load["s"] == pytest.approx(1.1) and adm.heavy_load["s"] == pytest.approx(0.9)
        adm.release(a)
        # the light run still runs, but it takes no core from the gate: it runs at a higher weight
        b = await asyncio.wait_for(b_task, 1)
        assert b.t_admit >= a.t_admit and not b.forced
        adm.release(light)
        adm.release(b)
        return adm.stats()

    st = run(go())
    assert st["admitted"] == 3 and st["heavy_admitted"] == 2 and st["held"] == 1 and st["forced"] == 0


def test_two_cores_admit_two_heavy_runs():
    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5), {"s": 2.0})
        a = await adm.acquire("r1", "k", "s", 1.0)
        b = await asyncio.wait_for(adm.acquire("r2", "k", "s", 1.0), 1)
        c = asyncio.create_task(adm.acquire("r3", "k", "s", 1.0))
        await asyncio.sleep(0.05)
        assert not c.done()
        adm.release(b)
        await asyncio.wait_for(c, 1)
        adm.release(a)

    run(go())


def test_request_closest_to_done_goes_first():
    """A waiter whose request already ran heavy work (less left) goes before a fresh request's."""

    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5, max_wait_s=60), {"s": 1.0})
        order = []
        first = await adm.acquire("started", "k", "s", 1.0)

        async def one(rid):
            t = await adm.acquire(rid, "k", "s", 1.0)
            order.append(rid)
            await asyncio.sleep(0.01)
            adm.release(t)

        tasks = [asyncio.create_task(one("fresh"))]
        await asyncio.sleep(0.02)
        tasks.append(asyncio.create_task(one("started")))  # its second heavy run, queued later
        await asyncio.sleep(0.02)
        adm.release(first)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order

    assert run(go()) == ["started", "fresh"]


def test_equal_progress_is_served_oldest_first():
    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5, max_wait_s=60), {"s": 1.0})
        hold = await adm.acquire("x", "k", "s", 1.0)
        order = []

        async def one(rid):
            t = await adm.acquire(rid, "k", "s", 1.0)
            order.append(rid)
            adm.release(t)

        tasks = []
        for rid in ("a", "b", "c"):
            tasks.append(asyncio.create_task(one(rid)))
            await asyncio.sleep(0.01)
        adm.release(hold)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order

    assert run(go()) == ["a", "b", "c"]


def test_waiting_is_bounded_even_if_capacity_never_frees():
    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5, max_wait_s=0.2), {"s": 1.0}, poll_s=0.02)
        await adm.acquire("hog", "k", "s", 1.0)  # never released
        t = await asyncio.wait_for(adm.acquire("r", "k", "s", 1.0), 5)
        return t, adm.stats()

    t, st = run(go())
    assert t.forced and st["forced"] == 1


def test_pressure_gates_runs_past_the_cores_never_within_them():
    level = {"p": 0.95}

    async def go():
        adm = CpuAdmission(
            AdmissionPolicy(heavy_threshold=0.5, pressure_margin=0.3, max_wait_s=60),
            {"s": 2.0},
            pressure=lambda: snap(level["p"]),
            poll_s=0.02,
        )
        adm.baseline_pressure = 0.1
        adm.scale = 0.5  # our runs get half of each core: up to 4 cores' demand may be admitted
        a = await asyncio.wait_for(adm.acquire("r1", "k", "s", 1.0), 1)
        b = await asyncio.wait_for(adm.acquire("r2", "k", "s", 1.0), 1)  # within the cores despite PSI
        c = asyncio.create_task(adm.acquire("r3", "k", "s", 1.0))
        await asyncio.sleep(0.1)
        assert not c.done()  # past the cores, and pressure 0.95 >= 0.1 + 0.3
        assert adm.held_by_pressure >= 1
        level["p"] = 0.2
        await asyncio.wait_for(c, 1)
        d = asyncio.create_task(adm.acquire("r4", "k", "s", 1.0))
        e = asyncio.create_task(adm.acquire("r5", "k", "s", 1.0))
        await asyncio.sleep(0.1)
        assert d.done() and not e.done()  # 4 cores' demand is the most the scale allows
        for t in (a, b, await c, await d):
            adm.release(t)
        await asyncio.wait_for(e, 1)

    run(go())


def test_cancelled_waiter_leaves_the_queue():
    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5), {"s": 1.0})
        a = await adm.acquire("r1", "k", "s", 1.0)
        w = asyncio.create_task(adm.acquire("r2", "k", "s", 1.0))
        await asyncio.sleep(0.02)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        assert adm.waiting == []
        adm.release(a)
        assert adm.load["s"] == 0

    run(go())


def test_policy_is_learned_from_profiles():
    st = ProfileStore()
    for _ in range(3):
        st.observe("coding", "run_tests", Usage(cpu_s=0.9, wall_s=1.0, run_wait_s=0.0), alone=True, pressure=0.1)
        st.observe("web_search", "web_search", Usage(cpu_s=0.1, wall_s=1.0), alone=True, pressure=0.05)
        st.observe("coding", "read_file", Usage(cpu_s=0.05, wall_s=0.06), alone=True, pressure=0.05)
    pol = AdmissionPolicy.learn(st, cores=2)
    assert pol.source == "learned"
    assert 0.1 < pol.heavy_threshold < 0.9  # between the two intensities
    assert pol.max_wait_s == pytest.approx(10 * 1.0)  # ten of the longest heavy run
    adm = CpuAdmission(pol, {"s": 1.0})
    assert adm.is_heavy(0.9, 0.9) and not adm.is_heavy(0.1, 0.1)
    assert 0.05 < pol.cost_threshold < 0.9
    assert not adm.is_heavy(0.83, 0.05)  # CPU-bound but short: passes without queueing


def test_bad_capacity_is_rejected():
    with pytest.raises(ValueError, match="capacity"):
        CpuAdmission(AdmissionPolicy(), {"s": 0})


def test_demand_and_cost_shape_admission():
    """The gate counts each heavy run's expected demand; short runs pass a full set."""

    async def go():
        adm = CpuAdmission(AdmissionPolicy(heavy_threshold=0.5, cost_threshold=0.3, max_wait_s=60), {"s": 1.0})
        held = [
            await asyncio.wait_for(adm.acquire(f"r{i}", "k", "s", 0.9, cost_s=1.0, demand=0.3), 1) for i in range(3)
        ]
        fourth = asyncio.create_task(adm.acquire("r4", "k", "s", 0.9, cost_s=1.0, demand=0.3))
        await asyncio.sleep(0.05)
        assert not fourth.done()  # 4 x 0.3 > 1 core
        short = await asyncio.wait_for(adm.acquire("r5", "k", "s", 0.9, cost_s=0.05), 1)
        assert not short.heavy  # CPU-bound but short: not held back
        for t in held + [short]:
            adm.release(t)
        await asyncio.wait_for(fourth, 1)

    run(go())
