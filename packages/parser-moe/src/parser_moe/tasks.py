"""Downstream tasks built from held-out local text, scored the way lm-eval-harness scores multiple choice.

* ``next_token``: top-1 next-token accuracy on held-out code windows (measured with perplexity).
* ``docstring_mc``: given a function's ``def`` line and the opening quotes of its docstring, pick the
  docstring's first line among 4 (the other 3 from other functions of the same split).
* ``identifier_mc``: given the code just before an identifier, pick it among 4 identifiers of the
  same file.

A choice scores its mean log-likelihood per token after the context (length-normalised like
lm-eval's ``acc_norm``), so a long choice is not penalised for its length. Items are drawn with a
fixed seed from the files of one split, so every model is asked the same questions.
"""

from __future__ import annotations

import ast
import io
import keyword
import random
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .data import split_files

TASKS = ("next_token", "docstring_mc", "identifier_mc")
CHOICES = 4
CONTEXT_BYTES = 96
DOC_BYTES = 48


@dataclass(frozen=True)
class Item:
    """One multiple-choice question: a context, the candidate continuations, the right one's index."""

    context: str
    choices: tuple[str, ...]
    answer: int


def _sources(files: Sequence[Path]) -> list[str]:
    return [f.read_bytes().decode("utf-8", "replace") for f in files]


def _docstrings(source: str) -> list[tuple[str, str]]:
    """(def line, first docstring line) of every function with a docstring in ``source``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            if len(first) >= 12:
                out.append((lines[node.lineno - 1].strip()[-CONTEXT_BYTES:], first[:DOC_BYTES]))
    return out


def _pick(rng: random.Random, answer: str, pool: Sequence[str]) -> tuple[tuple[str, ...], int] | None:
    """``answer`` plus CHOICES-1 distinct others from ``pool``, shuffled; None when the pool is too small."""
    others = sorted({p for p in pool if p != answer})
    if len(others) < CHOICES - 1:
        return None
    choices = [answer, *rng.sample(others, CHOICES - 1)]
    rng.shuffle(choices)
    return tuple(choices), choices.index(answer)


def docstring_items(sources: Sequence[str], n: int, seed: int = 0) -> list[Item]:
    """``n`` docstring questions (fewer when the sources have fewer documented functions)."""
    pairs = [p for s in sources for p in _docstrings(s)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    pool = [doc for _, doc in pairs]
    items = []
    for head, doc in pairs[:n]:
        picked = _pick(rng, doc, pool)
        if picked:
            items.append(Item(f'{head}\n    """', *picked))
    return items


def _identifiers(source: str) -> list[tuple[int, str]]:
    """(character offset, name) of every identifier of >= 5 characters that is not a keyword."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and len(tok.string) >= 5 and not keyword.iskeyword(tok.string):
                out.append((starts[tok.start[0] - 1] + tok.start[1], tok.string))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return [(pos, name) for pos, name in out if pos >= CONTEXT_BYTES]


def identifier_items(sources: Sequence[str], n: int, seed: int = 0) -> list[Item]:
    """``n`` identifier questions spread over the sources (distractors from the same file)."""
    rng = random.Random(seed + 1)
    found = [(s, _identifiers(s)) for s in sources]
    per_file = [(s, ids) for s, ids in found if len({name for _, name in ids}) >= CHOICES]
    items = []
    for i in range(n):
        if not per_file:
            break
        source, ids = per_file[i % len(per_file)]
        pos, name = ids[rng.randrange(len(ids))]
        picked = _pick(rng, name, [nm for _, nm in ids])
        if picked:
            items.append(Item(source[pos - CONTEXT_BYTES : pos], *picked))
    return items


def build_tasks(split: str = "test", n: int = 32, seed: int = 0) -> dict[str, list[Item]]:
    """The multiple-choice task sets from the files of ``split`` (``n`` items each)."""
    sources = _sources(split_files(split))
    return {"docstring_mc": docstring_items(sources, n, seed), "identifier_mc": identifier_items(sources, n, seed)}


def byte_encoder(vocab: int) -> Callable[[str], list[int]]:
    """Bytes as token ids (folded into the vocabulary when it is smaller than 256)."""
    return lambda text: [b % vocab for b in text.encode("utf-8")]


def choice_scores(
    model: nn.Module, items: Sequence[Item], encode: Callable[[str], list[int]], batch_size: int = 32
) -> list[list[float]]:
    """Mean log-likelihood per token of each choice after its item's context."""
    seqs = []
    for it in items:
        ctx = encode(it.context)
        for ch in it.choices:
            seqs.append((ctx + encode(ch), len(ctx)))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    flat = [0.0] * len(seqs)
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    model.eval()
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            chunk = order[b : b + batch_size]
            width = max(len(seqs[i][0]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, : len(seqs[i][0])] = torch.tensor(seqs[i][0])
            logp = model(input_ids=ids.to(device)).logits.float().log_softmax(-1).cpu()
            for r, i in enumerate(chunk):
                toks, start = seqs[i]
                tgt = torch.tensor(toks[start:])
                flat[i] = float(logp[r, start - 1 : len(toks) - 1].gather(1, tgt[:, None]).mean())
    return [flat[k * CHOICES : (k + 1) * CHOICES] for k in range(len(items))]


def accuracy(model: nn.Module, items: Sequence[Item], encode: Callable[[str], list[int]]) -> float:
    """Share of ``items`` whose right choice scores highest."""
    if not items:
        raise ValueError("no task items: the split has too little text to build this task")
    scores = choice_scores(model, items, encode)
    return sum(int(max(range(CHOICES), key=s.__getitem__) == it.answer) for s, it in zip(scores, items)) / len(items)


def run_tasks(
    model: nn.Module, tasks: dict[str, list[Item]], encode: Callable[[str], list[int]], next_token_acc: float
) -> dict[str, float]:
    """Accuracy on every task and their mean (``next_token`` measured alongside perplexity)."""
    out = {"next_token": next_token_acc}
    for name, items in tasks.items():
        out[name] = accuracy(model, items, encode)
    out["mean"] = sum(out[t] for t in TASKS) / len(TASKS)
    return out
