"""The package's prefix-dependent task: a table of facts shared by many requests, one-hop layout.

Every request is one fixed-layout token sequence::

    <bos> [? key d] x SHOTS  [key.0=d] x ROWS  ? key_q | d <eos> <eos> <eos>
    \\_______ few-shot examples ____/\\___________ table ___________/\\question/ \\answer (generated)/

Each table value token carries its row key and digit slot (``k05.0=3``: digit 0 of key ``k05`` is
3), so answering is *one* attention hop: answer slot ``j`` attends to the table token whose key is
the asked key and whose slot is ``j`` and reads its digit. The answer is padded with ``<eos>`` to
``answer_length`` tokens, as LLaDA pads its generation window. The defaults (one digit, no
few-shot examples) are what the bundled recipe learns on a CPU; more digits need a digit-slot
match as well, and few-shot examples offer a copy-from-example shortcut the model settles on. (With plain ``k05 7 3 1`` rows the digits
first have to learn which key precedes them, a two-hop induction circuit a tiny model did not learn
in a CPU training budget; see the README.) A *shared prefix* of a burst of requests is ``<bos>``,
the few-shot examples and the first ``shared_rows`` table rows; the remaining rows and the question
are private to each request, so the shared-prefix fraction of the prompt is set by ``shared_rows``.
Answering needs the table: the asked key may sit in the shared or the private rows.

:class:`Vocab` is the task's closed vocabulary plus 256 byte tokens: ``encode(text,
open_vocab=True)`` spells words outside the task vocabulary as UTF-8 bytes (SentencePiece-style
byte fallback), so any text is accepted (the chat route).
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

    n_keys: int = 16
    rows: int = 12
    shots: int = 0
    value_digits: int = 1
    answer_length: int = 4  # generated tokens: the digits, then <eos> padding (LLaDA-style)

    def __post_init__(self) -> None:
        for name in ("n_keys", "rows", "value_digits"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.answer_length <= self.value_digits:
            raise ValueError(
                f"TaskSpec.answer_length ({self.answer_length}) must exceed value_digits ({self.value_digits}) "
                "to leave room for <eos>"
            )
        if self.shots < 0:
            raise ValueError(f"TaskSpec.shots must be >= 0, got {self.shots}")
        if self.n_keys < self.rows + self.shots:
            raise ValueError(
                f"TaskSpec.n_keys ({self.n_keys}) must be >= rows + shots ({self.rows + self.shots}) "
                "so that few-shot keys can lie outside a table with no shared rows"
            )

    @property
    def row_len(self) -> int:
        return self.value_digits

    @property
    def shot_len(self) -> int:
        return 2 + self.value_digits

    @property
    def gen_length(self) -> int:
        """Answer tokens to generate: the digits, then ``<eos>`` up to ``answer_length``."""
        return self.answer_length

    @property
    def rows_start(self) -> int:
        return 1 + self.shots * self.shot_len

    @property
    def prompt_length(self) -> int:
        return self.rows_start + self.rows * self.row_len + 2

    @property
    def seq_length(self) -> int:
        return self.prompt_length + self.gen_length

    def prefix_length(self, shared_rows: int) -> int:
        """Tokens of the shared prefix when the first ``shared_rows`` rows are shared."""
        return self.rows_start + shared_rows * self.row_len

    def shared_rows_for_fraction(self, fraction: float) -> int:
        """The number of shared rows whose prefix is closest to ``fraction`` of the prompt."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        return min(range(self.rows + 1), key=lambda s: abs(self.prefix_length(s) / self.prompt_length - fraction))


