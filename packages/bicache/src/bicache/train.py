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
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import hwtopo
from hwtopo import console

from . import kvcache
from .model import DiffusionLM
from .task import TableTask, TaskSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the trained weights (and so the cache key)."""

    arch: str = "gemma3"  # gemma3 | llama (LLaDA's shape) | qwen2 (Dream's): see model.tiny_config
    layers: int = 6
    hidden: int = 64
    heads: int = 4
    attn_scalar: int = 4  # Gemma3 query_pre_attn_scalar (head_dim 16 would be the usual 1/sqrt(d))
    local_layers: int = 4  # the first layers use Gemma3 sliding-window (local) attention ...
    window: int = 3  # ... of this bidirectional window (a token sees its neighbours up to 2 away)
    compose_init: bool = True  # table-token embeddings start as key + digit + slot embeddings
    steps: int = 20000  # cap; training stops early once ``target`` is reached with every row filled
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 200  # linear warmup, then constant until the curriculum reaches every row ...
    anneal: int = 1500  # ... then a cosine decay to 5% over this many steps
    seed: int = 0
    min_rows: int = 2  # curriculum: training tables start with this many filled rows ...
    curriculum_gate: float = 0.9  # ... and gain one each time a training-batch exact match reaches this
    mixed: bool = True  # each sequence draws its filled rows from [min_rows, level] (phases mixed, not staged)
    patience: int = 1000  # a level not passed in this many steps advances anyway (0: gate only)
    target: float = 0.97  # held-out exact match (one parallel prediction) to stop at once the anneal is done
    eval_every: int = 50
    val_requests: int = 256  # held-out requests of the early-stopping check
    spec: TaskSpec = TaskSpec()

    def key(self) -> str:
        fields = asdict(self)
        if fields["arch"] == "gemma3":
            del fields["arch"]  # the key Gemma3 recipes had before ``arch`` existed: their cache stays valid
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def cache_dir() -> Path:
    """The user cache (``~/.cache/mlsyskit/bicache`` on Linux); ``BICACHE_CACHE_DIR`` overrides."""
    return console.cache_dir("bicache", "BICACHE_CACHE_DIR")


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
    logits = kvcache.forward(dlm, inp, logits_from=0)
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
        pred = kvcache.forward(dlm, inp, logits_from=p).argmax(-1)
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
        pred = kvcache.forward(dlm, x, logits_from=x.shape[1] - dlm.spec.gen_length).argmax(-1)
    dlm.model.train(was)
    return float((pred == ans).all(1).float().mean())


@dataclass
class _RunState:
    """Where a training run stands beyond the weights: curriculum level, anneal start, best so far."""

    rows: int
    anneal_from: int | None  # step the curriculum reached every row
    level_since: int = 0  # step at which the curriculum reached its current level
    best_acc: float = -1.0  # held-out accuracy of ``best``
    best: dict | None = None  # the weights with the best held-out accuracy at full rows


def _initial_model(recipe: Recipe) -> DiffusionLM:
    """The untrained model of ``recipe``, table embeddings composed if it asks for that."""
    gemma = {"attn_scalar": recipe.attn_scalar, "local_layers": recipe.local_layers, "window": recipe.window}
    if recipe.arch != "gemma3" and recipe.local_layers:
        raise ValueError(f"Recipe.local_layers must be 0 for arch {recipe.arch!r} (only gemma3 has local layers)")
    dlm = DiffusionLM.random(
        recipe.spec,
        seed=recipe.seed,
        arch=recipe.arch,
        layers=recipe.layers,
        hidden=recipe.hidden,
        heads=recipe.heads,
        **(gemma if recipe.arch == "gemma3" else {}),
    )
    if recipe.compose_init:
        compose_table_embeddings(dlm, recipe.seed)
    return dlm


def _lr_at(recipe: Recipe, step: int, anneal_from: int | None) -> float:
    """Warmup, constant while the curriculum grows, cosine to 5% once every row is filled."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    if anneal_from is None:
        return recipe.lr
    p = min(1.0, (step - anneal_from) / max(1, recipe.anneal))
    return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))


def _resume(state_path: Path, model, opt, gen: torch.Generator, task: TableTask, run: _RunState) -> int:
    """Restore weights, optimizer, both random streams and ``run`` from a checkpoint; returns its step."""
    st = load_train_state(state_path)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    gen.set_state(st["gen"])
    task.rng.setstate(st["rng"])
    start = st["step"]
    run.rows, run.anneal_from = st["rows"], st.get("anneal_from")
    run.level_since = st.get("level_since", start)
    run.best_acc, run.best = st.get("best_acc", -1.0), st.get("best")
    log.info("resuming training at step %d", start)
    return start


def _save_train_state(
    state_path: Path, model, opt, gen: torch.Generator, task: TableTask, step: int, run: _RunState
) -> None:
    """Write everything :func:`_resume` needs, atomically, so an interrupted run loses at most one eval period."""
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "gen": gen.get_state(),
        "rng": task.rng.getstate(),
        "step": step,
        "rows": run.rows,
        "anneal_from": run.anneal_from,
        "level_since": run.level_since,
        "best_acc": run.best_acc,
        "best": run.best,
    }
    with hwtopo.atomic_file(state_path, "wb") as f:
        torch.save(state, f)


