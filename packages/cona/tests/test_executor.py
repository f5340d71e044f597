"""Every 2-rank executor against a single-process transformers reference; exact resharding."""

import os

import pytest
import torch

from cona.dist import RankFailure, launch
from cona.executor import V_FLOOR, Executor, initial_state, load_state, save_state
from cona.model import TextData, build_model, model_skeleton, stdlib_tokens, tiny_llama_config
from cona.space import Strategy, StrategyError

SEQ = 32
LR = 3e-3
CLIP = 0.5  # below the first step's gradient norm (checked), so clipping is active
EPS = 1e-4  # Adam divides by sqrt(v)+eps: a tiny eps turns fp-order noise in ~0 gradients into +-lr steps
STRATEGIES = [
    Strategy(2, 1, 1, 2, 8),  # dp with accumulation
    Strategy(2, 1, 1, 4, 8),  # dp, one micro-batch per replica
    Strategy(1, 2, 1, 4, 8),  # tp (Megatron column/row)
    Strategy(1, 1, 2, 2, 8),  # pp, 4 micro-batches GPipe
]

# same-layout switches: dp (accumulation dropped; global batch doubled), pp (GPipe's micro-batch count 4 -> 4 of a
# bigger size, then 4 -> 2), tp (global batch doubled by accumulation)
RETARGETS = [
    (STRATEGIES[0], STRATEGIES[1]),
    (STRATEGIES[0], Strategy(2, 1, 1, 4, 16)),
    (STRATEGIES[3], Strategy(1, 1, 2, 4, 16)),
    (STRATEGIES[3], Strategy(1, 1, 2, 4, 8)),
    (STRATEGIES[2], Strategy(1, 2, 1, 4, 16)),
]


def _data():
    return TextData(stdlib_tokens(200_000), SEQ)


def _worker(rank, world, ckpt_dir):
    cfg = tiny_llama_config()
    data = _data()
    st0 = initial_state(cfg, 0)
    b0, b1 = data.samples(0, 8), data.samples(8, 8)
    out = {"per": {}, "reshard": {}}
    for s in STRATEGIES:
        ex = Executor(s, cfg, st0, lr=LR, eps=EPS)
        r1 = ex.train_step(b0)
        g1 = ex.full_grads()
        r2 = ex.train_step(b1)
        out["per"][s.name] = {
            "loss": [r1.loss, r2.loss],
            "grads": g1,
            "state": ex.full_state().tensors["param"],  # the launcher returns tensors, not dataclasses
            "steps": ex.step,
            "gns": (r1.sq_small, r1.b_small, r1.sq_big, r1.b_big),
        }
        pre = Executor(s, cfg, st0, lr=LR, eps=EPS, precondition=True)
        pre.train_step(b0, gns=False)
        rp = pre.compute_grads(b1)
        out["per"][s.name]["pre_gns"] = (rp.sq_small, rp.b_small, rp.sq_big, rp.b_big, rp.grad_norm)
        ptrs = [b.data_ptr() for b in pre._pre_bufs + pre._gns_scratch]
        rq = pre.compute_grads(b1)  # the same statistics again, in the buffers of the first call
        out["per"][s.name]["pre_reuse"] = (
            ptrs == [b.data_ptr() for b in pre._pre_bufs + pre._gns_scratch],
            (rq.sq_small, rq.sq_big) == (rp.sq_small, rp.sq_big),
        )
        out["per"][s.name]["micro"] = Executor(s, cfg, st0, lr=LR, eps=EPS).micro_batch_stats([b0, b1])
        step0 = Executor(s, cfg, st0, lr=LR, eps=EPS, precondition=True)  # step 0's metric: a warm batch's g^2
        step0.compute_grads(b0, gns=False)
        step0.fold_second_moment()
        out["per"][s.name]["micro_pre"] = step0.micro_batch_stats([b1])
        clipped = Executor(s, cfg, st0, lr=LR, eps=EPS, clip_norm=CLIP)
        rc = clipped.train_step(b0)
        out["per"][s.name]["clip"] = {
            "norm": rc.grad_norm,
            "coef": rc.clip_coef,
            "grads": clipped.full_grads(),
            "state": clipped.full_state().tensors["param"],
        }
    # resharding: every ordered pair, in memory and through a checkpoint, then keep training
    for a in STRATEGIES:
        ex_a = Executor(a, cfg, st0, lr=LR, eps=EPS)
        ex_a.train_step(b0)
        sa = ex_a.full_state()
        for b in STRATEGIES:
            if a == b:
                continue
            ex_b = Executor(b, cfg, sa, lr=LR, eps=EPS)
            sb = ex_b.full_state()
            back = Executor(a, cfg, sb, lr=LR, eps=EPS).full_state()
            path = os.path.join(ckpt_dir, f"{a.name}.safetensors")
            if rank == 0:
                save_state(path, sa, {"strategy": a.name})
            torch.distributed.barrier()
            ex_c = Executor(b, cfg, load_state(path), lr=LR, eps=EPS)
            via_ckpt = ex_c.full_state()
            torch.distributed.barrier()
            ex_b.train_step(b1)
            out["reshard"][(a.name, b.name)] = {
                "memory_exact": sb.equal(sa) and back.equal(sa),
                "ckpt_exact": via_ckpt.equal(sa),
                "continued": ex_b.full_state().tensors["param"],
            }
    # a switch within one dp x tp x pp layout (micro-batch and global batch only) retargets the executor in place:
    # the same state, and the next step the same as after resharding to it
    out["retarget"] = {}
    for a, b in RETARGETS:
        ex_r = Executor(a, cfg, st0, lr=LR, eps=EPS)
        ex_r.train_step(b0)
        ex_s = Executor(b, cfg, ex_r.full_state(), lr=LR, eps=EPS)  # the resharding path
        same = ex_r.same_layout(b) and ex_r.retarget(b) is ex_r
        batch = data.samples(8, b.global_batch)
        ex_r.train_step(batch)
        ex_s.train_step(batch)
        out["retarget"][f"{a.name}->{b.name}"] = {"same": same, "exact": ex_r.full_state().equal(ex_s.full_state())}
    try:
        Executor(STRATEGIES[0], cfg, st0).retarget(STRATEGIES[2])
        out["retarget"]["error"] = None
    except ValueError as e:
        out["retarget"]["error"] = str(e)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(_worker, 2, str(tmp_path_factory.mktemp("ckpt")), timeout_s=400)[0]


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    model = build_model(cfg, 0)
    data = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    losses, grads = [], None
    for start in (0, 8):
        ids = data.samples(start, 8)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": losses, "grads": grads, "params": params, "clip": _clipped_reference()}


