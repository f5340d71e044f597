"""Real-text tasks that need the shared prefix: the Python standard library's own sources.

Files of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path, no
``site-packages``, no ``test`` packages) are split by a hash of their relative path into
``train``, ``dev`` (choosing settings) and ``test`` (reporting): no file is in two splits.
Tokens are bytes (256 ids after a few specials), so nothing is downloaded or fitted.

A request is a fixed-length prompt::

    <bos> context (shared by a burst)  <sep> query             [answer]   completion
    <bos> context (shared by a burst)  <fim> left <sep> right  [answer]   infilling

The *context* is a window of a file; each request of a burst asks about a later window of the same
file: complete the ``answer_length`` bytes after ``query`` or fill the ones between ``left`` and
``right``. Evaluation requests are drawn so that their answer occurs in the context and not in the
private part (identifiers a file repeats): the answer is then retrievable only through the prefix.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .task import Request, decode_runs

TEXT_SPECIALS = ["<pad>", "<mask>", "<bos>", "<eos>", "<sep>", "<fim>"]
SPLITS = ("train", "dev", "test")
KINDS = ("completion", "infill")


class ByteVocab:
    """Specials, then the 256 byte values."""

    def __init__(self) -> None:
        self.tokens = TEXT_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
        self.pad_id, self.mask_id, self.bos_id, self.eos_id, self.sep_id, self.fim_id = range(len(TEXT_SPECIALS))
        self.byte0 = len(TEXT_SPECIALS)

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, data: bytes) -> list[int]:
        return [self.byte0 + b for b in data]

    def decode(self, ids: list[int]) -> str:
        """Bytes decoded as UTF-8; specials shown by name."""
        return "".join(decode_runs(ids, self.byte0, self.tokens))


@dataclass(frozen=True)
class TextSpec:
    """Sizes of the stdlib text task; every prompt has ``prompt_length`` tokens."""

    prompt_length: int = 96
    answer_length: int = 8
    min_context: int = 16  # bytes of context at the smallest shared fraction trained on
    min_private: int = 8  # bytes of the private part at the largest

    def __post_init__(self) -> None:
        if self.answer_length < 1:
            raise ValueError(f"TextSpec.answer_length must be >= 1, got {self.answer_length}")
        if self.prompt_length < self.min_context + self.min_private + 2:
            raise ValueError(
                f"TextSpec.prompt_length ({self.prompt_length}) must be >= min_context + min_private + 2 "
                f"({self.min_context + self.min_private + 2})"
            )

    @property
    def gen_length(self) -> int:
        return self.answer_length

    @property
    def seq_length(self) -> int:
        return self.prompt_length + self.answer_length

    def prefix_for_fraction(self, fraction: float) -> int:
        """Shared-prefix tokens (``<bos>`` + context) closest to ``fraction`` of the prompt, within the trained range."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must lie in (0, 1), got {fraction}")
        p = round(fraction * self.prompt_length)
        return min(max(p, 1 + self.min_context), self.prompt_length - 1 - self.min_private)


def _split_of(rel: str) -> str:
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 20
    return "test" if h == 0 else "dev" if h == 1 else "train"


