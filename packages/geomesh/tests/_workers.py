"""Worker functions for the multi-process tests (importable by spawned processes)."""

import os

import torch

from geomesh import DiLoCo


def tiny_model(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def batch(rank: int, step: int, size: int = 4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(size, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(
    rank,
    world,
    compression,
    outer_steps,
    inner_steps_by_rank,
    ckpt=None,
    save_at=None,
    resume=False,
    all_reduce="ring",
    sign_collective="all_gather",
):
    model = tiny_model(seed=rank)  # different inits: DiLoCo must start everyone from rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rotate = compression == "sign-rot"  # the sign payload in the randomized-Hadamard basis
    comp = "sign" if rotate else compression
    dl = DiLoCo(
        model,
        opt,
        inner_steps_by_rank[rank],
        compression=comp,
        chunk_size=16,
        rotate=rotate,
        all_reduce=all_reduce,
        sign_collective=sign_collective,
    )
    step = 0
    if resume:
        step = dl.load(os.path.join(ckpt, f"rank{rank}.pt"))["step"]
    while dl.outer_step < outer_steps:
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        stats = dl.step(tokens=x.shape[0])
        if stats is not None and save_at is not None and dl.outer_step == save_at:
            dl.save(os.path.join(ckpt, f"rank{rank}.pt"), extra={"step": step})
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [h.to_dict() for h in dl.history],
    }


def all_variants(rank, world):
    out = {}
    for comp in ("sign", "sign-rot", "fp32", "fp16"):
        out[comp] = train(rank, world, comp, outer_steps=3, inner_steps_by_rank=[2, 3, 5][:world])
    return out


def ring_and_gather(rank, world):
    """The dense fp32 outer step with gloo's ring all-reduce and with the gather (all_gather + local sum)."""
    return {algo: train(rank, world, "fp32", 2, [2, 3, 5][:world], all_reduce=algo) for algo in ("ring", "gather")}


def sign_reduce_scatter(rank, world):
    """DiLoCo with the sharded sign exchange, plain and rotated, next to the all_gather one."""
    out = {}
    for comp in ("sign", "sign-rot"):
        for coll in ("all_gather", "reduce_scatter"):
            out[comp, coll] = train(rank, world, comp, 3, [2, 3, 5][:world], sign_collective=coll)
    return out


def exact_sign_mean(rank, world):
    """Every worker sends m_r(chunk) x P for one +-1 pattern P: sign coding is exact there, so the
    sharded exchange must return the token-weighted mean of the m_r exactly."""
    from geomesh import SignCompressor, SignReduceScatter

    pattern = torch.where(torch.arange(96) % 3 == 0, -1.0, 1.0)
    mags = torch.arange(1, 7, dtype=torch.float32).repeat_interleave(16) * (rank + 1)
    comp = SignCompressor([(96,)], chunk_size=16, scale="rms")
    rs = SignReduceScatter(comp, world, rank)
    (got,) = rs.reduce([mags * pattern], tokens=10 * (rank + 1))
    return got, rs.wire_bytes(), rs.slot


def loses_a_worker(rank, world, leaver=1, compression="sign"):
    """Rank ``leaver`` leaves after the first outer step (its sockets close, as when it dies); the
    others carry on with a quorum for two more outer steps."""
    import torch.distributed as dist

    from geomesh import Quorum

    model = tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DiLoCo(model, opt, [2, 3, 5][rank], compression=compression, chunk_size=16, quorum=Quorum(grace_s=0.5))
    step = 0
    while dl.outer_step < 3:
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if dl.step(tokens=x.shape[0]) is not None and rank == leaver:
            dist.destroy_process_group()
            return {"left": True}
    dist.barrier(group=dl.group)
    dist.destroy_process_group()  # the first group lost a member: the launcher must not wait on it
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [h.to_dict() for h in dl.history],
        "lost": dl.quorum.lost,
        "members": dl.quorum.members,
        "rank": dl.rank,
    }


def mismatched(rank, world):
    model = tiny_model(0, hidden=16 if rank == 0 else 17)
    DiLoCo(model, torch.optim.AdamW(model.parameters()), 2)


def dies(rank, world):
    model = tiny_model(0)
    dl = DiLoCo(model, torch.optim.AdamW(model.parameters()), 1)
    if rank == 1:
        os._exit(3)
    dl.step(tokens=1)


def stalls(rank, world):
    import time

    if rank == 1:
        time.sleep(600)


def rebalanced(rank, world):
    """Rank 2 is made slow (sleeps per step): every rank must compute the same new plan from the sync meta."""
    import time

    from geomesh import Rebalancer, WorkerProfile, plan

    names = [f"w{r}" for r in range(world)]
    profiles = [WorkerProfile(n, 1000.0, step_overhead_s=0.0) for n in names]
    p0 = plan(profiles, seq_len=1, target_tokens=4 * 4 * world, max_batch=8, preferred_batch=4)
    rb = Rebalancer(p0, threshold=0.3, ema=1.0, max_batch=8, preferred_batch=4)
    model = tiny_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mine = p0.worker(names[rank])
    dl = DiLoCo(model, opt, mine.inner_steps, batch_size=mine.batch, rebalancer=rb, worker_name=names[rank])
    step = 0
    while dl.outer_step < 3:
        x, y = batch(rank, step, size=dl.batch_size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.15 if rank == world - 1 else 0.01)  # 15x slower: dominates scheduling jitter on a loaded host
        step += 1
        dl.step(tokens=x.shape[0])
    return {
        "plan": rb.plan.to_dict(),
        "replans": rb.replans,
        "params": [p.detach().clone() for p in model.parameters()],
        "steps": dl.inner_steps,
        "batch": dl.batch_size,
    }


def time_boxed(rank, world):
    """Time-boxed phases (PhaseClock): rank r sleeps (1 + 3r) x 10 ms per step; all share one deadline."""
    import time

    from geomesh import PhaseClock, WorkerProfile

    model = tiny_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 0.01 * (1 + 3 * rank)
    prof = WorkerProfile(f"w{rank}", 4 / per)  # a deliberately rough guess: the clock measures the rest
    # ~0.5 s cycles (the three ranks make ~560 tokens/s): a 0.1 s cycle (60 tokens) left a rank whose post-sync
    # work ran late under load no time for a step, so the test read its scheduling, not the clock
    clock = PhaseClock(0.3, 4, prof, seq_len=1, target_tokens=300)
    dl = DiLoCo(model, opt, 1 << 30, batch_size=4, phase_clock=clock, worker_name=f"w{rank}")
    dl.start_phase()
    step, batches = 0, []
    while dl.outer_step < 3:
        b = dl.batch_size
        batches.append(b)
        x, y = batch(rank, step, size=b)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(per * b / 4)
        step += 1
        dl.step(tokens=x.shape[0])
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [h.to_dict() for h in dl.history],
        "batches": batches,
        "cycle_s": clock.cycle_s,
    }


