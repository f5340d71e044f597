import os
import signal
import threading
import time

import pytest
import torch
from _workers import (
    all_variants,
    batch,
    dies,
    exact_sign_mean,
    loses_a_worker,
    mismatched,
    overlapped,
    rebalanced,
    rejoins,
    ring_and_gather,
    sign_reduce_scatter,
    stalls,
    stalls_once,
    tiny_model,
    train,
)

import geomesh
from geomesh import DiLoCo, GeoMeshError, spawn
from hwtopo.launch import RankError

pytestmark = pytest.mark.slow


def test_outer_step_identical_across_workers_with_heterogeneous_inner_steps():
    res = spawn(all_variants, 3, timeout_s=240, start_method="fork")
    for comp in ("sign", "sign-rot", "fp32", "fp16"):
        p0 = res[0][comp]["params"]
        for r in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(p0, res[r][comp]["params"])), (comp, r)
        h = res[0][comp]["history"]
        assert len(h) == 3
        # tokens differ per worker (H = 2, 3, 5 at batch 4) and weight the average
        assert h[0]["all_tokens"] == [8, 12, 20]
        assert h[0]["weights"] == pytest.approx([0.2, 0.3, 0.5])
    # training moved the weights away from rank 0's initial weights
    init = list(tiny_model(0).parameters())
    assert not all(torch.equal(a, b.detach()) for a, b in zip(res[0]["sign"]["params"], init))
    # sign payload is ~32x smaller than the fp32 one (small model: scales and header weigh more)
    sign_b = res[0]["sign"]["history"][0]["payload_bytes"]
    fp32_b = res[0]["fp32"]["history"][0]["payload_bytes"]
    n = sum(p.numel() for p in init)
    assert fp32_b == 4 * n and res[0]["fp16"]["history"][0]["payload_bytes"] == 2 * n
    assert sign_b == 8 + 4 * len(init) + (n + 7) // 8 + 4 * sum((p.numel() - 1) // 16 for p in init)
    # the rotated basis: same bytes, another outer step (its signs are those of the rotated values)
    assert res[0]["sign-rot"]["history"][0]["payload_bytes"] == sign_b
    assert not all(torch.equal(a, b) for a, b in zip(res[0]["sign"]["params"], res[0]["sign-rot"]["params"]))
    assert 0.0 < res[0]["sign-rot"]["history"][0]["codec"]["cosine"] <= 1.0


