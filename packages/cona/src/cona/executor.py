"""One training step of a Llama-family causal LM under any dp x tp x pp strategy.

Rank = d * (pp * tp) + p * tp + t. Tensor parallelism is Megatron's: q/k/v and gate/up column-split (whole heads
per rank), o/down row-split with an all-reduce of their output, block inputs through an identity whose backward
all-reduces. Pipeline stages are contiguous layers (embedding first, norm + head last) run GPipe-style over
send/recv; data parallelism averages gradients with one flat all-reduce. AdamW is elementwise, so its sharded
state is exact. ``full_state()`` assembles the full tensors (weights, Adam moments, step) on every rank with
one all-reduce to which each element comes from one rank, and ``Executor(..., state)`` slices them for any
strategy: exact resharding, in memory or through ``save_state``/``load_state`` (safetensors).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hwtopo

from . import dist as cdist
from .space import ModelDims, Strategy, check_strategy

__all__ = ["Executor", "StepResult", "shard_dim", "save_state", "load_state", "initial_state", "FullState"]

_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_ROW = ("o_proj.weight", "down_proj.weight")
_KINDS = ("param", "exp_avg", "exp_avg_sq")
V_FLOOR = 0.01  # preconditioned gradient statistics: v floored at this fraction of its tensor's mean


def shard_dim(name: str) -> int | None:
    """The dimension a tensor is split along under tensor parallelism (None: replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


@dataclass
class FullState:
    """Layout-independent training state: full tensors by transformers name, per kind, and the step."""

    tensors: dict[str, dict[str, torch.Tensor]]  # kind -> name -> tensor
    step: int

    def equal(self, other: FullState) -> bool:
        return self.step == other.step and all(
            torch.equal(self.tensors[k][n], other.tensors[k][n]) for k in _KINDS for n in self.tensors["param"]
        )


def initial_state(config, seed: int = 0) -> FullState:
    """The state before step 0: a fresh model's weights and zero Adam moments."""
    from .model import build_model

    sd = {n: p.detach().clone() for n, p in build_model(config, seed).named_parameters()}
    zeros = {n: torch.zeros_like(t) for n, t in sd.items()}
    return FullState({"param": sd, "exp_avg": zeros, "exp_avg_sq": {n: z.clone() for n, z in zeros.items()}}, 0)


def save_state(path: str | os.PathLike, state: FullState, meta: dict | None = None) -> None:
    """Write a layout-independent checkpoint atomically (safetensors, flat keys 'kind/name')."""
    from safetensors.torch import save

    flat = {f"{k}/{n}": t.contiguous() for k in _KINDS for n, t in state.tensors[k].items()}
    hwtopo.atomic_write_bytes(path, save(flat, metadata={"step": str(state.step), "meta": json.dumps(meta or {})}))


def load_state(path: str | os.PathLike) -> FullState:
    from safetensors import safe_open

    tensors: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}
    with safe_open(str(path), framework="pt") as f:
        step = int(f.metadata()["step"])
        for key in f.keys():
            kind, name = key.split("/", 1)
            tensors[kind][name] = f.get_tensor(key)
    return FullState(tensors, step)


