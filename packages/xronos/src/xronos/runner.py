"""A real fine-tuning run (``xronos train``): profile, partition, train with checkpoints, evaluate, save.

Checkpoints go to ``ckpt_dir`` (default: ``<cache_dir()>/<run>``, ``~/.cache/mlsyskit/xronos`` on Linux), one directory per
step: every rank writes ``step-<N>/rank<r>.pt`` atomically, the ranks confirm to each other that all
writes succeeded, and only then rank 0 writes ``step-<N>/COMMITTED``. A rerun with the same directory
resumes from the newest committed step whose rank files every rank still has, so the ranks always
resume from the same step (ranks restored from different steps disagree about the collectives to run).
Incomplete steps are never resumed; the two newest committed steps are kept and older ones pruned.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hwtopo import atomic_write_text, console, resume_point, sync_point

from .launch import emulate_speed, init_from_env, spawn
from .partition import Partition, PartitionError, even_partition, partition
from .profile import profile_group
from .rebalance import repartition
from .shard import save_full
from .train import CheckpointError, TPTrainer, TrainConfig, make_corpus, read_checkpoint

__all__ = [
    "cache_dir",
    "finetune",
    "finetune_rank",
    "finetune_torchrun",
    "committed_steps",
    "choose_resume_step",
    "resume_step",
    "step_dir",
]

log = logging.getLogger(__name__)
COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"step-(\d+)")


def cache_dir() -> Path:
    """Where runs keep their checkpoints by default (``$MLSYSKIT_CACHE_DIR``/``$XDG_CACHE_HOME`` respected)."""
    return console.cache_dir("xronos")


def _default_ckpt_dir(cfg: TrainConfig, mode: str, world: int) -> Path:
    return cache_dir() / f"{cfg.family}-{mode}-{world}r-seed{cfg.seed}"


def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step}"


def _step_dirs(ckpt_dir: str | os.PathLike) -> dict[int, Path]:
    out = {}
    root = Path(ckpt_dir)
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.fullmatch(d.name)
            if m and d.is_dir():
                out[int(m.group(1))] = d
    return out


def committed_steps(ckpt_dir: str | os.PathLike) -> dict[int, int]:
    """``{step: world size}`` of every step directory holding a valid commit marker."""
    out = {}
    for step, d in _step_dirs(ckpt_dir).items():
        marker = d / COMMIT_MARKER
        if not marker.is_file():
            continue
        try:
            meta = json.loads(marker.read_text())
            world, marked = int(meta["world"]), int(meta["step"])
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("ignoring %s: not a valid commit marker (%s)", marker, e)
            continue
        if marked != step or world < 1:
            log.warning("ignoring %s: it marks step %s of %s ranks", marker, marked, world)
            continue
        out[step] = world
    return out


def choose_resume_step(committed: dict[int, int], world: int, complete: set[int]) -> int | None:
    """The newest committed step of ``world`` ranks whose files every rank has (``complete``), or None.

    The newest committed step must have been written by ``world`` ranks: resuming an older one would
    silently drop its progress, so another world size is an error.
    """
    if committed:
        newest = max(committed)
        if committed[newest] != world:
            raise PartitionError(
                f"checkpoint step-{newest} was written by {committed[newest]} ranks, not {world}; "
                "run with that many ranks or use another --ckpt-dir"
            )
    usable = [s for s, w in committed.items() if w == world and s in complete]
    return max(usable) if usable else None


def resume_step(ckpt_dir: str | os.PathLike, world: int) -> int | None:
    """:func:`choose_resume_step` read from one filesystem that holds every rank's files."""
    committed = committed_steps(ckpt_dir)
    complete = {s for s in committed if all((step_dir(ckpt_dir, s) / f"rank{r}.pt").is_file() for r in range(world))}
    return choose_resume_step(committed, world, complete)


def _collective(fn, *args, **kw):
    sync_point()  # emulated compute before the collective is paid outside the wait
    fn(*args, **kw)
    resume_point()


def agree_resume_step(ckpt_dir: str | os.PathLike, rank: int, world: int) -> int | None:
    """The step every rank resumes from: rank 0's commit markers, kept only where every rank has its
    own file (each rank looks at its own filesystem, so a per-host checkpoint directory works too)."""
    committed = committed_steps(ckpt_dir) if rank == 0 else {}
    count = torch.tensor([len(committed)], dtype=torch.int64)
    _collective(dist.broadcast, count, 0)
    if int(count) == 0:
        return None
    table = torch.tensor(sorted(committed.items()), dtype=torch.int64).reshape(-1, 2)
    if rank != 0:
        table = torch.zeros(int(count), 2, dtype=torch.int64)
    _collective(dist.broadcast, table, 0)
    committed = {int(s): int(w) for s, w in table.tolist()}
    have = torch.tensor([(step_dir(ckpt_dir, s) / f"rank{rank}.pt").is_file() for s in committed], dtype=torch.int64)
    _collective(dist.all_reduce, have, op=dist.ReduceOp.MIN)
    complete = {s for s, ok in zip(committed, have.tolist()) if ok}
    return choose_resume_step(committed, world, complete)