def test_gather_all_reduce_matches_the_ring():
    res = spawn(ring_and_gather, 3, timeout_s=240, start_method="fork")
    for r in (1, 2):  # the gather sums in rank order on every worker: identical weights everywhere
        assert all(torch.equal(a, b) for a, b in zip(res[0]["gather"]["params"], res[r]["gather"]["params"]))
    # the same outer step as the ring, up to the order of the floating-point sum
    for a, b in zip(res[0]["ring"]["params"], res[0]["gather"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ring, gather = res[0]["ring"]["history"][0], res[0]["gather"]["history"][0]
    assert (ring["collective"], gather["collective"]) == ("all_reduce", "all_reduce_gather")
    # the gather sends every worker's whole payload to the 2 others: 2x the payload vs the ring's 4/3x
    assert gather["wire_bytes"] == 2 * gather["payload_bytes"]
    assert ring["wire_bytes"] == pytest.approx(4 / 3 * ring["payload_bytes"])


def test_sign_reduce_scatter_returns_the_exact_weighted_mean():
    res = spawn(exact_sign_mean, 3, timeout_s=120, start_method="fork")
    pattern = torch.where(torch.arange(96) % 3 == 0, -1.0, 1.0)
    base = torch.arange(1, 7, dtype=torch.float32).repeat_interleave(16)
    w = torch.tensor([10.0, 20.0, 30.0]) / 60  # tokens 10, 20, 30 weight the magnitudes 1x, 2x, 3x
    expected = base * float((w * torch.tensor([1.0, 2.0, 3.0])).sum()) * pattern
    for got, _, _ in res:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # 6 chunks of 16 in 3 shards of 2: a shard coding is 8 + 2 x 4 + 4 bytes; 2 x 2 of them sent
    assert [(wire, slot) for _, wire, slot in res] == [(4 * 20, 20)] * 3


def test_sign_reduce_scatter_keeps_workers_identical_and_sends_less():
    res = spawn(sign_reduce_scatter, 3, timeout_s=240, start_method="fork")
    for comp in ("sign", "sign-rot"):
        rs = [r[comp, "reduce_scatter"] for r in res]
        for r in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(rs[0]["params"], rs[r]["params"])), (comp, r)
        h_rs, h_ag = rs[0]["history"][0], res[0][comp, "all_gather"]["history"][0]
        assert h_rs["collective"] == "reduce_scatter+all_gather" and h_ag["collective"] == "all_gather"
        # (n-1)/n of every shard out and (n-1)/n of the coded mean back: under 2 payloads, vs (n-1) = 2 payloads
        assert h_rs["wire_bytes"] < h_ag["wire_bytes"] == 2 * h_ag["payload_bytes"]
        # the same direction as the all_gather's outer step, from twice-coded signs
        a = torch.cat([p.reshape(-1) for p in rs[0]["params"]])
        b = torch.cat([p.reshape(-1) for p in res[0][comp, "all_gather"]["params"]])
        init = torch.cat([p.detach().reshape(-1) for p in tiny_model(0).parameters()])
        assert torch.nn.functional.cosine_similarity(a - init, b - init, dim=0) > 0.8


@pytest.mark.parametrize("compression", ["sign", "fp32"])
def test_survivors_drop_a_lost_worker_and_stay_identical(compression):
    res = spawn(loses_a_worker, 3, (1, compression), timeout_s=240, start_method="fork")
    assert res[1] == {"left": True}
    a, b = res[0], res[2]
    assert a["lost"] == b["lost"] == [1] and a["members"] == b["members"] == [0, 2]
    assert (a["rank"], b["rank"]) == (0, 1)  # rank 2 is rank 1 of the new group
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    h = a["history"]
    assert len(h) == 3 and len(h[0]["all_tokens"]) == 3
    # after the loss only the survivors' tokens (H = 2 and 5 steps of 4) weigh the outer step
    assert h[1]["all_tokens"] == h[2]["all_tokens"] == [8, 20] and h[2]["weights"] == pytest.approx([8 / 28, 20 / 28])


def _signal_when(path, sig, then=None, timeout_s=120.0):
    """A thread that sends ``sig`` to the pid written at ``path`` once it appears, then runs ``then``."""

    def run():
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.path.exists(path):
            time.sleep(0.05)  # (the pid is written whole: a few bytes)
            os.kill(int(open(path).read()), sig)
            if then is not None:
                then()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_killed_worker_is_replaced_and_rejoins_from_the_outer_state(tmp_path):
    killer = _signal_when(tmp_path / "rank1.pid", signal.SIGKILL)
    res = spawn(rejoins, 3, (str(tmp_path),), timeout_s=240, pg_timeout_s=60, start_method="fork", max_restarts=1)
    killer.join(timeout=5)
    new, a, b = res[1], res[0], res[2]
    assert new["replacement"] and not a["replacement"] and not b["replacement"]
    assert a["lost"] == b["lost"] == [1] and a["joined"] == b["joined"] == [1]
    first = min(new["snaps"])  # the replacement's first sync: its weights are the survivors'
    assert new["joined_at"] in (3, 4) and first == new["joined_at"] + 1
    assert torch.equal(new["snaps"][first], a["snaps"][first]) and torch.equal(a["snaps"][first], b["snaps"][first])
    # everyone reached the end together, with identical weights
    assert new["outer_step"] == a["outer_step"] == b["outer_step"] == 8
    assert torch.equal(new["snaps"][8], a["snaps"][8]) and torch.equal(b["snaps"][8], a["snaps"][8])
    members = a["members"]
    assert members[:2] == [[0, 1, 2]] * 2 and members[2] == [0, 2] and members[-1] == [0, 1, 2]
    assert a["eval_loss"][1] < 0.8 * a["eval_loss"][0]  # and it trained


def test_a_stalled_worker_is_dropped_after_the_group_timeout(tmp_path):
    def resume():
        marks = [tmp_path / f"dropped-seen-by-{r}" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        (tmp_path / "resumed").touch()
        os.kill(int(open(tmp_path / "rank2.pid").read()), signal.SIGCONT)

    stopper = _signal_when(tmp_path / "rank2.pid", signal.SIGSTOP, then=resume)
    res = spawn(stalls_once, 3, (str(tmp_path),), timeout_s=240, pg_timeout_s=5, start_method="fork")
    stopper.join(timeout=5)
    assert "worker 2 was dropped from the quorum" in res[2]["dropped"]
    a, b = res[0], res[1]
    assert a["lost"] == b["lost"] == [2] and torch.equal(a["params"], b["params"])
    assert a["members"][0] == [0, 1, 2] and a["members"][1:] == [[0, 1]] * 3


def test_all_reduce_name_is_checked():
    model = tiny_model(0)
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        DiLoCo(model, torch.optim.AdamW(model.parameters()), 2, compression="fp32", all_reduce="tree")
    with pytest.raises(ValueError, match="sign_collective must be one of"):
        DiLoCo(model, torch.optim.AdamW(model.parameters()), 2, sign_collective="tree")


@pytest.mark.parametrize("comp", ["sign", "sign-rot"])
def test_resume_from_checkpoint_is_bit_identical(tmp_path, comp):
    full = spawn(train, 2, (comp, 4, [2, 3], str(tmp_path), 2), timeout_s=240, start_method="fork")
    resumed = spawn(train, 2, (comp, 4, [2, 3], str(tmp_path), None, True), timeout_s=240, start_method="fork")
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(full[r]["params"], resumed[r]["params"]))
    assert len(resumed[0]["history"]) == 2


def test_mismatched_models_and_dead_rank_are_clear_errors():
    with pytest.raises(GeoMeshError, match="shapes differ.*rank\\(s\\) \\[1\\]"):
        spawn(mismatched, 2, timeout_s=120, start_method="fork")
    with pytest.raises(GeoMeshError, match="rank 1 .*exited with code 3") as info:
        spawn(dies, 2, timeout_s=120, pg_timeout_s=20, start_method="fork")
    assert isinstance(info.value, RankError) and info.value.rank == 1 and info.value.exitcode == 3


def test_single_process_matches_manual_nesterov():
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DiLoCo(model, opt, 1, compression="fp32", outer_lr=0.5, outer_momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    ref = [torch.nn.Parameter(b.clone()) for b in before]
    ref_opt = torch.optim.SGD(ref, lr=0.5, momentum=0.9, nesterov=True)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    pg = [b - p.detach() for b, p in zip(before, model.parameters())]
    dl.step(tokens=4)
    for r, g in zip(ref, pg):
        r.grad = g
    ref_opt.step()
    assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), ref))
    with pytest.raises(ValueError, match="compression"):
        DiLoCo(model, opt, 1, compression="int3")
    assert geomesh.__version__


