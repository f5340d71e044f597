"""Perplexity on held-out text, and lm-eval-harness tasks when that package is installed."""

from __future__ import annotations

import math

import torch
from torch import nn


def perplexity(model: nn.Module, ids: torch.Tensor, batch_size: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood over ``ids`` [N, T]."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [N, T] with T >= 2, got shape {tuple(ids.shape)}")
    total, count = 0.0, 0
    model.eval()
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch_size):
            b = ids[i : i + batch_size].to(device)
            logits = model(input_ids=b).logits[:, :-1].float()
            nll = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll)
            count += b[:, 1:].numel()
    return math.exp(total / count)


def lm_eval_tasks(model: nn.Module, tokenizer, tasks: list[str], limit: int | None = None) -> dict:
    """Run lm-eval-harness ``tasks`` on a transformers model (needs the ``eval`` extra and a tokenizer)."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ImportError("lm-eval-harness is not installed; pip install 'parser-moe[eval]'") from e
    lm = HFLM(pretrained=model, tokenizer=tokenizer)
    return simple_evaluate(model=lm, tasks=tasks, limit=limit)["results"]
