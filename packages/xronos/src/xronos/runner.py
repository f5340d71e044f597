"""A real fine-tuning run (``xronos train``): profile, partition, train with checkpoints, evaluate, save.

Checkpoints go to ``ckpt_dir`` (default: ``$XDG_CACHE_HOME/mlsyskit/xronos/<run>``), one file per
rank written atomically; a rerun with the same directory resumes from the last one.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hwtopo import resume_point, sync_point

from .launch import spawn
from .partition import Partition, PartitionError, even_partition, partition
from .profile import profile_group
from .rebalance import repartition
from .shard import save_full
from .train import TPTrainer, TrainConfig, make_corpus

__all__ = ["cache_dir", "finetune"]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlsyskit" / "xronos"


def _finetune_worker(rank, world, cfg_dict, mode, ckpt_dir, ckpt_every, save_dir, memory_bytes):
    cfg = TrainConfig(**cfg_dict)
    shape = cfg.shape()
    corpus = make_corpus(cfg)
    costs, prof = profile_group(shape, cfg.batch, cfg.seq_len, memory_bytes=memory_bytes)
    part = partition(shape, costs) if mode == "xronos" else even_partition(shape, world)
    saved = saved_partition(ckpt_dir, rank, shape, world)
    trainer = TPTrainer(cfg, saved or part, rank, None, corpus)
    resumed_from = trainer.step_idx if trainer.load(ckpt_dir) else None
    if saved is not None and saved != part:
        repartition(trainer, part)  # the profile changed since the checkpoint: reshard it exactly
    losses, times = [], []
    t0 = time.perf_counter()
    while trainer.step_idx < cfg.steps:
        rec = trainer.step()
        losses.append(rec["loss"])
        times.append(rec["step_s"])
        if ckpt_every and trainer.step_idx % ckpt_every == 0:
            trainer.save(ckpt_dir)
            sync_point()
            dist.barrier()
            resume_point()
    trainer.save(ckpt_dir)
    eval_loss = trainer.evaluate()
    saved = None
    if save_dir:
        saved = save_full(trainer.model, save_dir, rank=rank)
    return {
        "rank": rank,
        "partition": part.describe(),
        "profile": prof["ranks"][rank],
        "resumed_from": resumed_from,
        "losses": losses,
        "step_s": times,
        "train_s": time.perf_counter() - t0,
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50)),
        "saved": None if saved is None else str(saved),
    }


def saved_partition(ckpt_dir, rank: int, shape, world: int) -> Partition | None:
    """The partition a checkpoint in ``ckpt_dir`` was written with (None if there is none or it does not fit)."""
    path = Path(ckpt_dir) / f"rank{rank}.pt"
    if not path.exists():
        return None
    meta = torch.load(path, map_location="cpu", weights_only=False).get("partition")
    if not meta or len(meta["kv_heads"]) != world:
        raise PartitionError(
            f"checkpoint {path} was written by {len(meta['kv_heads']) if meta else '?'} ranks, not {world}"
        )
    return Partition(shape, tuple(meta["kv_heads"]), tuple(c // shape.mlp_block for c in meta["mlp_columns"]))


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
    cfg.validate()
    if mode not in ("xronos", "tp"):
        raise ValueError(f"mode must be 'xronos' or 'tp', not {mode!r}")
    shape = cfg.shape()
    if shape.attn_units < len(speeds):
        raise PartitionError(
            f"the model's {shape.num_heads} heads in {shape.num_kv_heads} KV groups cannot be split across "
            f"{len(speeds)} ranks"
        )
    ckpt = Path(ckpt_dir) if ckpt_dir else cache_dir() / f"{cfg.family}-{mode}-{len(speeds)}r-seed{cfg.seed}"
    ckpt.mkdir(parents=True, exist_ok=True)
    return spawn(
        _finetune_worker,
        len(speeds),
        (cfg.to_dict(), mode, str(ckpt), ckpt_every, None if save_dir is None else str(save_dir), memory_bytes),
        speeds=speeds,
        timeout_s=timeout_s,
        pg_timeout_s=300,
        emulate=emulate,
    )