def stdlib_files(root: Path | None = None, min_bytes: int = 2048) -> dict[str, list[Path]]:
    """The stdlib's ``.py`` files per split (5% dev, 5% test by path hash), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library sources not found at {root}")
    out: dict[str, list[Path]] = {s: [] for s in SPLITS}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if "site-packages" in parts or "test" in parts or "tests" in parts or "idle_test" in parts:
            continue
        try:
            if path.stat().st_size < min_bytes:
                continue
        except OSError:
            continue
        out[_split_of(rel)].append(path)
    return out


class TextTask:
    """Builds training sequences and prefix-sharing request bursts from one split's files."""

    def __init__(self, spec: TextSpec, files: list[Path], seed: int = 0) -> None:
        if not files:
            raise ValueError("TextTask needs at least one source file")
        self.spec = spec
        self.vocab = ByteVocab()
        self.rng = random.Random(seed)
        need = spec.seq_length * 4
        self.texts = [t for t in (p.read_bytes() for p in files) if len(t) >= need]
        if not self.texts:
            raise ValueError(f"no source file has the {need} bytes a request needs")

    def _private(self, text: bytes, q: int, kind: str, at: int) -> tuple[list[int], list[int]]:
        """(private prompt part of ``q`` tokens, answer) for an answer starting at byte ``at``."""
        v, g = self.vocab, self.spec.answer_length
        answer = v.encode(text[at : at + g])
        if kind == "completion":
            return [v.sep_id, *v.encode(text[at - (q - 1) : at])], answer
        left = (q - 2) // 2
        right = q - 2 - left
        return [v.fim_id, *v.encode(text[at - left : at]), v.sep_id, *v.encode(text[at + g : at + g + right])], answer

    def _window(self, text: bytes, p: int) -> tuple[int, int]:
        """Context start and the range of answer positions after it."""
        q, g = self.spec.prompt_length - p, self.spec.answer_length
        c0 = self.rng.randrange(0, len(text) - (p - 1) - q - 2 * g)
        lo = c0 + (p - 1) + q
        return c0, lo

    def _retrievable(self, text: bytes, context: bytes, lo: int, q: int, kind: str, tries: int) -> int | None:
        """An answer position whose answer occurs in ``context`` but not in the private part."""
        g = self.spec.answer_length
        hi = len(text) - g - q
        if hi <= lo:
            return None
        for _ in range(tries):
            at = self.rng.randrange(lo, hi)
            ans = text[at : at + g]
            private = text[at - q : at] if kind == "completion" else text[at - q // 2 : at + g + q // 2]
            if ans in context and ans not in private.replace(ans, b"", 1) and ans.strip():
                return at
        return None

    def burst(
        self, n: int, prefix_len: int, kind: str = "completion", group: int = 0, tries: int = 400
    ) -> list[Request]:
        """``n`` requests sharing ``<bos>`` + a context of ``prefix_len - 1`` bytes, answers retrievable from it."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        s, v = self.spec, self.vocab
        q = s.prompt_length - prefix_len
        for _ in range(200):
            text = self.rng.choice(self.texts)
            c0, lo = self._window(text, prefix_len)
            context = text[c0 : c0 + prefix_len - 1]
            prefix = [v.bos_id, *v.encode(context)]
            out = []
            for _ in range(n):
                at = self._retrievable(text, context, lo, q, kind, tries // max(1, n // 8))
                if at is None:
                    break
                private, answer = self._private(text, q, kind, at)
                meta = {"kind": kind, "fraction": prefix_len / s.prompt_length}
                out.append(Request(prefix + private, answer, prefix_len=prefix_len, group=group, meta=meta))
            if len(out) == n:
                return out
        raise RuntimeError(f"no file gave {n} retrievable {kind} requests with a {prefix_len}-token prefix")

    def training_batch(self, n: int, retrieval: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences (prompt + answer) of random kind and prefix length, and the answer positions.

        A ``retrieval`` share of them has an answer found in the context (the evaluated case); the
        rest are plain windows, which teach the language itself.
        """
        s = self.spec
        seqs: list[list[int]] = []
        while len(seqs) < n:
            p = self.rng.randint(1 + s.min_context, s.prompt_length - 1 - s.min_private)
            kind = self.rng.choice(KINDS)
            text = self.rng.choice(self.texts)
            c0, lo = self._window(text, p)
            q = s.prompt_length - p
            at: int | None = lo + self.rng.randrange(0, s.answer_length)
            if self.rng.random() < retrieval:
                at = self._retrievable(text, text[c0 : c0 + p - 1], lo, q, kind, 40)
            if at is None or at + s.answer_length + q > len(text):
                continue
            private, answer = self._private(text, q, kind, at)
            seqs.append([self.vocab.bos_id, *self.vocab.encode(text[c0 : c0 + p - 1]), *private, *answer])
        x = torch.tensor(seqs, dtype=torch.long)
        maskable = torch.zeros_like(x, dtype=torch.bool)
        maskable[:, s.prompt_length :] = True
        return x, maskable