def test_stalled_rank_times_out_with_its_rank_named():
    with pytest.raises(GeoMeshError, match=r"rank\(s\) \[1\] did not finish within 5 s"):
        spawn(stalls, 2, timeout_s=5, start_method="fork")


def test_rebalancing_is_computed_identically_on_every_rank():
    res = spawn(rebalanced, 3, timeout_s=240, start_method="fork")
    assert res[0]["replans"] >= 1
    assert all(r["plan"] == res[0]["plan"] for r in res)
    assert all(all(torch.equal(a, b) for a, b in zip(res[0]["params"], r["params"])) for r in res)
    # the slow rank (w2) now gets fewer tokens per outer step than the others
    toks = {w["name"]: w["tokens"] for w in res[0]["plan"]["workers"]}
    assert toks["w2"] < toks["w0"] and toks["w2"] < toks["w1"], res[0]["plan"]
    assert (res[2]["batch"], res[2]["steps"]) == next(
        (w["batch"], w["inner_steps"]) for w in res[0]["plan"]["workers"] if w["name"] == "w2"
    )


def test_time_boxed_phases_identical_outer_steps_and_slow_rank_does_fewer_tokens():
    from _workers import time_boxed

    res = spawn(time_boxed, 3, timeout_s=240, start_method="fork")
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[r]["params"]))
    h = res[0]["history"]
    assert len(h) == 3
    for s in h[1:]:  # after the first phase's measurements: per-step speed decides the tokens
        assert s["all_tokens"][0] > s["all_tokens"][2] > 0, s["all_tokens"]
    assert all(1 <= b <= 4 for r in res for b in r["batches"])
    assert res[0]["cycle_s"] == res[1]["cycle_s"] == res[2]["cycle_s"]  # re-timed identically everywhere