def _wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``cond`` until true; a clear failure instead of a hang."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.02)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def rejoins(rank, world, pid_dir, outer_steps=8):
    """Rank 1 stops in its inner phase after outer step 2 and waits to be SIGKILLed by the test; the
    launcher starts a replacement, which joins the survivors at an outer-step boundary."""
    import time

    from geomesh import Quorum
    from hwtopo.launch import restart_count

    replacement = restart_count() > 0
    model = tiny_model(seed=10 + rank + 7 * replacement)  # its own init: the outer state must overwrite it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    q = Quorum(grace_s=0.5, timeout_s=30, join=replacement, join_timeout_s=60)
    dl = DiLoCo(model, opt, [2, 3, 5][rank], compression="sign", chunk_size=16, quorum=q)

    def linear_batch(r, i, size=4):  # a task this model learns in a few outer steps
        x = batch(r, i, size)[0]
        return x, 0.3 * x.sum(dim=1, keepdim=True)

    x_eval, y_eval = linear_batch(99, 0, size=256)

    def eval_loss() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x_eval), y_eval))

    joined_at, snaps, start_loss = dl.outer_step, {}, eval_loss()
    step = 0
    while dl.outer_step < outer_steps:
        if rank == 1 and not replacement and dl.outer_step == 2 and dl.local_step == 1:
            with open(os.path.join(pid_dir, "rank1.pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(60)  # the test kills it here
            raise RuntimeError("rank 1 was not killed")
        if rank != 1 and q.lost and not q.joined:  # hold on until the replacement asks (no race with the end)
            _wait_for(q.join_pending, "a join request")
        x, y = linear_batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if dl.step(tokens=x.shape[0]) is not None:
            snaps[dl.outer_step] = _flat(model)
    return {
        "replacement": replacement,
        "joined_at": joined_at,
        "snaps": snaps,
        "members": [h.members for h in dl.history],
        "lost": q.lost,
        "joined": q.joined,
        "eval_loss": (start_loss, eval_loss()),
        "outer_step": dl.outer_step,
    }


def stalls_once(rank, world, marks):
    """Rank 2 is SIGSTOPped by the test in its inner phase after outer step 1; the others drop it after
    their group's timeout and go on. Resumed once they have, it finds itself dropped."""
    from geomesh import GeoMeshError, Quorum

    model = tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    q = Quorum(grace_s=0.5, timeout_s=30)
    dl = DiLoCo(model, opt, [2, 3, 5][rank], compression="sign", chunk_size=16, quorum=q)
    step = 0
    try:
        while dl.outer_step < 4:
            if rank == 2 and dl.outer_step == 1 and dl.local_step == 1:
                with open(os.path.join(marks, "rank2.pid"), "w") as f:
                    f.write(str(os.getpid()))
                _wait_for(lambda: os.path.exists(os.path.join(marks, "resumed")), "the resume mark", 120)
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            dl.step(tokens=x.shape[0])
            if q.lost:
                open(os.path.join(marks, f"dropped-seen-by-{rank}"), "w").close()
    except GeoMeshError as e:
        return {"dropped": str(e)}
    return {"params": _flat(model), "members": [h.members for h in dl.history], "lost": q.lost}


def overlapped(rank, world, compression="sign", outer_steps=6):
    """The one-step-delayed outer step: synced weights after every sync, and the weights after flush()."""
    model = tiny_model(seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # (a milder outer momentum than the default: 0.9 makes this tiny task oscillate, delayed or not)
    kw = {"outer_lr": 0.5, "outer_momentum": 0.5, "overlap": True}
    dl = DiLoCo(model, opt, [2, 3, 5][rank], compression=compression, chunk_size=16, **kw)
    x_eval = batch(99, 0, size=256)[0]
    y_eval = 0.3 * x_eval.sum(dim=1, keepdim=True)
    start = float(torch.nn.functional.mse_loss(model(x_eval), y_eval).detach())
    synced, step = [], 0
    while dl.outer_step < outer_steps:
        x = batch(rank, step)[0]
        torch.nn.functional.mse_loss(model(x), 0.3 * x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if dl.step(tokens=x.shape[0]) is not None:
            synced.append(torch.cat([s.detach().reshape(-1) for s in dl.synced]).clone())
    dl.flush()
    end = float(torch.nn.functional.mse_loss(model(x_eval), y_eval).detach())
    return {"synced": synced, "params": _flat(model), "final_synced": synced[-1], "loss": (start, end)}