def _train_step(dlm: DiffusionLM, opt, task: TableTask, gen: torch.Generator, recipe: Recipe, rows: int) -> float:
    """One optimizer step on a fresh batch at curriculum level ``rows``; returns the loss."""
    x, maskable = task.training_batch(recipe.batch, rows=rows, min_rows=recipe.min_rows if recipe.mixed else None)
    loss = masked_diffusion_loss(dlm, x, maskable, gen)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(dlm.model.parameters(), 1.0)
    opt.step()
    return loss.item()


def _evaluate(dlm: DiffusionLM, task: TableTask, recipe: Recipe, run: _RunState, step: int) -> float:
    """Advance the curriculum on its gate or patience, then keep the best weights; returns held-out accuracy."""
    full = recipe.spec.rows
    stuck = recipe.patience > 0 and step - run.level_since >= recipe.patience
    if run.rows < full and (stuck or batch_accuracy(dlm, task, run.rows) >= recipe.curriculum_gate):
        run.rows, run.level_since = run.rows + 1, step
        if run.rows == full:
            run.anneal_from = step
    acc = heldout_accuracy(dlm, n=recipe.val_requests)
    if run.rows == full and acc > run.best_acc:
        run.best_acc, run.best = acc, {k: v.detach().clone() for k, v in dlm.model.state_dict().items()}
    return acc


def train(recipe: Recipe = Recipe(), progress: bool = True, resume_dir: Path | None = None) -> DiffusionLM:
    """Train from scratch with ``recipe``; with ``resume_dir`` the run checkpoints there and resumes."""
    torch.manual_seed(recipe.seed)
    dlm = _initial_model(recipe)
    model = dlm.model.train()
    task = TableTask(recipe.spec, seed=recipe.seed + 1)
    gen = torch.Generator().manual_seed(recipe.seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))

    start = 0
    rows = min(recipe.min_rows, recipe.spec.rows) if recipe.curriculum_gate > 0 else recipe.spec.rows
    run = _RunState(rows=rows, anneal_from=0 if rows == recipe.spec.rows else None)
    state_path = resume_dir / "train-state.pt" if resume_dir is not None else None
    if state_path is not None and state_path.exists():
        start = _resume(state_path, model, opt, gen, task, run)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=recipe.steps, initial=start, desc="train bicache DLM", unit="step")
    t0 = time.time()
    ema = None
    for step in range(start, recipe.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(recipe, step, run.anneal_from)
        loss = _train_step(dlm, opt, task, gen, recipe, run.rows)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", rows=run.rows)
        if (step + 1) % recipe.eval_every == 0:
            acc = _evaluate(dlm, task, recipe, run, step + 1)
            log.info("step %d rows %d loss %.4f heldout %.3f (%.0fs)", step + 1, run.rows, ema, acc, time.time() - t0)
            if bar is not None:
                bar.set_postfix(loss=f"{ema:.3f}", rows=run.rows, heldout=f"{acc:.3f}")
            if state_path is not None:
                _save_train_state(state_path, model, opt, gen, task, step + 1, run)
            if acc >= recipe.target and run.anneal_from is not None and step + 1 >= run.anneal_from + recipe.anneal:
                break
    if run.best is not None:  # early stopping: the weights with the best held-out accuracy at full rows
        model.load_state_dict(run.best)
        log.info("kept the weights with held-out exact match %.3f", run.best_acc)
    if bar is not None:
        bar.close()
    model.eval()
    return dlm


def load_train_state(path: Path) -> dict:
    """A ``train-state.pt`` written by :func:`train`, read with ``weights_only=True``: tensors and plain
    values only, so a crafted file in the resume directory cannot run code."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects other than tensors and plain values, which bicache does not unpickle "
            "(that could run code); it was not written by bicache: delete it to train from the start"
        ) from e


SHIPPED_DIR = Path(__file__).parent / "checkpoints"
"""Checkpoints that ship with the package (``bicache train`` with the default ``Recipe()`` reproduces
them), so a first demo or bench does not train."""


def load_or_train(recipe: Recipe = Recipe(), progress: bool = True, directory: Path | None = None) -> DiffusionLM:
    """The checkpoint for ``recipe``: the user's cache (``directory``, default ``cache_dir()``), else the
    one shipped with the package (only when ``directory`` is not given), else train it and cache it."""
    name = f"dlm-{recipe.key()}"
    path = (directory or cache_dir()) / name
    if (path / "task.json").exists():
        log.info("loading cached checkpoint %s", path)
        return DiffusionLM.load(path)
    if directory is None and (SHIPPED_DIR / name / "task.json").exists():
        log.info("loading the shipped checkpoint %s", SHIPPED_DIR / name)
        return DiffusionLM.load(SHIPPED_DIR / name)
    partial = path.with_name(path.name + ".partial")
    dlm = train(recipe, progress=progress, resume_dir=partial)
    dlm.save(path)
    import shutil

    shutil.rmtree(partial, ignore_errors=True)
    log.info("saved checkpoint %s", path)
    return dlm
