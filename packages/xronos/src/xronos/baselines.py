"""The field's own libraries as baselines: DTensor even TP and ``torch.distributed.pipelining``.

Both train the same model (same seed, same batches, same AdamW and clipping) as
:class:`xronos.train.TPTrainer`, and return the same per-step record, so the bench runs them
interleaved with Xronos in one process group.

- :class:`DTensorTPTrainer`: ``parallelize_module`` with the tuned plan a user would write: q/k/v and
  gate/up column-wise, o/down row-wise, each attention and MLP block's input prepared once as a
  replicated DTensor (one input-gradient all-reduce per block in backward, not one per projection),
  and the LM head split by vocabulary with ``loss_parallel`` (no gather of the logits).
- :class:`PipeliningTrainer`: one stage per rank (layers split in proportion to speed, as
  :class:`xronos.train.PPTrainer`), driven by the library's ``ScheduleGPipe`` or ``Schedule1F1B``.

Neither calls ``hwtopo.sync_point`` inside the library's collectives, so under dilation their
emulated compute is paid once at the end of each step; the bench's default emulation (a cgroup quota)
needs no synchronisation points.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hwtopo import resume_point, sync_point

from .shard import build_model
from .train import TrainConfig, clip_stage_grads, make_corpus, make_optimizer, split_layers

__all__ = ["DTensorTPTrainer", "PipeliningTrainer", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


def _record(loss: float, t0: float, t1: float, norm: float) -> dict:
    """The per-step record every trainer returns (no collective is timed inside the libraries)."""
    return {"loss": loss, "step_s": t1 - t0, "comm_s": 0.0, "grad_norm": norm, "t0": t0, "t1": t1, "syncs": []}


def _scalar(t: torch.Tensor) -> float:
    """A loss as a float, whether a DTensor (replicated after loss_parallel) or a plain tensor."""
    t = t.detach()
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping over DTensor and plain gradients, as ``clip_grad_norm_`` computes it.

    Per-tensor norms from one multi-tensor kernel per kind (a DTensor shard's norm is partial: the
    norm of the stacked norms reduces it across ranks in one collective); ``clip_grad_norm_`` itself
    cannot stack DTensor and plain norms together.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    kinds = [
        k for k in ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]) if k
    ]
    sq = 0.0
    for kind in kinds:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(kind)))
        sq += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    total = sq**0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for kind in kinds:
            torch._foreach_mul_(kind, coef)
    return total


class DTensorTPTrainer:
    """PyTorch's even tensor parallelism (DTensor), all ranks of the default group."""

    def __init__(self, cfg: TrainConfig, corpus=None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        if cfg.lora_r:
            raise ValueError("the DTensor baseline fine-tunes every weight; lora_r must be 0")
        cfg.validate()
        self.cfg, self.corpus = cfg, corpus or make_corpus(cfg)
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.model = build_model(cfg.model_config(), cfg.seed)
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(self.model, self.mesh, _tp_plan(cfg.layers))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        # foreach AdamW cannot mix DTensors and plain tensors in one list: one optimiser for each kind
        self.opts = [
            make_optimizer(group, cfg)
            for group in (
                [p for p in params if isinstance(p, DTensor)],
                [p for p in params if not isinstance(p, DTensor)],
            )
            if group
        ]
        self.step_idx = 0

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        logits = self.model(input_ids=ids).logits  # a DTensor split by vocabulary
        with loss_parallel():
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def step(self) -> dict:
        from torch.distributed.tensor.parallel import loss_parallel

        ids = self.corpus.batch(self.step_idx, self.cfg.batch)
        sync_point()
        t0 = time.perf_counter()
        self.model.train()
        loss = self._loss(ids)
        with loss_parallel():
            loss.backward()
        norm = _clip(self.params, self.cfg.clip)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync_point()
        t1 = time.perf_counter()
        resume_point()
        self.step_idx += 1
        return _record(_scalar(loss), t0, t1, norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [self._loss(b) for b in self.corpus.eval_batches(self.cfg.eval_batches, self.cfg.batch)]
        return sum(_scalar(x) for x in losses) / len(losses)


def _tp_plan(layers: int) -> dict:
    """The tuned DTensor plan: one replicated input per block, vocabulary-split head with loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan: dict = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        plan[pre + "self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
        plan[pre + "mlp"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[pre + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[pre + name] = RowwiseParallel()
    return plan


class _Stage(nn.Module):
    """One pipeline stage of the decoder: embedding on the first, norm and LM head on the last."""

    def __init__(self, full, start: int, count: int, first: bool, last: bool) -> None:
        super().__init__()
        base = full.model
        self.embed = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[start : start + count])
        self.norm = base.norm if last else None
        self.head = full.lm_head if last else None
        self.rotary = base.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        pe = self.rotary(x, position_ids=pos)
        for layer in self.layers:  # attention_mask=None: sdpa applies the causal mask itself
            x = layer(x, attention_mask=None, position_embeddings=pe, position_ids=pos)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x


def _stage_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


class PipeliningTrainer:
    """``torch.distributed.pipelining``: this rank's stage under ``schedule`` (gpipe or 1f1b)."""

    def __init__(self, cfg: TrainConfig, speeds: list[float], schedule: str, corpus=None) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if cfg.lora_r:
            raise ValueError("the torch.distributed.pipelining baseline fine-tunes every weight; lora_r must be 0")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        cfg.validate()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.counts = split_layers(cfg.layers, speeds)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.corpus = corpus or make_corpus(cfg)
        self.first, self.last = rank == 0, rank == world - 1
        full = build_model(cfg.model_config(), cfg.seed)
        self.stage_mod = _Stage(full, sum(self.counts[:rank]), self.counts[rank], self.first, self.last)
        stage = PipelineStage(self.stage_mod, rank, world, torch.device("cpu"))
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, cfg.micro_batches, loss_fn=_stage_loss)
        self.params = [p for p in self.stage_mod.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg)
        self.step_idx = 0

    def _run(self, ids: torch.Tensor, train: bool) -> float:
        """One pass of the schedule over ``ids``; the summed micro-batch losses (last stage), else 0."""
        losses: list[torch.Tensor] = []
        args = (ids,) if self.first else ()
        kwargs: dict[str, Any] = {"target": ids, "losses": losses} if self.last else {}
        if train:
            self.schedule.step(*args, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        return float(sum(x.item() for x in losses)) / self.cfg.micro_batches if self.last else 0.0

    def step(self) -> dict:
        ids = self.corpus.batch(self.step_idx, self.cfg.batch)
        sync_point()
        t0 = time.perf_counter()
        self.stage_mod.train()
        loss = self._run(ids, True)
        total = clip_stage_grads(self.params, self.cfg.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync_point()
        t1 = time.perf_counter()
        resume_point()
        shared = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(shared)  # reporting only, after the timed step
        self.step_idx += 1
        return _record(float(shared), t0, t1, total)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.stage_mod.eval()
        batches = self.corpus.eval_batches(self.cfg.eval_batches, self.cfg.batch)
        total = sum(self._run(b, False) for b in batches) / len(batches)
        t = torch.tensor(total, dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)
