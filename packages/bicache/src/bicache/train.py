"""Short CPU training recipe for the table task, with a checkpoint cached in the user cache dir.

Masked-diffusion SFT (as LLaDA's fine-tuning): the prompt is never masked; each answer token is
masked with probability ``t ~ U(0, 1)`` (at least one per sequence) and the loss is the
cross-entropy on the masked tokens. The checkpoint is keyed by the recipe, written atomically and
reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .model import DiffusionLM
from .task import TableTask, TaskSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the trained weights (and so the cache key)."""

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    attn_scalar: int = 4  # Gemma3 query_pre_attn_scalar (head_dim 16 would be the usual 1/sqrt(d))
    compose_init: bool = True  # table-token embeddings start as key + digit + slot embeddings
    steps: int = 6000  # at most; training stops early once ``target`` is reached
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    min_rows: int = 2  # curriculum: training tables start with this many filled rows ...
    curriculum_gate: float = 0.9  # ... and gain one each time a training-batch exact match reaches this
    target: float = 0.97  # held-out exact match (one parallel prediction), checked every ``eval_every``
    eval_every: int = 50
    spec: TaskSpec = TaskSpec()

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mlsyskit/bicache`` (or ``~/.cache/...``); ``BICACHE_CACHE_DIR`` overrides."""
    if os.environ.get("BICACHE_CACHE_DIR"):
        return Path(os.environ["BICACHE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlsyskit" / "bicache"


def compose_table_embeddings(dlm: DiffusionLM, seed: int = 0) -> None:
    """Initialise each table token ``k<key>.<slot>=<d>`` as ``E[k<key>] + E[<d>] + s_slot``.

    An initialisation, not a constraint (the embeddings train freely afterwards): it starts the
    lookup's attention match (the key part) and its copy (the digit part) as the same shared
    key/digit directions instead of 16 x 10 x slots unrelated random vectors each of which would
    have to be learnt from its own rare occurrences.
    """
    emb = dlm.model.get_input_embeddings().weight
    v, s = dlm.vocab, dlm.spec
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        slots = torch.randn(s.value_digits, emb.shape[1], generator=g) * emb.std()
        for k in range(s.n_keys):
            for j in range(s.value_digits):
                for d in range(10):
                    emb[v.keyed(k, j, d)] = emb[v.key0 + k] + emb[v.digit0 + d] + slots[j]


def masked_diffusion_loss(
    dlm: DiffusionLM, x: torch.Tensor, is_answer: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """Cross-entropy on randomly masked maskable tokens (ratio ~ U(0,1), at least one masked)."""
    b = x.shape[0]
    t = torch.rand(b, 1, generator=gen)
    masked = (torch.rand(x.shape, generator=gen) < t) & is_answer
    none = ~masked.any(1)
    if none.any():
        first = is_answer.float().argmax(1)
        masked[none, first[none]] = True
    inp = torch.where(masked, torch.full_like(x, dlm.mask_id), x)
    logits = dlm.model(input_ids=inp).logits
    return torch.nn.functional.cross_entropy(logits[masked], x[masked])


def batch_accuracy(dlm: DiffusionLM, task: TableTask, rows: int, n: int = 128) -> float:
    """Exact match of one parallel answer prediction on fresh training sequences with ``rows`` rows."""
    x, _ = task.training_batch(n, rows=rows)
    p = dlm.spec.prompt_length
    inp = x.clone()
    inp[:, p:] = dlm.mask_id
    was = dlm.model.training
    dlm.model.eval()
    with torch.no_grad():
        pred = dlm.model(input_ids=inp).logits[:, p:].argmax(-1)
    dlm.model.train(was)
    return float((pred == x[:, p:]).all(1).float().mean())


def heldout_accuracy(dlm: DiffusionLM, n: int = 128, seed: int = 99) -> float:
    """Exact match of one parallel prediction of the whole (masked) answer on held-out requests."""
    task = TableTask(dlm.spec, seed=seed)
    reqs = []
    for f in (0.25, 0.5, 0.75, 0.9):
        reqs += task.burst(n // 4, dlm.spec.shared_rows_for_fraction(f))
    x = torch.tensor([r.prompt + [dlm.mask_id] * dlm.spec.gen_length for r in reqs])
    ans = torch.tensor([r.answer for r in reqs])
    was = dlm.model.training
    dlm.model.eval()
    with torch.no_grad():
        pred = dlm.model(input_ids=x).logits[:, -dlm.spec.gen_length :].argmax(-1)
    dlm.model.train(was)
    return float((pred == ans).all(1).float().mean())


def train(recipe: Recipe = Recipe(), progress: bool = True, resume_dir: Path | None = None) -> DiffusionLM:
    """Train from scratch with ``recipe``; with ``resume_dir`` the run checkpoints there and resumes."""
    torch.manual_seed(recipe.seed)
    dlm = DiffusionLM.random(
        recipe.spec,
        seed=recipe.seed,
        layers=recipe.layers,
        hidden=recipe.hidden,
        heads=recipe.heads,
        attn_scalar=recipe.attn_scalar,
    )
    if recipe.compose_init:
        compose_table_embeddings(dlm, recipe.seed)
    model = dlm.model.train()
    task = TableTask(recipe.spec, seed=recipe.seed + 1)
    gen = torch.Generator().manual_seed(recipe.seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return (step + 1) / recipe.warmup
        p = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start = 0
    rows = min(recipe.min_rows, recipe.spec.rows) if recipe.curriculum_gate > 0 else recipe.spec.rows
    state_path = resume_dir / "train-state.pt" if resume_dir is not None else None
    if state_path is not None and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        gen.set_state(st["gen"])
        task.rng.setstate(st["rng"])
        start = st["step"]
        rows = st.get("rows", rows)
        log.info("resuming training at step %d", start)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=recipe.steps, initial=start, desc="train bicache DLM", unit="step")
    t0 = time.time()
    ema = None
    for step in range(start, recipe.steps):
        x, maskable = task.training_batch(recipe.batch, rows=rows)
        loss = masked_diffusion_loss(dlm, x, maskable, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}")
        if (step + 1) % recipe.eval_every == 0:
            if rows < recipe.spec.rows and batch_accuracy(dlm, task, rows) >= recipe.curriculum_gate:
                rows += 1
            acc = heldout_accuracy(dlm)
            log.info("step %d rows %d loss %.4f heldout %.3f (%.0fs)", step + 1, rows, ema, acc, time.time() - t0)
            if bar is not None:
                bar.set_postfix(loss=f"{ema:.3f}", heldout=f"{acc:.3f}")
            if state_path is not None:
                state_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = state_path.with_suffix(".tmp")
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "gen": gen.get_state(),
                        "rng": task.rng.getstate(),
                        "step": step + 1,
                        "rows": rows,
                    },
                    tmp,
                )
                os.replace(tmp, state_path)
            if acc >= recipe.target and rows >= recipe.spec.rows:
                break
    if bar is not None:
        bar.close()
    model.eval()
    return dlm


def load_or_train(recipe: Recipe = Recipe(), progress: bool = True, directory: Path | None = None) -> DiffusionLM:
    """The cached checkpoint for ``recipe`` if present, else train it and cache it (atomic)."""
    path = (directory or cache_dir()) / f"dlm-{recipe.key()}"
    if (path / "task.json").exists():
        log.info("loading cached checkpoint %s", path)
        return DiffusionLM.load(path)
    partial = path.with_name(path.name + ".partial")
    dlm = train(recipe, progress=progress, resume_dir=partial)
    dlm.save(path)
    import shutil

    shutil.rmtree(partial, ignore_errors=True)
    log.info("saved checkpoint %s", path)
    return dlm