def _remove_steps(ckpt_dir: str | os.PathLike, rank: int, steps) -> None:
    """Delete this rank's files (rank 0: the commit marker first) of ``steps``, and each directory once
    empty; files xronos did not write are left alone."""
    dirs = _step_dirs(ckpt_dir)
    for s in steps:
        d = dirs.get(s)
        if d is None:
            continue
        if rank == 0:
            (d / COMMIT_MARKER).unlink(missing_ok=True)
            for tmp in d.glob(f".{COMMIT_MARKER}.*"):
                tmp.unlink(missing_ok=True)
        for f in d.glob(f"rank{rank}.pt*"):
            f.unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass  # another rank's files are still there: the last rank to finish removes it


def commit_checkpoint(trainer: TPTrainer, ckpt_dir: str | os.PathLike, world: int, previous: int | None) -> int:
    """Write this rank's checkpoint of ``trainer.step_idx`` and commit the step once every rank has written.

    Every rank calls it at the same step. A rank whose write fails tells the others through the same
    all-reduce that confirms the others' writes, and every rank then raises :class:`CheckpointError`:
    the step stays uncommitted and a rerun resumes from ``previous``. Returns the committed step.
    """
    step, rank = trainer.step_idx, trainer.rank
    d = step_dir(ckpt_dir, step)
    written = torch.zeros(world, dtype=torch.int64)
    error = None
    try:
        trainer.save(d)
        written[rank] = 1
    except (OSError, RuntimeError) as e:  # torch.save reports some write failures as RuntimeError
        error = e
    _collective(dist.all_reduce, written)
    failed = [r for r in range(world) if not written[r]]
    if failed:
        raise CheckpointError(
            f"step {step} was not committed: rank(s) {failed} could not write to {d}"
            + (f" (rank {rank}: {error})" if error is not None else "")
        ) from error
    if rank == 0:
        atomic_write_text(d / COMMIT_MARKER, json.dumps({"step": step, "world": world}) + "\n")
    keep = {step, previous}  # the one before the newest, in case the newest is damaged later
    _remove_steps(ckpt_dir, rank, [s for s in _step_dirs(ckpt_dir) if s < step and s not in keep])
    return step


def _resume(ckpt_dir, rank: int, world: int) -> int | None:
    """Agree on the resume step and discard every newer step directory (never complete, or damaged):
    a stale marker there could otherwise commit a mix of old and new rank files."""
    flat = sorted(Path(ckpt_dir).glob("rank*.pt"))
    if flat and rank == 0:
        log.warning(
            "%s holds per-rank checkpoints from an older xronos (%s); they are not resumed, since ranks "
            "saved them independently and may be at different steps: delete them",
            ckpt_dir,
            ", ".join(p.name for p in flat),
        )
    step = agree_resume_step(ckpt_dir, rank, world)
    newer = [s for s in _step_dirs(ckpt_dir) if step is None or s > step]
    _remove_steps(ckpt_dir, rank, newer)
    _collective(dist.barrier)  # no rank writes a new step before every rank has cleared the old ones
    return step


def finetune_rank(rank, world, cfg_dict, mode, ckpt_dir, ckpt_every, save_dir, memory_bytes) -> dict:
    """One rank of ``xronos train`` in a joined process group: profile, partition, resume, train with
    committed checkpoints, evaluate and optionally save; the rank's report (plain data)."""
    cfg = TrainConfig(**cfg_dict)
    shape = cfg.shape()
    corpus = make_corpus(cfg)
    costs, prof = profile_group(shape, cfg.batch, cfg.seq_len, memory_bytes=memory_bytes)
    part = partition(shape, costs) if mode == "xronos" else even_partition(shape, world)
    committed = _resume(ckpt_dir, rank, world)
    saved = None if committed is None else saved_partition(step_dir(ckpt_dir, committed), rank, shape, world)
    trainer = TPTrainer(cfg, saved or part, rank, None, corpus)
    resumed_from = None
    if committed is not None:
        path = trainer.checkpoint_path(step_dir(ckpt_dir, committed))
        if not trainer.load(path.parent) or trainer.step_idx != committed:
            raise CheckpointError(f"{path} does not hold step {committed}, which its directory was committed as")
        resumed_from = trainer.step_idx
    if saved is not None and saved != part:
        repartition(trainer, part)  # the profile changed since the checkpoint: reshard it exactly
    losses, times = [], []
    t0 = time.perf_counter()
    while trainer.step_idx < cfg.steps:
        rec = trainer.step()
        losses.append(rec["loss"])
        times.append(rec["step_s"])
        if ckpt_every and trainer.step_idx % ckpt_every == 0:
            committed = commit_checkpoint(trainer, ckpt_dir, world, committed)
    if trainer.step_idx != committed:
        committed = commit_checkpoint(trainer, ckpt_dir, world, committed)
    eval_loss = trainer.evaluate()
    saved_to = None
    if save_dir:
        saved_to = save_full(trainer.model, save_dir, rank=rank)
    return {
        "rank": rank,
        "partition": part.describe(),
        "profile": prof["ranks"][rank],
        "resumed_from": resumed_from,
        "committed": committed,
        "losses": losses,
        "step_s": times,
        "train_s": time.perf_counter() - t0,
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50)),
        "saved": None if saved_to is None else str(saved_to),
    }


