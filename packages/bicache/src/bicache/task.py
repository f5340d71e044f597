"""The package's prefix-dependent task: a key -> value table shared by many requests.

Every request is one fixed-layout token sequence::

    <bos> [? key d d d] x SHOTS  [key d d d] x ROWS  ? key_q | d d d <eos>
    \\_______ few-shot examples ____/\\_____ table _____/\\question/ \\answer (generated)/

A *shared prefix* of a burst of requests is ``<bos>``, the few-shot examples and the first
``shared_rows`` table rows; the remaining rows and the question are private to each request, so the
shared-prefix fraction of the prompt is set by ``shared_rows``. Answering needs the table: the asked
key may sit in the shared or the private rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

SPECIALS = ["<pad>", "<mask>", "<bos>", "<eos>", "?"]
DIGITS = [str(d) for d in range(10)]


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the table task; the defaults are what the bundled checkpoint is trained on."""

    n_keys: int = 24
    rows: int = 8
    shots: int = 2
    value_digits: int = 3

    @property
    def row_len(self) -> int:
        return 1 + self.value_digits

    @property
    def shot_len(self) -> int:
        return 2 + self.value_digits

    @property
    def gen_length(self) -> int:
        """Answer tokens to generate: the digits and ``<eos>``."""
        return self.value_digits + 1

    @property
    def prompt_length(self) -> int:
        return 1 + self.shots * self.shot_len + self.rows * self.row_len + 2

    @property
    def seq_length(self) -> int:
        return self.prompt_length + self.gen_length

    def prefix_length(self, shared_rows: int) -> int:
        """Tokens of the shared prefix when the first ``shared_rows`` rows are shared."""
        return 1 + self.shots * self.shot_len + shared_rows * self.row_len

    def shared_rows_for_fraction(self, fraction: float) -> int:
        """The number of shared rows whose prefix is closest to ``fraction`` of the prompt."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        best = min(range(self.rows + 1), key=lambda s: abs(self.prefix_length(s) / self.prompt_length - fraction))
        return best


class Vocab:
    """Whitespace tokenizer over the task's closed vocabulary (specials, digits, keys k00..)."""

    def __init__(self, n_keys: int = 24) -> None:
        self.tokens = SPECIALS + DIGITS + [f"k{i:02d}" for i in range(n_keys)]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.mask_id, self.bos_id, self.eos_id, self.q_id = range(5)
        self.digit0 = len(SPECIALS)
        self.key0 = self.digit0 + 10

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of a whitespace-separated prompt; unknown words are a ValueError naming them."""
        ids = []
        for word in text.split():
            if word not in self.index:
                raise ValueError(
                    f"prompt word {word!r} is not in the vocabulary (valid: <bos>, <mask>, <eos>, ?, 0-9, "
                    f"k00..k{len(self.tokens) - self.key0 - 1:02d})"
                )
            ids.append(self.index[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.tokens[i] if 0 <= i < len(self.tokens) else f"<{i}>" for i in ids)


@dataclass
class Request:
    """One generation request: prompt token ids, the expected answer, and its shared-prefix length."""

    prompt: list[int]
    answer: list[int]
    prefix_len: int = 0
    group: int = 0
    meta: dict = field(default_factory=dict)


class TableTask:
    """Generates table-lookup requests; ``burst`` makes groups that share a prefix."""

    def __init__(self, spec: TaskSpec | None = None, seed: int = 0) -> None:
        self.spec = spec or TaskSpec()
        self.vocab = Vocab(self.spec.n_keys)
        self.rng = random.Random(seed)

    def _value(self) -> list[int]:
        return [self.vocab.digit0 + self.rng.randrange(10) for _ in range(self.spec.value_digits)]

    def _table(self, keys: list[int]) -> dict[int, list[int]]:
        return {k: self._value() for k in keys}

    def burst(self, n: int, shared_rows: int, group: int = 0) -> list[Request]:
        """``n`` requests sharing the few-shot examples and the first ``shared_rows`` rows."""
        s, v = self.spec, self.vocab
        if not 0 <= shared_rows <= s.rows:
            raise ValueError(f"shared_rows must lie in [0, {s.rows}], got {shared_rows}")
        keys = self.rng.sample(range(s.n_keys), s.n_keys)
        shared_keys, free = keys[:shared_rows], keys[shared_rows:]
        shared = self._table(shared_keys)
        # Few-shot examples ask keys of the shared rows (the same lookup the request makes); with
        # fewer shared rows than shots they ask keys absent from the table, with their own values.
        if shared_rows >= s.shots:
            shots = [(k, shared[k]) for k in self.rng.sample(shared_keys, s.shots)]
        else:
            shots = [(k, self._value()) for k in free[: s.shots]]
            free = free[s.shots :]
        prefix = [v.bos_id]
        for k, val in shots:
            prefix += [v.q_id, v.key0 + k, *val]
        for k, val in shared.items():
            prefix += [v.key0 + k, *val]
        out = []
        for _ in range(n):
            private_keys = self.rng.sample(free, s.rows - shared_rows)
            private = self._table(private_keys)
            table = {**shared, **private}
            ids = list(prefix)
            for k, val in private.items():
                ids += [v.key0 + k, *val]
            q = self.rng.choice(list(table))
            ids += [v.q_id, v.key0 + q]
            out.append(
                Request(
                    prompt=ids,
                    answer=[*table[q], v.eos_id],
                    prefix_len=len(prefix),
                    group=group,
                    meta={"shared_rows": shared_rows, "asked_shared": q in shared},
                )
            )
        return out

    def training_batch(self, n: int, distinct: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` independent full sequences (prompt + answer) and the maskable positions.

        Maskable: the answer and the digits of few-shot examples that ask table keys (both are
        table lookups, so each sequence carries several retrieval targets). ``distinct`` is a
        curriculum: the table holds only that many distinct rows (the asked one, the few-shot ones
        and others), each repeated equally often, so the lookup is easier but row frequency gives
        no hint.
        """
        s = self.spec
        seqs, maskable = [], []
        rows_start = 1 + s.shots * s.shot_len
        for _ in range(n):
            rows = self.rng.randrange(s.rows + 1)
            (r,) = self.burst(1, rows)
            if distinct is not None and distinct < s.rows:
                self._fewer_rows(r, distinct, rows_start)
            seqs.append(r.prompt + r.answer)
            m = [False] * s.seq_length
            for i in range(s.prompt_length, s.seq_length):
                m[i] = True
            if rows >= s.shots:
                for j in range(s.shots):
                    for d in range(s.value_digits):
                        m[1 + j * s.shot_len + 2 + d] = True
            maskable.append(m)
        return torch.tensor(seqs, dtype=torch.long), torch.tensor(maskable, dtype=torch.bool)

    def _fewer_rows(self, r: Request, distinct: int, rows_start: int) -> None:
        s = self.spec
        starts = [rows_start + i * s.row_len for i in range(s.rows)]
        rows = {r.prompt[i]: r.prompt[i : i + s.row_len] for i in starts}
        keep = [r.prompt[-1]] + [r.prompt[1 + j * s.shot_len + 1] for j in range(s.shots)]
        keep = [k for k in dict.fromkeys(keep) if k in rows]
        others = [k for k in rows if k not in keep]
        keep += self.rng.sample(others, max(0, distinct - len(keep)))
        order = (keep * (s.rows // len(keep) + 1))[: s.rows]
        self.rng.shuffle(order)
        for i, k in zip(starts, order):
            r.prompt[i : i + s.row_len] = rows[k]