def _clipped_reference():
    """One AdamW step after torch's own global-norm clipping, on the unsharded model."""
    model = build_model(tiny_llama_config(), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    ids = _data().samples(0, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {"norm": norm, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_executor_matches_single_process_reference(results, reference, name):
    got = results["per"][name]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    for n, g in reference["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{name}: grad {n}")
    for n, p in reference["params"].items():
        torch.testing.assert_close(got["state"][n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")
    assert got["steps"] == 2
    # the gradient-statistics inputs: |first micro-batch grad|^2 (mean over dp replicas) and |G_B|^2
    sq_small, b_small, sq_big, b_big = got["gns"]
    s = next(x for x in STRATEGIES if x.name == name)
    assert (b_small, b_big) == (s.micro_batch, 8)
    per = 8 // s.dp
    first = (s.accum - 1) * s.micro_batch if s.pp > 1 else 0  # GPipe runs backward last micro-batch first
    want = sum(_sq_grad(range(d * per + first, d * per + first + s.micro_batch)) for d in range(s.dp)) / s.dp
    assert sq_small == pytest.approx(want, rel=1e-4)
    assert sq_big == pytest.approx(_sq_grad(range(8)), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_gradient_clipping_uses_the_global_norm_across_shards_and_replicas(results, reference, name):
    got, ref = results["per"][name]["clip"], reference["clip"]
    assert ref["norm"] > 2 * CLIP  # clipping really acts: a per-shard norm would scale differently
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    assert got["coef"] == pytest.approx(CLIP / (ref["norm"] + 1e-6), rel=1e-5)
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-7, msg=f"{name}: clipped grad {n}")
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["state"][n], p, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_micro_batch_statistics_match_the_reference(results, name, micro_reference):
    """Every micro-batch of two global batches on every replica, and of one batch in step 0's metric (a warm batch's
    squared gradient as v): |g_k|^2, g_k . S and |S|^2 as one process computes them from each micro-batch's own
    gradient, assembled over shards, stages and replicas (slots go replica by replica: compared as sets)."""
    s = next(x for x in STRATEGIES if x.name == name)
    data = _data()
    b0, b1 = data.samples(0, 8), data.samples(8, 8)
    for key, ids, warm in (("micro", torch.cat([b0, b1]), None), ("micro_pre", b1, b0)):
        b, norms, dots, mean_sq = results["per"][name][key]
        want, want_sq = micro_reference(ids, s.micro_batch, warm, EPS)
        assert b == s.micro_batch and len(norms) == len(dots) == len(want), key
        got = sorted(zip(norms, dots))
        assert [x for p in got for x in p] == pytest.approx([x for p in want for x in p], rel=1e-4), key
        assert mean_sq == pytest.approx(want_sq, rel=1e-4), key


def _sq_grad(rows):
    model = build_model(tiny_llama_config(), 0)
    ids = _data().samples(0, 8)[list(rows)]
    model(input_ids=ids, labels=ids).loss.backward()
    return float(sum(p.grad.double().pow(2).sum() for p in model.parameters()))


def _pre_sq(rows):
    """|g|^2 of rows of the second batch in Adam's metric g / (sqrt(v_hat) + eps) after one step on the first."""
    model = build_model(tiny_llama_config(), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0)
    ids = _data().samples(0, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    ids = _data().samples(8, 8)[list(rows)]
    model(input_ids=ids, labels=ids).loss.backward()
    sq = 0.0
    for p in model.parameters():
        v = opt.state[p]["exp_avg_sq"] / (1 - 0.95)
        root = v.clamp(min=V_FLOOR * float(v.mean())).sqrt()  # floored per full tensor
        sq += float((p.grad / (root + EPS)).double().pow(2).sum())
    return sq


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_gradient_statistics_reuse_their_buffers(results, name):
    """The preconditioner and the weighted-gradient scratch are allocated once per executor, not per step,
    and a repeated computation gives the same statistics."""
    same_buffers, same_values = results["per"][name]["pre_reuse"]
    assert same_buffers and same_values


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_preconditioned_gradient_statistics_match_the_reference(results, name):
    sq_small, b_small, sq_big, b_big, norm = results["per"][name]["pre_gns"]
    s = next(x for x in STRATEGIES if x.name == name)
    per = 8 // s.dp
    first = (s.accum - 1) * s.micro_batch if s.pp > 1 else 0
    want = sum(_pre_sq(range(d * per + first, d * per + first + s.micro_batch)) for d in range(s.dp)) / s.dp
    assert (b_small, b_big) == (s.micro_batch, 8)
    assert sq_small == pytest.approx(want, rel=1e-3)
    assert sq_big == pytest.approx(_pre_sq(range(8)), rel=1e-3)
    assert norm is not None and norm > 0  # the plain global norm is still reported


@pytest.mark.slow
def test_resharding_round_trips_exactly_and_training_continues(results, reference):
    pairs = results["reshard"]
    assert len(pairs) == len(STRATEGIES) * (len(STRATEGIES) - 1)
    for (a, b), r in pairs.items():
        assert r["memory_exact"], f"in-memory reshard {a} -> {b} -> {a} not bit-exact"
        assert r["ckpt_exact"], f"checkpoint reshard {a} -> {b} not bit-exact"
        for n, p in reference["params"].items():
            torch.testing.assert_close(r["continued"][n], p, rtol=1e-4, atol=1e-5, msg=f"{a} -> {b} then a step: {n}")


def test_a_switch_within_one_layout_retargets_in_place_exactly(results):
    r = results["retarget"]
    for a, b in RETARGETS:
        name = f"{a.name}->{b.name}"
        assert r[name]["same"], name
        assert r[name]["exact"], f"retarget {name} then a step differs from resharding to it"
    assert "same dp x tp x pp layout" in r["error"] and "dp1-tp2-pp1-mb4-gb8" in r["error"]


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()


def _die_on_rank1(rank, world):
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()


def test_failed_and_dead_ranks_are_named():
    with pytest.raises(RankFailure, match=r"rank 1 .*failed: ValueError: boom on purpose"):
        launch(_fail_on_rank1, 2, timeout_s=120, pg_timeout_s=20)
    with pytest.raises(RankFailure, match=r"rank 1 .*exited with code 3"):
        launch(_die_on_rank1, 2, timeout_s=120, pg_timeout_s=20)


_SLEEPER = """
import os, sys, time
from cona.dist import launch

def sleeper(rank, world, where):
    with open(os.path.join(where, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    launch(sleeper, 2, sys.argv[1], timeout_s=300)
"""


def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    """A killed launcher (SIGTERM: `kill`, a CI timeout) takes its ranks with it instead of leaving them running."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.5)  # both pid files complete
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_check_strategy_messages():
    from cona.space import ModelDims, check_strategy

    dims = ModelDims.from_config(tiny_llama_config(heads=4, kv_heads=2), SEQ)
    with pytest.raises(StrategyError, match="num_key_value_heads=2 is not divisible by tp=4"):
        check_strategy(Strategy(1, 4, 1, 1, 4), dims)
    with pytest.raises(StrategyError, match="world has 4 ranks"):
        check_strategy(Strategy(2, 1, 1, 1, 4), dims, world=4)


def test_model_skeleton_is_the_model_on_meta_without_initialising_it(monkeypatch):
    from transformers import PreTrainedModel

    inits = []
    monkeypatch.setattr(PreTrainedModel, "init_weights", lambda self: inits.append(type(self).__name__))
    config = tiny_llama_config(2, 32, 4, 2, 96)
    skeleton = model_skeleton(config)
    assert inits == []  # an executor puts its own shards in: no random draws
    assert all(t.is_meta for t in skeleton.state_dict().values())
    reference = build_model(config)
    assert inits  # the same tree built for training is initialised (so the check above can fail)
    assert {k: v.shape for k, v in skeleton.state_dict().items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    assert skeleton.config._attn_implementation == "sdpa"