def saved_partition(directory, rank: int, shape, world: int) -> Partition | None:
    """The partition this rank's checkpoint in step directory ``directory`` was written with (None if
    there is none)."""
    path = Path(directory) / f"rank{rank}.pt"
    if not path.exists():
        return None
    meta = read_checkpoint(path)["partition"]
    if not meta or len(meta["kv_heads"]) != world:
        raise PartitionError(
            f"checkpoint {path} was written by {len(meta['kv_heads']) if meta else '?'} ranks, not {world}"
        )
    return Partition(shape, tuple(meta["kv_heads"]), tuple(c // shape.mlp_block for c in meta["mlp_columns"]))


def _check_run(cfg: TrainConfig, mode: str, world: int) -> None:
    """Refuse a run before any rank trains: a bad config, mode, or more ranks than attention units."""
    cfg.validate()
    if mode not in ("xronos", "tp"):
        raise ValueError(f"mode must be 'xronos' or 'tp', not {mode!r}")
    shape = cfg.shape()
    if shape.attn_units < world:
        raise PartitionError(
            f"the model's {shape.num_heads} heads in {shape.num_kv_heads} KV groups cannot be split across "
            f"{world} ranks"
        )


def finetune(
    cfg: TrainConfig,
    speeds: list[float],
    mode: str = "xronos",
    ckpt_dir: str | os.PathLike | None = None,
    ckpt_every: int = 10,
    save_dir: str | os.PathLike | None = None,
    memory_bytes: float | None = None,
    timeout_s: float = 3600.0,
    emulate: str = "dilate",
) -> list[dict]:
    """Fine-tune on ``len(speeds)`` local ranks (emulated speeds, ``emulate``: "dilate" or "cgroup");
    returns each rank's report."""
    _check_run(cfg, mode, len(speeds))
    ckpt = Path(ckpt_dir) if ckpt_dir else _default_ckpt_dir(cfg, mode, len(speeds))
    ckpt.mkdir(parents=True, exist_ok=True)
    return spawn(
        finetune_rank,
        len(speeds),
        (cfg.to_dict(), mode, str(ckpt), ckpt_every, None if save_dir is None else str(save_dir), memory_bytes),
        speeds=speeds,
        timeout_s=timeout_s,
        pg_timeout_s=300,
        emulate=emulate,
    )


def finetune_torchrun(
    cfg: TrainConfig,
    speeds: list[float],
    mode: str = "xronos",
    ckpt_dir: str | os.PathLike | None = None,
    ckpt_every: int = 10,
    save_dir: str | os.PathLike | None = None,
    memory_bytes: float | None = None,
    emulate: str | None = None,
    threads: int = 1,
) -> dict | None:
    """This process as one rank of a ``torchrun`` launch: join from the environment, fine-tune, leave
    the group once every rank is done; rank 0's report, None on the other ranks.

    ``speeds``: one per rank, or one for all; a rank is slowed to its speed only with ``emulate``
    ("dilate" or "cgroup"). ``threads``: torch threads of this rank.
    """
    torch.set_num_threads(threads)
    rank, world = init_from_env(timeout_s=300)
    if len(speeds) not in (1, world):
        raise ValueError(f"speeds lists {len(speeds)} ranks but WORLD_SIZE is {world}")
    _check_run(cfg, mode, world)  # the same checks as finetune(), on every rank alike
    speed = speeds[rank] if len(speeds) == world else speeds[0]
    throttle = emulate_speed(speed, emulate) if emulate else None
    try:
        ckpt = Path(ckpt_dir) if ckpt_dir else _default_ckpt_dir(cfg, mode, world)
        ckpt.mkdir(parents=True, exist_ok=True)
        save = None if save_dir is None else str(save_dir)
        report = finetune_rank(rank, world, cfg.to_dict(), mode, str(ckpt), ckpt_every, save, memory_bytes)
        # no rank tears its process group down while another still talks to it: a rank that exited with
        # its gloo group alive could abort in a C++ destructor after its work was done
        _collective(dist.barrier)
    finally:
        if throttle is not None:
            throttle.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return report if rank == 0 else None
