"""Train the all-global (LLaDA-shaped) masked-diffusion model on the standard library's sources.

Every layer is a global bidirectional Llama layer, as in LLaDA. Half of each batch is
pretraining-style (any byte of the sequence may be masked, at ratio ``t ~ U(0, 1)``), half is
LLaDA's SFT (only the answer is masked), so the model learns the language and the prefix-needing
completion/infilling requests of :mod:`bicache.corpus` at once. Training is resumable: a single
safetensors file (weights, optimizer moments, random streams, step) is replaced atomically every
``save_every`` steps, and a wall-clock ``budget_s`` stops a run that a later call continues.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save

import hwtopo

from . import kvcache
from .corpus import ByteVocab, TextSpec, TextTask, stdlib_files
from .model import DiffusionLM, tiny_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextRecipe:
    """Everything that determines the trained weights of one seed."""

    layers: int = 4
    hidden: int = 96
    heads: int = 4
    steps: int = 2000
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    seed: int = 0
    retrieval: float = 0.5  # share of training requests whose answer occurs in the context
    spec: TextSpec = field(default_factory=TextSpec)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TextRecipe:
        return cls(**{**d, "spec": TextSpec(**d["spec"])})


def build(recipe: TextRecipe) -> DiffusionLM:
    """The untrained model of ``recipe``: a bidirectional Llama, every layer global."""
    vocab = ByteVocab()
    config = tiny_config(
        len(vocab), layers=recipe.layers, hidden=recipe.hidden, heads=recipe.heads, max_len=256, arch="llama"
    )
    torch.manual_seed(recipe.seed)
    from transformers import LlamaForCausalLM

    return DiffusionLM(LlamaForCausalLM(config), vocab, recipe.spec)  # type: ignore[arg-type]


def _loss(dlm: DiffusionLM, x: torch.Tensor, answer: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Masked-diffusion cross-entropy; the first half of the batch may mask any byte, the rest only answers."""
    b = x.shape[0]
    maskable = answer.clone()
    maskable[: b // 2] = x[: b // 2] >= dlm.vocab.byte0
    t = torch.rand(b, 1, generator=gen)
    masked = (torch.rand(x.shape, generator=gen) < t) & maskable
    none = ~masked.any(1)
    if none.any():
        masked[none, -1] = True
    inp = torch.where(masked, torch.full_like(x, dlm.mask_id), x)
    logits = kvcache.forward(dlm, inp, logits_from=0)
    return torch.nn.functional.cross_entropy(logits[masked], x[masked])


def _lr(recipe: TextRecipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    p = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def save_state(
    path: Path, dlm: DiffusionLM, opt: torch.optim.Optimizer, gen: torch.Generator, task: TextTask, step: int
) -> None:
    """Weights, AdamW moments, both random streams and the step, in one atomically replaced safetensors file."""
    # named_parameters lists a tied weight once (lm_head is the embedding), as safetensors requires
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in dlm.model.named_parameters()}
    names = {id(p): n for n, p in dlm.model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq", "step"):
                if k in st:
                    tensors[f"opt.{names[id(p)]}.{k}"] = torch.as_tensor(st[k]).detach().clone().contiguous()
    tensors["gen"] = gen.get_state()
    meta = {"step": str(step), "rng": json.dumps(task.rng.getstate())}
    hwtopo.atomic_write_bytes(path, save(tensors, metadata=meta))


def load_state(path: Path, dlm: DiffusionLM, opt: torch.optim.Optimizer, gen: torch.Generator, task: TextTask) -> int:
    """Restore what :func:`save_state` wrote; returns the step to continue from."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    missing, unexpected = dlm.model.load_state_dict(
        {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False
    )
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"{path}: training state does not match the recipe's model ({missing[:3]} {unexpected[:3]})")
    for n, p in dlm.model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {k: tensors[f"opt.{n}.{k}"] for k in ("exp_avg", "exp_avg_sq", "step")}
    gen.set_state(tensors["gen"])
    v, state, gauss = json.loads(meta["rng"])
    task.rng.setstate((v, tuple(state), gauss))
    return int(meta["step"])


def train_text(
    recipe: TextRecipe, out_dir: Path, budget_s: float | None = None, save_every: int = 100
) -> DiffusionLM | None:
    """Train (or continue) ``recipe`` in ``out_dir``; returns the model once ``recipe.steps`` are done.

    ``budget_s`` stops early (state saved, returns None): a later call resumes from the last save.
    """
    out_dir = Path(out_dir)
    torch.set_num_threads(1)
    dlm = build(recipe)
    task = TextTask(recipe.spec, stdlib_files()["train"], seed=recipe.seed + 1)
    gen = torch.Generator().manual_seed(recipe.seed + 2)
    opt = torch.optim.AdamW(dlm.model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))
    state = out_dir / "train-state.safetensors"
    step = load_state(state, dlm, opt, gen, task) if state.exists() else 0
    if step:
        log.info("resuming %s at step %d", out_dir, step)
    dlm.model.train()
    t0, ema = time.time(), None
    while step < recipe.steps:
        for g in opt.param_groups:
            g["lr"] = _lr(recipe, step)
        x, answer = task.training_batch(recipe.batch, recipe.retrieval)
        loss = _loss(dlm, x, answer, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dlm.model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % save_every == 0 or step == recipe.steps:
            save_state(state, dlm, opt, gen, task, step)
            log.info("step %d loss %.4f (%.0fs)", step, ema, time.time() - t0)
            if budget_s is not None and time.time() - t0 > budget_s and step < recipe.steps:
                return None
    dlm.model.eval()
    return dlm


def save_text_model(dlm: DiffusionLM, recipe: TextRecipe, directory: Path, extra: dict | None = None) -> Path:
    """Weights (fp16 safetensors, loaded back as fp32) + config + recipe.json, atomically."""

    def fill(tmp: Path) -> None:
        dlm.model.half().save_pretrained(tmp)
        dlm.model.float()
        doc = {"recipe": recipe.to_dict(), "reproduce": f"bicache.texttrain.train_text(TextRecipe(seed={recipe.seed}))"}
        doc.update(extra or {})
        (tmp / "text.json").write_text(json.dumps(doc, indent=2) + "\n")

    return hwtopo.atomic_dir(directory, fill)


def load_text_model(directory: Path) -> tuple[DiffusionLM, TextRecipe]:
    """A model saved by :func:`save_text_model` (safetensors only: no code runs)."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    meta = directory / "text.json"
    if not meta.exists():
        raise FileNotFoundError(f"{directory} holds no bicache text model (text.json missing)")
    recipe = TextRecipe.from_dict(json.loads(meta.read_text(encoding="utf-8"))["recipe"])
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)
    return DiffusionLM(model, ByteVocab(), recipe.spec), recipe  # type: ignore[arg-type]
