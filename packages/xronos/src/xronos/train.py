"""Fine-tuning loops: tensor parallel (Xronos or even shards), GPipe pipeline, single-process reference.

All three take the same :class:`TrainConfig`, the same model initialisation (fixed seed), the same
batches and the same AdamW/clipping, so their losses are comparable and their step times can be
measured side by side. Per step each returns the loss, its wall time and the seconds it spent in
collectives or point-to-point transfers (waiting for peers included).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hwtopo
from hwtopo import resume_point, sync_point

from .data import ByteCorpus, load_text
from .layers import COMM, all_reduce, clip_grad_norm, grad_square_sum, scale_grads, sync_partial_grads
from .partition import ModelShape, Partition, PartitionError, even_partition
from .shard import build_model, check_partition, enable_lora, lm_loss, shard_model, tiny_config

__all__ = [
    "CheckpointError",
    "TrainConfig",
    "TPTrainer",
    "PPTrainer",
    "split_layers",
    "make_corpus",
    "make_optimizer",
    "read_checkpoint",
]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from (not xronos's, unsafe to unpickle, or unreadable)."""


@dataclass
class TrainConfig:
    """Model, data and optimiser settings shared by every variant."""

    family: str = "llama"
    hidden: int = 256
    layers: int = 4
    heads: int = 16  # head_dim 16; with 16 KV heads (multi-head attention, as Llama-2) one head is a unit
    kv_heads: int = 16
    intermediate: int = 1024
    mlp_block: int = 8  # MLP columns per partition unit (finer blocks balance closer)
    seq_len: int = 128
    batch: int = 8
    micro_batches: int = 4
    steps: int = 20
    lr: float = 3e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    lora_r: int = 0
    lora_alpha: float = 16.0
    seed: int = 0
    eval_batches: int = 4
    data: str | None = None
    max_bytes: int = 2_000_000
    vocab_parallel: str = "head"  # "none" (replicated embedding/LM head), "head" or "both" (split by vocabulary)

    def validate(self) -> None:
        positive = (
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "intermediate",
            "mlp_block",
            "seq_len",
            "batch",
            "micro_batches",
            "eval_batches",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, not {getattr(self, name)!r}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, not {self.steps}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.batch % self.micro_batches:
            raise ValueError(f"batch ({self.batch}) must be a multiple of micro_batches ({self.micro_batches})")
        if not (self.lr > 0 and self.clip > 0):
            raise ValueError("lr and clip must be > 0")
        if self.vocab_parallel not in ("none", "head", "both"):
            raise ValueError(f"vocab_parallel must be 'none', 'head' or 'both', not {self.vocab_parallel!r}")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0 (0 = full fine-tuning), not {self.lora_r}")

    def model_config(self):
        return tiny_config(
            self.family,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=max(1024, self.seq_len),
        )

    def shape(self) -> ModelShape:
        return ModelShape.from_config(self.model_config(), mlp_block=self.mlp_block)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``params``; the multi-tensor ("foreach") update, whose per-step overhead does not grow
    with the number of parameter tensors (on CPU torch would otherwise loop over them in Python)."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)


def make_corpus(cfg: TrainConfig) -> ByteCorpus:
    return ByteCorpus(load_text(cfg.data, cfg.max_bytes), cfg.seq_len, cfg.seed)


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _atomic_save(obj, path: Path) -> None:
    """Write ``obj`` to ``path`` whole or not at all, and on disk before a commit marker can name it."""
    with hwtopo.atomic_file(path, "wb") as f:
        torch.save(obj, f)


_CHECKPOINT_KEYS = ("model", "opt", "step", "partition", "config")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A rank's checkpoint, loaded with ``weights_only=True``: tensors and plain containers only, so a
    crafted file in a user's checkpoint directory cannot run code when it is read."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain values, which xronos does not "
            "unpickle (that could run code); it was not written by xronos: delete it or use another --ckpt-dir"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e}); delete it or use another --ckpt-dir") from e
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not an xronos checkpoint: it has no {', '.join(missing)}")
    return state


