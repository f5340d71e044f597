import pytest

from kvpool import DeviceInfo, Placement

MB = 1 << 20


def devs(caps=(100 * MB, 100 * MB, 100 * MB)):
    return [
        DeviceInfo("mem0", "memory", 4e9, caps[0]),
        DeviceInfo("ssd0", "ssd", 1e9, caps[1], align_bytes=4096, unit_overhead_bytes=64),
        DeviceInfo("ssd1", "ssd", 2e9, caps[2], align_bytes=4096, unit_overhead_bytes=64),
    ]


def chunks(n, prefix="c", size=MB, units=4):
    return [(f"{prefix}{i}", size, units) for i in range(n)]


def test_stripes_in_proportion_to_bandwidth_so_devices_finish_together():
    p = Placement(devs())
    plan = p.place(chunks(70))
    counts = {d: len(v) for d, v in plan.per_device().items()}
    assert counts == {"mem0": 40, "ssd0": 10, "ssd1": 20}
    times = p.predicted_times([k for k, _, _ in chunks(70)])
    one_chunk = MB / 1e9
    assert max(times.values()) - min(times.values()) <= one_chunk + 1e-12


def test_capacity_limits_send_the_rest_to_other_devices():
    p = Placement(devs(caps=(5 * MB, 100 * MB, 100 * MB)))
    plan = p.place(chunks(40))
    per = plan.per_device()
    assert len(per["mem0"]) == 5
    assert p.used["mem0"] <= 5 * MB
    for d in ("ssd0", "ssd1"):
        assert p.used[d] <= p.devices[d].capacity_bytes
    # the SSDs still split the rest 1:2 by bandwidth
    assert abs(len(per["ssd1"]) - 2 * len(per["ssd0"])) <= 2


def test_charge_rounds_to_alignment_with_header():
    d = devs()[1]
    assert d.charge(4 * MB, 4) == 4 * (MB + 4096)
    assert d.charge(10, 1) == 4096


def test_lru_eviction_across_the_pool_protects_the_new_request_and_keeps_heads():
    size = MB
    p = Placement([DeviceInfo("mem0", "memory", 4e9, 4 * MB), DeviceInfo("mem1", "memory", 2e9, 4 * MB)])
    p.place(chunks(4, "a", size, 1))
    p.place(chunks(4, "b", size, 1))
    p.touch(["a0", "a1", "a2", "a3"])  # a is now more recent than b
    plan = p.place(chunks(3, "c", size, 1))
    assert [r.key for r in plan.evicted] == ["b3", "b2", "b1"]
    # touched in order, a request's head is the most recent: its tail goes first
    p.touch(["c0", "c1", "c2"])
    p.touch(["a0", "a1", "a2", "a3"])
    plan = p.place(chunks(2, "d", size, 1))
    assert [r.key for r in plan.evicted] == ["b0", "c2"]
    assert "a0" in p and "c0" in p


def test_no_room_leaves_the_rest_unplaced_without_evicting_in_vain():
    p = Placement([DeviceInfo("mem0", "memory", 1e9, 2 * MB)])
    p.place(chunks(2, "a"))
    plan = p.place(chunks(1, "b", 3 * MB))  # bigger than the device: nothing evicted for nothing
    assert plan.unplaced == ["b0"] and not plan.evicted and "a0" in p and "a1" in p
    plan = p.place(chunks(3, "c"), protect=["a0"])
    assert plan.assign == {"c0": "mem0"} and [r.key for r in plan.evicted] == ["a1"]
    assert plan.unplaced == ["c1", "c2"] and "c1" not in p


def test_promotion_into_free_memory_and_by_swap():
    p = Placement(devs(caps=(2 * MB, 100 * MB, 100 * MB)), promote_after=2)
    p.place(chunks(2, "m"))  # fill memory
    p.place(chunks(4, "s"))
    on_ssd = [k for k, r in p.records.items() if r.device.startswith("ssd")]
    assert set(on_ssd) >= {"s0", "s1", "s2", "s3"}
    assert p.plan_promotions(["s0"]) == []  # not hot yet
    p.touch(["s0"])
    p.touch(["s0"])
    moves = p.plan_promotions(["s0"])
    assert [(m.key, m.reason) for m in moves] == [("m0", "demote"), ("s0", "promote")] or [
        (m.key, m.reason) for m in moves
    ] == [("m1", "demote"), ("s0", "promote")]
    assert p.location("s0") == "mem0"
    assert p.used["mem0"] <= 2 * MB
    # with free room a hot chunk moves without a swap
    q = Placement(devs(caps=(10 * MB, 100 * MB, 100 * MB)))
    q.place(chunks(30, "x"))
    hot = next(k for k, r in q.records.items() if r.device == "ssd0")
    q.remove(next(k for k, r in q.records.items() if r.device == "mem0"))
    q.touch([hot])
    q.touch([hot])
    (mv,) = q.plan_promotions([hot])
    assert (mv.src, mv.dst, mv.reason) == ("ssd0", "mem0", "promote")
    q.abort_move(mv)
    assert q.location(hot) == "ssd0"


def test_disable_adopt_and_bad_input():
    p = Placement(devs())
    p.place(chunks(10))
    lost = p.disable("ssd1")
    assert lost and all(r.device == "ssd1" for r in lost)
    plan = p.place(chunks(10, "n"))
    assert "ssd1" not in plan.per_device()
    assert p.adopt("z", MB, 4, "ssd0") and not p.adopt("z", MB, 4, "ssd0")
    with pytest.raises(ValueError, match="kind"):
        DeviceInfo("x", "tape", 1.0, 1)
    with pytest.raises(ValueError, match="unique"):
        Placement([devs()[0], devs()[0]])
