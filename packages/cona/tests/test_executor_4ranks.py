"""Combined strategies on 4 ranks (dp x tp, dp x pp, tp x pp, dp4) against the single-process reference."""

import pytest
import torch

from cona.dist import launch
from cona.executor import Executor, initial_state
from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config
from cona.space import Strategy

FIRST = Strategy(2, 2, 1, 2, 8)
CLIP = 0.5
THEN = [Strategy(2, 1, 2, 2, 8), Strategy(1, 2, 2, 2, 8), Strategy(4, 1, 1, 1, 8)]


def _ids(start=0):
    return TextData(stdlib_tokens(200_000), 32).samples(start, 8)


def _worker(rank, world):
    cfg = tiny_llama_config()
    ids = _ids()
    ex = Executor(FIRST, cfg, initial_state(cfg, 0), lr=1e-3, eps=1e-4)
    r = ex.train_step(ids)
    out = {"first": (r.loss, ex.full_grads())}
    state = ex.full_state()
    for s in THEN:  # reshard the stepped state into each layout, then a forward/backward there
        ex = Executor(s, cfg, state, lr=1e-3, eps=1e-4)
        exact = ex.full_state().equal(state)
        r = ex.compute_grads(ids)
        out[s.name] = (exact, r.loss, ex.full_grads())
    for s in [FIRST, *THEN]:  # one clipped step from the initial state in every layout
        ex = Executor(s, cfg, initial_state(cfg, 0), lr=1e-3, eps=1e-4, clip_norm=CLIP)
        r = ex.train_step(ids)
        out["clip", s.name] = (r.grad_norm, ex.full_state().tensors["param"])
    for s in [FIRST, THEN[0]]:  # step 0's micro-batch statistics with dp x tp and dp x pp
        ex = Executor(s, cfg, initial_state(cfg, 0), lr=1e-3, eps=1e-4, precondition=True)
        ex.compute_grads(ids, gns=False)
        ex.fold_second_moment()
        out["micro", s.name] = ex.micro_batch_stats([_ids(8)])
    return out if rank == 0 else None


@pytest.mark.slow  # 4 spawned ranks: ~20 s on 2 cores; runs in nox -s tests like every slow test
def test_four_rank_combinations_match_reference_and_reshard_exactly(micro_reference):
    got = launch(_worker, 4, timeout_s=500)[0]
    model = build_model(tiny_llama_config(), 0)
    ids = _ids()
    _check_clipped(got, ids)
    for s in [FIRST, THEN[0]]:  # replicas' slots with several ranks each, |S|^2 over dp, step 0's metric
        b, norms, dots, mean_sq = got["micro", s.name]
        want, want_sq = micro_reference(_ids(8), s.micro_batch, ids)
        assert b == s.micro_batch and len(norms) == len(want) == 8 // s.micro_batch, s.name
        got_pairs = [x for p in sorted(zip(norms, dots)) for x in p]
        assert got_pairs == pytest.approx([x for p in want for x in p], rel=1e-4), s.name
        assert mean_sq == pytest.approx(want_sq, rel=1e-4), s.name
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert got["first"][0] == pytest.approx(float(loss.detach()), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["first"][1][n], p.grad, rtol=1e-4, atol=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.0)
    opt.step()
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for s in THEN:
        exact, l2, grads = got[s.name]
        assert exact, f"{FIRST.name} -> {s.name} resharding not bit-exact"
        assert l2 == pytest.approx(float(loss.detach()), rel=1e-5), s.name
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=2e-5, msg=f"{s.name}: {n}")


def _check_clipped(got, ids):
    """Global-norm clipping across dp replicas, tp shards and pp stages equals torch's on one process."""
    model = build_model(tiny_llama_config(), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.0)
    model(input_ids=ids, labels=ids).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    assert norm > 2 * CLIP
    opt.step()
    for s in [FIRST, *THEN]:
        got_norm, params = got["clip", s.name]
        assert got_norm == pytest.approx(norm, rel=1e-5), s.name
        for n, p in model.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-4, atol=1e-5, msg=f"{s.name} clipped: {n}")