class TPTrainer:
    """Tensor-parallel fine-tuning of one rank's shard (``part``), or the unsharded reference (``part=None``)."""

    def __init__(self, cfg: TrainConfig, part: Partition | None, rank: int = 0, group=None, corpus=None, model=None):
        """``model``: an already sharded model (e.g. :func:`xronos.pretrained.load_sharded`) to train
        instead of building ``cfg``'s; its own config is then checked against ``part``."""
        config = None if model is None else model.config
        self.validate(cfg, part, rank, group, config)  # every input error before the model is built
        self.cfg, self.part, self.rank, self.group = cfg, part, rank, group
        self.corpus = corpus or make_corpus(cfg)
        if model is None:
            model = build_model(cfg.model_config(), cfg.seed)
            if part is not None:
                shard_model(model, part, rank, group, cfg.vocab_parallel)
        if cfg.lora_r:
            params = enable_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.seed)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        self.model, self.params = model, params
        self.opt = make_optimizer(params, cfg)
        self.step_idx = 0

    @staticmethod
    def validate(cfg: TrainConfig, part: Partition | None, rank: int = 0, group=None, config=None) -> None:
        """Raise one clear error if ``cfg``/``part`` cannot train on this rank and group (nothing built yet);
        ``config``: the model's transformers config when it is not ``cfg``'s."""
        cfg.validate()
        if cfg.lora_r and part is None:  # the reference gets the same adapters through a one-rank "partition"
            raise ValueError("the LoRA reference needs a one-rank partition; pass even_partition(shape, 1)")
        if part is None:
            return
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        check_partition(config or cfg.model_config(), part, world)
        if not 0 <= rank < world:
            raise PartitionError(f"rank {rank} is outside the world of {world} ranks")

    def step(self) -> dict:
        """One optimiser step on batch ``step_idx``; returns loss, wall seconds, collective seconds."""
        ids = self.corpus.batch(self.step_idx, self.cfg.batch)
        COMM.reset()
        sync_point()  # emulated dilation of untimed work before this step is paid outside it
        t0 = time.perf_counter()
        self.model.train()
        logits = self.model(input_ids=ids).logits
        loss = lm_loss(self.model, logits, ids)
        loss.backward()
        if self.part is not None:
            sync_partial_grads(self.model, self.group)
            norm = clip_grad_norm(self.params, self.cfg.clip, self.group)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync_point()  # the step's last compute (optimizer) dilated inside the timed step
        t1 = time.perf_counter()
        self.step_idx += 1
        return {
            "loss": loss.item(),
            "step_s": t1 - t0,
            "comm_s": COMM.seconds,
            "grad_norm": norm,
            "t0": t0,
            "t1": t1,
            "syncs": list(COMM.syncs),
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [
            lm_loss(self.model, self.model(input_ids=b).logits, b).item()
            for b in self.corpus.eval_batches(self.cfg.eval_batches, self.cfg.batch)
        ]
        return sum(losses) / len(losses)

    def checkpoint_path(self, directory: str | os.PathLike) -> Path:
        return Path(directory) / f"rank{self.rank}.pt"

    def save(self, directory: str | os.PathLike) -> Path:
        """This rank's shard, optimiser state and step, written atomically as ``directory/rank<r>.pt``
        (plain values and tensors only, so that :func:`read_checkpoint` loads it without pickle)."""
        path = self.checkpoint_path(directory)
        part = None if self.part is None else self.part.describe()
        _atomic_save(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "step": self.step_idx,
                "partition": part,
                "config": self.cfg.to_dict(),
            },
            path,
        )
        return path

    def load(self, directory: str | os.PathLike) -> bool:
        """Resume from this rank's checkpoint in ``directory`` if there is one; False when none exists."""
        path = self.checkpoint_path(directory)
        if not path.exists():
            return False
        state = read_checkpoint(path)
        part = None if self.part is None else self.part.describe()
        if state["partition"] is not None and part is not None:
            saved = {k: state["partition"][k] for k in ("q_heads", "kv_heads", "mlp_columns")}
            now = {k: part[k] for k in saved}
            if saved != now:
                raise ValueError(f"checkpoint {path} was saved with partition {saved}, not the current {now}")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step_idx = state["step"]
        return True


def split_layers(num_layers: int, speeds: list[float]) -> list[int]:
    """Layers per pipeline stage proportional to speed (largest remainder, at least one each)."""
    n = len(speeds)
    if num_layers < n:
        raise ValueError(f"{num_layers} layers cannot make {n} pipeline stages")
    raw = [num_layers * s / sum(speeds) for s in speeds]
    counts = [max(1, math.floor(r)) for r in raw]
    while sum(counts) > num_layers:
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - raw[i])
        counts[i] -= 1
    while sum(counts) < num_layers:
        i = max(range(n), key=lambda i: raw[i] - counts[i])
        counts[i] += 1
    return counts


