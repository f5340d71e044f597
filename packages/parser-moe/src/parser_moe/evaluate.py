"""Perplexity and next-token accuracy on held-out text, and lm-eval-harness tasks when installed."""

from __future__ import annotations

import math

import torch
from torch import nn


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def lm_scores(model: nn.Module, ids: torch.Tensor, batch_size: int = 16) -> tuple[float, float]:
    """(perplexity, top-1 next-token accuracy) over ``ids`` [N, T], in one pass."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [N, T] with T >= 2, got shape {tuple(ids.shape)}")
    total, hits, count = 0.0, 0, 0
    model.eval()
    device = _device(model)
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch_size):
            b = ids[i : i + batch_size].to(device)
            logits = model(input_ids=b).logits[:, :-1].float()
            target = b[:, 1:]
            nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
            total += float(nll)
            hits += int((logits.argmax(-1) == target).sum())
            count += target.numel()
    return math.exp(total / count), hits / count


def perplexity(model: nn.Module, ids: torch.Tensor, batch_size: int = 16) -> float:
    """exp of the mean next-token negative log-likelihood over ``ids`` [N, T]."""
    return lm_scores(model, ids, batch_size)[0]


def lm_eval_tasks(model: nn.Module, tokenizer, tasks: list[str], limit: int | None = None) -> dict:
    """Run lm-eval-harness ``tasks`` on a transformers model (needs the ``eval`` extra and a tokenizer)."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ImportError("lm-eval-harness is not installed; pip install 'parser-moe[eval]'") from e
    lm = HFLM(pretrained=model, tokenizer=tokenizer)
    return simple_evaluate(model=lm, tasks=tasks, limit=limit)["results"]