def _all_reduced(x: torch.Tensor, group) -> torch.Tensor:
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduced(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


@dataclass
class StepResult:
    loss: float
    sq_small: float  # |g_b|^2 of one micro-batch gradient (mean over dp replicas)
    b_small: int
    sq_big: float  # |g_B|^2 of the global gradient
    b_big: int
    compute_s: float
    gns_s: float
    grad_norm: float | None = None  # global L2 norm of the whole (unsharded) gradient, before clipping
    clip_coef: float = 1.0  # the factor the gradients were scaled by (1.0: not clipped)


class Executor:
    """Holds this rank's shard of model + AdamW state for one strategy and runs training steps."""

    def __init__(
        self,
        strategy: Strategy,
        config,
        state: FullState,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        clip_norm: float | None = None,
        precondition: bool = False,
    ) -> None:
        from .model import model_skeleton

        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 (or None for no clipping), got {clip_norm}")
        self.clip_norm = clip_norm
        # gradient statistics in Adam's metric g / (sqrt(v_hat) + eps) (Pollux's preconditioned noise scale);
        # before the first optimizer step v_hat comes from ``fold_second_moment``
        self.precondition = precondition
        self._eps, self._beta2 = eps, betas[1]
        self._v0: dict[nn.Parameter, torch.Tensor] = {}
        self._v0_n = 0
        self._pre_bufs: list[torch.Tensor] | None = None  # preconditioner and scratch, allocated once
        self._gns_scratch: list[torch.Tensor] = []

        self.device = cdist.current_device()  # cuda:LOCAL_RANK under NCCL, else the CPU
        check_strategy(strategy, ModelDims.from_config(config, 1), dist.get_world_size())
        self.s, self.config = strategy, config
        self._place(dist.get_rank())
        full = model_skeleton(config)
        model = full.model
        self.rotary = type(model.rotary_emb)(config).to(self.device)
        self.embed = model.embed_tokens if self.first else None
        self.layers = nn.ModuleList([model.layers[i] for i in range(self.lo, self.hi)])
        self.norm = model.norm if self.last else None
        self.lm_head = full.lm_head if self.last else None
        keep = [f"model.layers.{i}." for i in range(self.lo, self.hi)]
        if self.first:
            keep.append("model.embed_tokens.")
        if self.last:
            keep += ["model.norm.", "lm_head."]
        self.full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
        modules = dict(full.named_modules())
        self.params: dict[str, nn.Parameter] = {}
        for n in (n for n in self.full_shapes if n.startswith(tuple(keep))):  # this rank's shards of the state
            mod_name, attr = n.rsplit(".", 1)
            self.params[n] = nn.Parameter(self._slice(n, state.tensors["param"][n]).to(self.device, copy=True))
            setattr(modules[mod_name], attr, self.params[n])
        if strategy.tp > 1:
            self._install_tp_hooks()
        self.opt = torch.optim.AdamW(
            list(self.params.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.step = state.step
        if state.step > 0:  # Adam's moments, sliced like the weights
            for n, p in self.params.items():
                moments = {k: self._slice(n, state.tensors[k][n]).to(self.device, copy=True) for k in _KINDS[1:]}
                self.opt.state[p] = {"step": torch.tensor(float(state.step))} | moments
        self.owned = [p for n, p in self.params.items() if shard_dim(n) is not None or self.t == 0]

    def _place(self, rank: int) -> None:
        """This rank's coordinates (d, p, t), its process groups, pipeline neighbours and stage layers."""
        dp, tp, pp = self.s.dp, self.s.tp, self.s.pp
        self.rank = rank
        self.d, rem = divmod(rank, pp * tp)
        self.p, self.t = divmod(rem, tp)
        self.first, self.last = self.p == 0, self.p == pp - 1
        # groups: every rank creates every group in the same order
        tp_groups = {(d, p): tuple(d * pp * tp + p * tp + t for t in range(tp)) for d in range(dp) for p in range(pp)}
        dp_groups = {(p, t): tuple(d * pp * tp + p * tp + t for d in range(dp)) for p in range(pp) for t in range(tp)}
        for ranks in list(tp_groups.values()) + list(dp_groups.values()):
            if 1 < len(ranks):
                cdist.group(ranks)
        self.tp_group = cdist.group(tp_groups[self.d, self.p]) if tp > 1 else None
        self.dp_group = cdist.group(dp_groups[self.p, self.t]) if dp > 1 else None
        self.prev_rank = rank - tp if not self.first else None
        self.next_rank = rank + tp if not self.last else None
        layers = self.config.num_hidden_layers
        bounds = [round(i * layers / pp) for i in range(pp + 1)]
        self.lo, self.hi = bounds[self.p], bounds[self.p + 1]

    def same_layout(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` has this executor's dp x tp x pp (it splits a step's samples otherwise, no state)."""
        return (strategy.dp, strategy.tp, strategy.pp) == (self.s.dp, self.s.tp, self.s.pp)

    def retarget(self, strategy: Strategy) -> Executor:
        """Switch to ``strategy`` in place when it has this executor's layout: exact, no state moves. Another
        layout needs ``Executor(strategy, config, self.full_state())`` (resharding)."""
        if not self.same_layout(strategy):
            raise ValueError(
                f"retarget needs the same dp x tp x pp layout: {strategy.name} is not that of "
                f"{self.s.name}; reshard through full_state() instead"
            )
        check_strategy(strategy, ModelDims.from_config(self.config, 1), dist.get_world_size())
        self.s = strategy
        return self

    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = shard_dim(name)
        if dim is None or self.s.tp == 1:
            return full
        n = full.shape[dim] // self.s.tp
        return full.narrow(dim, self.t * n, n)

    def _install_tp_hooks(self) -> None:
        g = self.tp_group

        def copy_kw(module, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = _CopyToTP.apply(kwargs["hidden_states"], g)
                return args, kwargs
            return (_CopyToTP.apply(args[0], g), *args[1:]), kwargs

        def reduce_out(module, args, out):
            return _ReduceFromTP.apply(out, g)

        for layer in self.layers:
            layer.get_submodule("self_attn").register_forward_pre_hook(copy_kw, with_kwargs=True)
            layer.get_submodule("mlp").register_forward_pre_hook(copy_kw, with_kwargs=True)
            layer.get_submodule("self_attn.o_proj").register_forward_hook(reduce_out)
            layer.get_submodule("mlp.down_proj").register_forward_hook(reduce_out)

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # the embedding is built for the first stage only
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.last:
            assert self.lm_head is not None and self.norm is not None  # built for the last stage
            return self.lm_head(self.norm(h))
        return h

    @staticmethod
    def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    def _local_micro_batches(self, batch: torch.Tensor) -> list[torch.Tensor]:
        s = self.s
        if batch.shape[0] != s.global_batch:
            raise ValueError(f"batch has {batch.shape[0]} samples but {s.name} needs global_batch={s.global_batch}")
        per = s.global_batch // s.dp
        mine = batch[self.d * per : (self.d + 1) * per].to(self.device)
        return list(mine.split(s.micro_batch))

    def fold_second_moment(self) -> None:
        """Add the current (averaged) gradient squared to the second-moment estimate that preconditions
        the gradient statistics until the optimizer has its own (its first step)."""
        for p in self.params.values():
            if p.grad is not None:
                sq = p.grad.detach().pow(2)
                self._v0[p] = self._v0[p].add_(sq) if p in self._v0 else sq
        self._v0_n += 1

    def _preconditioner(self) -> list[torch.Tensor] | None:
        """1 / (sqrt(v) + eps) of every owned parameter, or None (plain metric), into buffers allocated once and
        without a host sync. v is Adam's bias-corrected second moment (before the first step: the folded squared
        gradients), floored at ``V_FLOOR`` x its full tensor's mean (the same in every layout): a coordinate with
        no gradient history has v ~ 0, and 1/eps would let it swamp every norm."""
        if not self.precondition:
            return None
        vs: list[tuple[torch.Tensor, float]] = []  # (v or its running sum, divisor)
        for p in self.params.values():
            st = self.opt.state.get(p)
            if st and "exp_avg_sq" in st:
                vs.append((st["exp_avg_sq"], 1 - self._beta2 ** float(st["step"])))  # step lives on the CPU
            elif p in self._v0:
                vs.append((self._v0[p], float(self._v0_n)))
            else:
                return None
        if self._pre_bufs is None:
            names = list(self.params)
            sharded = [self.s.tp > 1 and shard_dim(n) is not None for n in names]
            # mean over the full tensor: a sharded tensor's local sum is all-reduced over tp; a replicated
            # one is summed tp times by that all-reduce, hence divided by tp first
            per = [(1 if sh else self.s.tp) * torch.Size(self.full_shapes[n]).numel() for n, sh in zip(names, sharded)]
            self._pre_per = torch.tensor(per, dtype=torch.float64, device=self.device)
            self._pre_bufs = [torch.empty_like(p) for p in self.owned]
            self._gns_scratch = [torch.empty_like(p) for p in self.owned]
            owned = {id(p) for p in self.owned}
            self._pre_owned = [i for i, p in enumerate(self.params.values()) if id(p) in owned]
        div = torch.tensor([d for _, d in vs], dtype=torch.float64, device=self.device)
        sums = torch.stack([v.sum() for v, _ in vs]).double() / (div * self._pre_per)  # per-element means / tp
        if self.tp_group is not None:
            dist.all_reduce(sums, group=self.tp_group)
        floors = (sums * V_FLOOR).float().unbind()
        bufs, own = self._pre_bufs, self._pre_owned
        torch._foreach_copy_(bufs, [vs[i][0] for i in own])
        torch._foreach_div_(bufs, [vs[i][1] for i in own])
        torch._foreach_maximum_(bufs, [floors[i] for i in own])  # the floor: clamp(min=...)
        torch._foreach_sqrt_(bufs)
        torch._foreach_add_(bufs, self._eps)
        torch._foreach_reciprocal_(bufs)
        return bufs

    def _sq_norm(self, scale: float = 1.0, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Squared norm of the owned gradients (times ``scale``) in the metric ``weights``, a float64 scalar left on
        the device: a host sync mid-backward would stall the pipeline on a GPU."""
        have = [k for k, p in enumerate(self.owned) if p.grad is not None]
        grads = [g for g in (p.grad for p in self.owned) if g is not None]
        if weights is not None and grads:
            scratch = [self._gns_scratch[k] for k in have]
            torch._foreach_copy_(scratch, grads)
            torch._foreach_mul_(scratch, [weights[k] for k in have])
            grads = scratch
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum() * (scale * scale)

    def _input(self, ids: torch.Tensor) -> torch.Tensor:
        """This stage's input: the token ids on the first stage, else the activations the previous one sends."""
        if self.first:
            return ids
        x = torch.empty((*ids.shape, self.config.hidden_size), device=self.device)
        dist.recv(x, src=self.prev_rank)
        return x

    def _forward_backward(
        self, mbs: list[torch.Tensor], want_small: bool, weights=None
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Run all micro-batches; returns (sum of scaled losses, |first micro-batch grad|^2, gns seconds)."""
        accum = len(mbs)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        loss_sum, sq_small, gns_s = zero, zero, 0.0  # device tensors: read once, after the step's reduction

        def small() -> None:  # the first micro-batch's squared gradient norm, timed as statistics
            nonlocal sq_small, gns_s
            t0 = time.perf_counter()
            sq_small = self._sq_norm(accum, weights)
            gns_s += time.perf_counter() - t0

        if self.s.pp == 1:
            for k, ids in enumerate(mbs):
                loss = self._ce(self._stage(ids), ids) / accum
                loss.backward()
                loss_sum = loss_sum + loss.detach()
                if k == 0 and want_small:
                    small()
            return loss_sum, sq_small, gns_s
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for ids in mbs:  # GPipe: all forwards, then all backwards
            inp = self._input(ids)
            if not self.first:
                inp.requires_grad_(True)
            out = self._stage(inp)
            if self.last:
                out = self._ce(out, ids) / accum
                loss_sum = loss_sum + out.detach()
            else:
                dist.send(out.detach().contiguous(), dst=self.next_rank)
            saved.append((inp, out))
        for k in reversed(range(accum)):
            inp, out = saved.pop()  # saved[k]; popped so its activations free as the backward goes
            if self.last:
                out.backward()
            else:
                g = torch.empty_like(out)
                dist.recv(g, src=self.next_rank)
                out.backward(g)
            if not self.first:
                assert inp.grad is not None  # a later stage's input requires grad and fed this backward
                dist.send(inp.grad.contiguous(), dst=self.prev_rank)
            if k == accum - 1 and want_small:
                small()
        return loss_sum, sq_small, gns_s

    def _grads_zero(self) -> None:
        for p in self.params.values():
            p.grad = None

    def _all_grads(self) -> list[torch.Tensor]:
        """This rank's gradients in ``params`` order; a backward gives every parameter one."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if len(grads) != len(self.params):
            raise RuntimeError("a parameter of this rank has no gradient: run compute_grads (a backward) first")
        return grads

    def _dp_allreduce(self) -> None:
        if self.dp_group is None:
            return
        grads = self._all_grads()
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.s.dp
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def compute_grads(self, batch: torch.Tensor, gns: bool = True) -> StepResult:
        """Forward + backward of one global batch, gradients averaged; no optimizer step."""
        s = self.s
        t0 = time.perf_counter()
        self._grads_zero()
        mbs = self._local_micro_batches(batch)
        if gns and s.dp * s.accum == 1 and s.micro_batch > 1:  # split the only micro-batch: a smaller gradient
            mbs = list(mbs[0].split((s.micro_batch + 1) // 2))
        want = gns and len(mbs) * s.dp > 1
        tw = time.perf_counter()
        weights = self._preconditioner() if want else None
        pre_s = time.perf_counter() - tw
        loss_sum, sq_small, gns_s = self._forward_backward(mbs, want, weights)
        gns_s += pre_s
        self._dp_allreduce()
        t1 = time.perf_counter()
        # |G_B|^2: each rank's owned elements, summed over the world and divided by the dp identical replicas
        need_norm = want or self.clip_norm is not None
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        plain = self._sq_norm() if need_norm else zero
        big = self._sq_norm(1.0, weights) if weights is not None else plain
        if want:
            gns_s += time.perf_counter() - t1
        loss_part = loss_sum if (self.last and self.t == 0) else zero
        red = torch.stack([loss_part, sq_small, big, plain])  # the step's one host read, after this
        dist.all_reduce(red)
        loss, sq_small_t, sq_big_t, sq_plain = (red / s.dp).tolist()
        norm = sq_plain**0.5 if need_norm else None
        coef = self._clip(norm)
        compute_s = time.perf_counter() - t0 - gns_s
        b_small = mbs[0].shape[0] if want else s.micro_batch
        return StepResult(
            loss, sq_small_t, b_small, sq_big_t if want else 0.0, s.global_batch, compute_s, gns_s, norm, coef
        )

    def micro_batch_stats(self, batches: Sequence[torch.Tensor]) -> tuple[int, list[float], list[float], float]:
        """(b, |g_k|^2, g_k . S, |S|^2) over every micro-batch gradient g_k of ``batches`` on every replica, S their
        mean, in the statistics' metric, at the current weights and without a step (``gns.micro_batch_pairs``'
        input). Every rank must call it; it keeps one gradient per micro-batch, a one-off for step 0."""
        s = self.s
        weights = self._preconditioner()
        kept: list[list[torch.Tensor]] = []  # per local micro-batch: this rank's gradients, in ``params`` order
        for batch in batches:
            for ids in self._local_micro_batches(batch):
                self._grads_zero()
                self._forward_backward([ids], False)
                kept.append(self._all_grads())
        for p, gs in zip(self.params.values(), zip(*kept)):
            p.grad = torch.stack(gs).mean(0)
        self._dp_allreduce()  # S on every replica
        pos = {id(p): i for i, p in enumerate(self.params.values())}
        where = [(pos[id(p)], 1.0 if weights is None else weights[j] ** 2) for j, p in enumerate(self.owned)]
        mean = self._all_grads()

        def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return sum(((a[i] * w * b[i]).sum(dtype=torch.float64) for i, w in where), zero)

        n, k_all = len(kept), len(kept) * s.dp
        vec = torch.zeros(2 * k_all + 1, dtype=torch.float64, device=self.device)
        for k, g in enumerate(kept):  # this replica's slots; its tp and pipeline ranks add their shards into them
            vec[self.d * n + k] = dot(g, g)
            vec[k_all + self.d * n + k] = dot(g, mean)
        vec[2 * k_all] = dot(mean, mean)
        dist.all_reduce(vec)
        vals = vec.tolist()
        self._grads_zero()  # the kept gradients and S are not a step's
        return s.micro_batch, vals[:k_all], vals[k_all : 2 * k_all], vals[2 * k_all] / s.dp

    def _clip(self, norm: float | None) -> float:
        """``torch.nn.utils.clip_grad_norm_`` on the unsharded model: every rank scales by the same factor."""
        if self.clip_norm is None or norm is None:
            return 1.0
        coef = self.clip_norm / (norm + 1e-6)
        if coef >= 1.0:
            return 1.0
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        torch._foreach_mul_(grads, coef)
        return coef

    def train_step(self, batch: torch.Tensor, lr: float | None = None, gns: bool = True) -> StepResult:
        """One optimizer step on ``batch`` (the whole global batch; each rank takes its part)."""
        res = self.compute_grads(batch, gns)
        t0 = time.perf_counter()
        self._optimizer_step(lr)
        res.compute_s += time.perf_counter() - t0
        return res

    def grads(self) -> list[torch.Tensor]:
        """Copies of this rank's gradients as ``compute_grads`` left them, to step with later (``step_with``)."""
        return [g.detach().clone() for g in self._all_grads()]

    def step_with(self, grads: Sequence[torch.Tensor], lr: float | None = None) -> None:
        """The optimizer step ``train_step`` would have taken with ``grads`` (this executor's ``grads()``)."""
        params = list(self.params.values())
        if len(grads) != len(params) or any(g.shape != p.shape for g, p in zip(grads, params)):
            raise ValueError("grads must be this executor's own, one per parameter shard in order (from grads())")
        for p, g in zip(params, grads):
            p.grad = g
        self._optimizer_step(lr)
        self._grads_zero()

    def _optimizer_step(self, lr: float | None) -> None:
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # step times are read on the host right after
        self.step += 1

    @torch.no_grad()
    def evaluate(self, ids: torch.Tensor, micro_batch: int = 32) -> float:
        """Mean next-token loss over ``ids`` (split across dp replicas); the same value on every rank."""
        s = self.s
        if ids.shape[0] % s.dp:
            raise ValueError(f"validation set of {ids.shape[0]} samples does not split over dp={s.dp}")
        per = ids.shape[0] // s.dp
        mine = ids[self.d * per : (self.d + 1) * per].to(self.device)
        total = 0.0
        for mb in mine.split(micro_batch):
            out = self._stage(self._input(mb))
            if self.last:
                total += float(self._ce(out, mb)) * mb.shape[0]
            else:
                dist.send(out.contiguous(), dst=self.next_rank)
        part = total if (self.last and self.t == 0) else 0.0
        red = torch.tensor([part], dtype=torch.float64, device=self.device)
        dist.all_reduce(red)
        return float(red[0]) / ids.shape[0]

    def _gather(self, pick) -> dict[str, torch.Tensor]:
        """Full tensors on every rank: each element comes from exactly one rank (dp replica 0)."""
        sizes = {n: int(torch.Size(shape).numel()) for n, shape in self.full_shapes.items()}
        off = dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0)))
        flat = torch.zeros(sum(sizes.values()), device=self.device)
        if self.d == 0:
            for n, p in self.params.items():
                t = pick(n, p)
                if t is None:
                    continue
                view = flat[off[n] : off[n] + sizes[n]].view(self.full_shapes[n])
                dim = shard_dim(n)
                if dim is None or self.s.tp == 1:
                    if self.t == 0:
                        view.copy_(t)
                else:
                    w = t.shape[dim]
                    view.narrow(dim, self.t * w, w).copy_(t)
        dist.all_reduce(flat)
        flat = flat.cpu()  # the layout-independent state lives on the CPU
        return {n: flat[off[n] : off[n] + k].view(self.full_shapes[n]).clone() for n, k in sizes.items()}

    def full_state(self) -> FullState:
        """The layout-independent state, assembled on every rank (exact)."""
        out = {"param": self._gather(lambda n, p: p.detach())}
        for kind in ("exp_avg", "exp_avg_sq"):
            out[kind] = self._gather(lambda n, p, kind=kind: self.opt.state.get(p, {}).get(kind))
        return FullState(out, self.step)

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._gather(lambda n, p: p.grad)