def clip_stage_grads(params: list, max_norm: float, group=None) -> float:
    """Clip a pipeline stage's gradients by the global norm over all stages (each holds its own
    parameters: squares summed over the group); returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = grad_square_sum(grads)
    all_reduce(sq, group, tag="clip")
    total = float(sq.sqrt())
    scale_grads(grads, total, max_norm)
    return total


class PPTrainer:
    """GPipe-style pipeline stage: all micro-batches forward, then all backward, over send/recv.

    With ``cfg.lora_r`` the stage fine-tunes LoRA adapters on its layers' projections, initialised
    exactly as the tensor-parallel and single-process runs initialise theirs (the whole model gets
    the adapters of a one-rank partition, then the stage keeps its layers'), so every variant runs
    the same fine-tune. That needs ``local_group``, a process group holding only this rank (made here,
    collectively on every rank, when not given).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        speeds: list[float],
        rank: int,
        world: int,
        group=None,
        corpus=None,
        local_group=None,
    ):
        cfg.validate()
        if len(speeds) != world:
            raise ValueError(f"speeds lists {len(speeds)} ranks but the pipeline has {world} stages")
        self.counts = split_layers(cfg.layers, speeds)  # raises before anything is built
        self.cfg, self.rank, self.world, self.group = cfg, rank, world, group
        self.corpus = corpus or make_corpus(cfg)
        start = sum(self.counts[:rank])
        full = build_model(cfg.model_config(), cfg.seed)
        if cfg.lora_r:
            if local_group is None and dist.is_available() and dist.is_initialized():
                local_group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
            shard_model(full, even_partition(cfg.shape(), 1), 0, local_group)
            lora = enable_lora(full, cfg.lora_r, cfg.lora_alpha, cfg.seed)
        base = full.model
        self.first, self.last = rank == 0, rank == world - 1
        self.embed = base.embed_tokens if self.first else None
        self.layers = torch.nn.ModuleList(base.layers[start : start + self.counts[rank]])
        self.norm = base.norm if self.last else None
        self.head = full.lm_head if self.last else None
        self.rotary = base.rotary_emb
        mods = [m for m in (self.embed, self.layers, self.norm, self.head) if m is not None]
        self.params = [p for m in mods for p in m.parameters()]
        if cfg.lora_r:  # this stage's adapters; everything else stays frozen
            mine = {id(p) for p in self.params}
            self.params = [p for p in lora if id(p) in mine]
        self.opt = make_optimizer(self.params, cfg)
        self.step_idx = 0

    @staticmethod
    def _p2p(fn, t, peer):
        sync_point()  # emulated slow compute is paid before the transfer, as at a TP collective
        t0 = time.perf_counter()
        fn(t, peer)
        COMM.record("send" if fn is dist.send else "recv", peer, t0, time.perf_counter(), t.numel() * 4, "pp")
        resume_point()

    def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(self.cfg.seq_len).unsqueeze(0)
        pe = self.rotary(x, position_ids=pos)
        for layer in self.layers:  # attention_mask=None: sdpa applies the causal mask itself
            x = layer(x, attention_mask=None, position_embeddings=pe, position_ids=pos)
        return x

    def _forward_all(self, ids: torch.Tensor, keep_graph: bool):
        mb = ids.chunk(self.cfg.micro_batches)
        shape = (mb[0].shape[0], self.cfg.seq_len, self.cfg.hidden)
        saved, losses = [], []
        for m in mb:
            if self.embed is not None:  # the first stage
                inp = self.embed(m)
            else:
                inp = torch.empty(shape)
                self._p2p(dist.recv, inp, self.rank - 1)
                inp.requires_grad_(keep_graph)
            out = self._stage_forward(inp)
            if self.head is not None and self.norm is not None:  # the last stage
                losses.append(_lm_loss(self.head(self.norm(out)), m) / len(mb))
            else:
                self._p2p(dist.send, out.detach().contiguous(), self.rank + 1)
            saved.append((inp, out))
        return saved, losses, shape

    def step(self) -> dict:
        ids = self.corpus.batch(self.step_idx, self.cfg.batch)
        COMM.reset()
        sync_point()
        t0 = time.perf_counter()
        saved, losses, shape = self._forward_all(ids, True)
        for i in reversed(range(len(saved))):
            inp, out = saved[i]
            if self.last:
                losses[i].backward()
            else:
                grad = torch.empty(shape)
                self._p2p(dist.recv, grad, self.rank + 1)
                out.backward(grad)
            if not self.first:
                self._p2p(dist.send, inp.grad.contiguous(), self.rank - 1)
        total = clip_stage_grads(self.params, self.cfg.clip, self.group)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync_point()
        t1 = time.perf_counter()
        loss = torch.tensor(sum(x.item() for x in losses) if self.last else 0.0, dtype=torch.float64)
        dist.all_reduce(loss, group=self.group)  # reporting only, after the timed step
        self.step_idx += 1
        return {
            "loss": float(loss),
            "step_s": t1 - t0,
            "comm_s": COMM.seconds,
            "grad_norm": total,
            "t0": t0,
            "t1": t1,
            "syncs": list(COMM.syncs),
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        total = 0.0
        batches = self.corpus.eval_batches(self.cfg.eval_batches, self.cfg.batch)
        for b in batches:
            _, losses, _ = self._forward_all(b, False)
            total += sum(x.item() for x in losses)
        t = torch.tensor(total / len(batches) if self.last else 0.0, dtype=torch.float64)
        sync_point()
        dist.all_reduce(t, group=self.group)
        resume_point()
        return float(t)