def test_quorum_arguments_are_checked():
    from geomesh import Quorum

    with pytest.raises(ValueError, match=r"join_timeout_s \(0\) must be a number of seconds in \(0, 3600\]"):
        Quorum(join_timeout_s=0)
    model = tiny_model(0)
    with pytest.raises(ValueError, match="group must be None with a quorum"):
        DiLoCo(model, torch.optim.AdamW(model.parameters()), 2, group=object(), quorum=Quorum())


def _run_single(overlap: bool, steps: int = 12) -> torch.Tensor:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dl = DiLoCo(model, opt, 3, compression="fp32", outer_lr=1.0, outer_momentum=0.0, overlap=overlap)
    for step in range(steps):
        x, y = batch(0, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dl.step(tokens=4)
    dl.flush()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_overlapped_outer_step_equals_the_synchronous_one_where_the_outer_step_is_the_identity():
    # one worker, outer SGD with lr 1 and no momentum: every outer step lands on the local weights, so
    # delaying it by one phase must change nothing, and both equal plain local training
    plain = _run_single(False, steps=0)
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(12):
        x, y = batch(0, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.equal(plain, local)
    torch.testing.assert_close(_run_single(True), _run_single(False), rtol=0, atol=1e-6)
    torch.testing.assert_close(_run_single(True), local, rtol=0, atol=1e-6)


@pytest.mark.parametrize("compression", ["sign", "fp32"])
def test_overlapped_outer_steps_keep_workers_identical_and_train(compression):
    res = spawn(overlapped, 3, (compression,), timeout_s=240, start_method="fork")
    for r in (1, 2):  # the outer weights agree at every sync, and the weights after flush()
        assert all(torch.equal(a, b) for a, b in zip(res[0]["synced"], res[r]["synced"]))
        assert torch.equal(res[0]["params"], res[r]["params"])
    init = torch.cat([p.detach().reshape(-1) for p in tiny_model(0).parameters()])
    # the first sync only starts its exchange: the outer weights move from the second on
    assert torch.equal(res[0]["synced"][0], init) and not torch.equal(res[0]["synced"][1], init)
    start, end = res[0]["loss"]
    assert end < 0.3 * start


def test_overlap_refuses_what_it_cannot_keep():
    from geomesh import Quorum

    model = tiny_model(0)
    with pytest.raises(ValueError, match="overlap=True runs with the all_gather sign exchange"):
        DiLoCo(model, torch.optim.AdamW(model.parameters()), 2, overlap=True, quorum=Quorum())
    dl = DiLoCo(model, torch.optim.AdamW(model.parameters()), 1, overlap=True)
    dl.step(tokens=4)
    with pytest.raises(ValueError, match="call flush\\(\\) first"):
        dl.state_dict()
    dl.flush()
    assert dl.state_dict()["outer_step"] == 1


def test_a_joiner_that_no_member_admits_fails_clearly_instead_of_waiting(tmp_path):
    import torch.distributed as dist

    from geomesh import Quorum

    store = dist.FileStore(str(tmp_path / "store"), -1)
    model = tiny_model(0)
    quorum = Quorum(join=True, join_timeout_s=0.5, store=store)
    with pytest.raises(GeoMeshError, match=r"was not admitted within join_timeout_s=0.5 s"):
        DiLoCo(model, torch.optim.AdamW(model.parameters()), 2, quorum=quorum)
    assert store.check(["geomesh-quorum/join/0"])  # its request was there for the members to see