class Vocab:
    """Whitespace tokenizer: specials, digits, keys ``k00..``, keyed digits ``k00.0=0..``, then bytes.

    ``encode`` accepts only the task vocabulary unless ``open_vocab=True``; then every other word is
    spelled with byte tokens ``<0x..>`` of its UTF-8 encoding (a ``<0x20>`` byte separates two
    consecutive spelled words), and ``decode`` turns byte runs back into text.
    """

    def __init__(self, n_keys: int = 16, value_digits: int = 3) -> None:
        self.n_keys, self.value_digits = n_keys, value_digits
        keys = [f"k{i:02d}" for i in range(n_keys)]
        keyed = [f"{k}.{j}={d}" for k in keys for j in range(value_digits) for d in range(10)]
        self.tokens = SPECIALS + DIGITS + keys + keyed + [f"<0x{b:02X}>" for b in range(256)]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.mask_id, self.bos_id, self.eos_id, self.q_id = range(5)
        self.digit0 = len(SPECIALS)
        self.key0 = self.digit0 + 10
        self.keyed0 = self.key0 + n_keys
        self.byte0 = self.keyed0 + len(keyed)

    def __len__(self) -> int:
        return len(self.tokens)

    def keyed(self, key: int, slot: int, digit: int) -> int:
        """Id of the table token ``k<key>.<slot>=<digit>``."""
        return self.keyed0 + (key * self.value_digits + slot) * 10 + digit

    def encode(self, text: str, open_vocab: bool = False) -> list[int]:
        """Token ids of a whitespace-separated text.

        Unknown words are a ValueError naming them, or with ``open_vocab`` spelled as UTF-8 bytes.
        """
        ids: list[int] = []
        spelled = False
        for word in text.split():
            if word in self.index:
                ids.append(self.index[word])
                spelled = False
                continue
            if not open_vocab:
                raise ValueError(
                    f"prompt word {word!r} is not in the vocabulary (valid: <bos>, <mask>, <eos>, ?, 0-9, "
                    f"k00..k{self.n_keys - 1:02d}, k00.0=0..; or use an open-vocabulary route)"
                )
            data = (b" " if spelled else b"") + word.encode("utf-8")
            ids.extend(self.byte0 + b for b in data)
            spelled = True
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``: task tokens joined by spaces, byte runs decoded as UTF-8."""
        return " ".join(decode_runs(ids, self.byte0, self.tokens))


def decode_runs(ids: list[int], byte0: int, tokens: list[str]) -> list[str]:
    """``ids`` as pieces: each run of byte tokens (``byte0`` onwards) decoded as UTF-8, other ids by name."""
    words: list[str] = []
    run = bytearray()
    for i in ids:
        if byte0 <= i < byte0 + 256:
            run.append(i - byte0)
            continue
        if run:
            words.append(run.decode("utf-8", errors="replace"))
            run.clear()
        words.append(tokens[i] if 0 <= i < len(tokens) else f"<{i}>")
    if run:
        words.append(run.decode("utf-8", errors="replace"))
    return words


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
        self.vocab = Vocab(self.spec.n_keys, self.spec.value_digits)
        self.rng = random.Random(seed)

    def _value(self) -> list[int]:
        return [self.rng.randrange(10) for _ in range(self.spec.value_digits)]

    def _row(self, key: int, value: list[int]) -> list[int]:
        return [self.vocab.keyed(key, j, d) for j, d in enumerate(value)]

    def _digits(self, value: list[int]) -> list[int]:
        return [self.vocab.digit0 + d for d in value]

    def burst(self, n: int, shared_rows: int, group: int = 0) -> list[Request]:
        """``n`` requests sharing the few-shot examples and the first ``shared_rows`` rows."""
        s, v = self.spec, self.vocab
        if not 0 <= shared_rows <= s.rows:
            raise ValueError(f"shared_rows must lie in [0, {s.rows}], got {shared_rows}")
        keys = self.rng.sample(range(s.n_keys), s.n_keys)
        shared_keys, free = keys[:shared_rows], keys[shared_rows:]
        shared = {k: self._value() for k in shared_keys}
        # Few-shot examples ask keys of the shared rows (the same lookup the request makes); with
        # fewer shared rows than shots they ask keys absent from the table, with their own values.
        if shared_rows >= s.shots:
            shots = [(k, shared[k]) for k in self.rng.sample(shared_keys, s.shots)]
        else:
            shots = [(k, self._value()) for k in free[: s.shots]]
            free = free[s.shots :]
        prefix = [v.bos_id]
        for k, val in shots:
            prefix += [v.q_id, v.key0 + k, *self._digits(val)]
        for k, val in shared.items():
            prefix += self._row(k, val)
        out = []
        for _ in range(n):
            private = {k: self._value() for k in self.rng.sample(free, s.rows - shared_rows)}
            table = {**shared, **private}
            ids = list(prefix)
            for k, val in private.items():
                ids += self._row(k, val)
            q = self.rng.choice(list(table))
            ids += [v.q_id, v.key0 + q]
            out.append(
                Request(
                    prompt=ids,
                    answer=[*self._digits(table[q])] + [v.eos_id] * (s.answer_length - s.value_digits),
                    prefix_len=len(prefix),
                    group=group,
                    meta={"shared_rows": shared_rows, "asked_shared": q in shared},
                )
            )
        return out

    def training_batch(
        self, n: int, rows: int | None = None, min_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` independent full sequences (prompt + answer) and the maskable positions.

        Maskable: the answer and the digits of few-shot examples that ask table keys (both are
        table lookups, so a sequence carries several retrieval targets). ``rows`` (a curriculum)
        keeps only that many table rows filled and pads the others' slots with ``<pad>``; with
        ``min_rows`` each sequence draws its own filled-row count uniformly from
        ``[min_rows, rows]`` (a mixed curriculum: earlier phases stay in every batch).
        """
        s = self.spec
        seqs, maskable = [], []
        for _ in range(n):
            keep = rows if rows is None or min_rows is None else self.rng.randint(min(min_rows, rows), rows)
            shared = self.rng.randrange(s.rows + 1)
            (r,) = self.burst(1, shared)
            seq = r.prompt + r.answer
            m = [False] * s.prompt_length + [True] * s.gen_length
            if shared >= s.shots:
                for j in range(s.shots):
                    for d in range(s.value_digits):
                        m[s.rows_start - (s.shots - j) * s.shot_len + 2 + d] = True
            if keep is not None and keep < s.rows:
                self._drop_rows(seq, keep)
            seqs.append(seq)
            maskable.append(m)
        return torch.tensor(seqs, dtype=torch.long), torch.tensor(maskable, dtype=torch.bool)

    def _drop_rows(self, seq: list[int], keep: int) -> None:
        """Pad all but ``keep`` table rows, always keeping the asked row and the few-shot rows."""
        s, v = self.spec, self.vocab
        starts = [s.rows_start + i * s.row_len for i in range(s.rows)]
        key_of = {i: (seq[i] - v.keyed0) // (10 * s.value_digits) for i in starts}
        needed = {seq[s.prompt_length - 1] - v.key0}
        needed |= {seq[1 + j * s.shot_len + 1] - v.key0 for j in range(s.shots)}
        must = [i for i in starts if key_of[i] in needed]
        rest = [i for i in starts if key_of[i] not in needed]
        kept = set(must) | set(self.rng.sample(rest, max(0, min(len(rest), keep - len(must)))))
        for i in starts:
            if i not in kept:
                seq[i : i + s.row_len] = [v.pad_id] * s.row_len
