"""Sign compression of pseudo-gradients: 1 bit per parameter, a magnitude per chunk, a token count.

A worker's update ``x`` (a list of tensors) becomes one ``uint8`` buffer laid out as

    [tokens: int64][scales: float32 x n_chunks][signs: 1 bit per element, 8 per byte, MSB first]

where each chunk (``chunk_size`` consecutive elements of one tensor, or the whole tensor when
``chunk_size`` is None) is decoded as ``scale * sign(x)`` with ``scale = mean(|x|)`` over the chunk:
the L2-optimal magnitude for a fixed sign pattern. Decoding is exact: every worker that decodes the
same buffer gets bit-identical tensors, which is what makes the outer step identical everywhere.

Error feedback (``SignCompressor``) adds what the previous round's sign dropped before compressing,
so the running sum of decoded updates stays within a bounded distance of the true running sum
(the residual is the only gap) instead of drifting away from it.

With ``rotate=True`` the signs are taken in a rotated basis: every element is multiplied by a fixed
random +-1 diagonal D and every chunk whose length is a power of two by a normalised Walsh-Hadamard
matrix H (``y = H D x``, orthogonal), coded as ``scale * sign(y)`` exactly as above, and rotated
back on decode (``x = D H y``). D comes from ``seed``, the same on every worker, so the rotation
costs no bytes; error feedback keeps its residual in the rotated basis and the token-weighted mean
of all workers' buffers is summed there (``decode_mean``), so a sync rotates back only once. Why: late in training a chunk of a pseudo-gradient is heavy-tailed (many
near-zero entries, a few large ones), and coordinate-wise sign coding gives every near-zero entry
the chunk's full magnitude; the rotation makes a chunk's coordinates near-Gaussian and spreads the
quantization error evenly over the chunk instead (the randomized-Hadamard step of DRIVE, Vargaftik
et al. 2021). Same bits on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["pack_signs", "unpack_signs", "SignCodec", "SignCompressor", "contraction", "hadamard"]

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.int32)
_TOKENS_BYTES = 8


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of ``x`` (1 for >= 0, 0 for < 0) packed 8 per byte, most significant bit first."""
    bits = (x.detach().reshape(-1) >= 0).to(torch.int32)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) << _SHIFTS.to(bits.device)).sum(dim=1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` bits of ``packed`` as a bool tensor (True where the element was >= 0)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, not {packed.dtype}")
    if numel < 0 or math.ceil(numel / 8) > packed.numel():
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes")
    bits = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1)[:numel].bool()


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform of each row of ``x`` (rows of a power-of-two length n):
    ``x @ H / sqrt(n)``; orthogonal and its own inverse."""
    rows, n = x.shape
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two row length, not {n}")
    y, h = x, 1
    while h < n:
        y = y.reshape(rows, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(rows, n) / math.sqrt(n)


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def contraction(x: torch.Tensor, chunk_size: int | None = None) -> float:
    """delta = min over chunks of ||x_c||_1^2 / (n_c ||x_c||_2^2): ||x - C(x)||^2 <= (1 - delta) ||x||^2."""
    flat = x.detach().reshape(-1).double()
    size = flat.numel() if chunk_size is None else chunk_size
    worst = 1.0
    for c in flat.split(size):
        sq = float((c * c).sum())
        if sq > 0:
            worst = min(worst, float(c.abs().sum()) ** 2 / (c.numel() * sq))
    return worst


@dataclass(frozen=True)
class _Layout:
    numels: tuple[int, ...]
    chunks: tuple[int, ...]  # chunks per tensor


class SignCodec:
    """Encodes a fixed list of tensor shapes into one uint8 buffer and back (see module doc).

    The work is done on one flat float32 vector of all elements in the *coded basis* (the tensors'
    own values, or their per-chunk rotation when ``rotate``): ``to_coded`` / ``from_coded`` move
    between tensors and that vector, ``encode_coded`` / ``decode_coded`` between it and the buffer.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size | Sequence[int]],
        chunk_size: int | None = 4096,
        scale: str = "mean",
        rotate: bool = False,
        seed: int = 0,
    ):
        if scale not in ("mean", "rms"):
            raise ValueError(f"scale must be 'mean' (L2-optimal, mean |x|) or 'rms' (norm-preserving), not {scale!r}")
        self.scale = scale
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(
                f"chunk_size must be a positive integer or None (one scale per tensor), not {chunk_size!r}"
            )
        if rotate and chunk_size is not None and not _pow2(chunk_size):
            raise ValueError(f"chunk_size must be a power of two with rotate=True (a Hadamard block), not {chunk_size}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.chunk_size = chunk_size
        numels = tuple(int(math.prod(s)) for s in self.shapes)
        chunks = tuple(1 if (chunk_size is None or n == 0) else math.ceil(n / chunk_size) for n in numels)
        self.layout = _Layout(numels, chunks)
        self.numel = sum(numels)
        self.n_chunks = sum(chunks)
        self.sign_bytes = math.ceil(self.numel / 8)
        self.nbytes = _TOKENS_BYTES + 4 * self.n_chunks + self.sign_bytes
        self.rotate = bool(rotate)
        self.seed = int(seed)
        self._offsets = [0]
        for n in numels:
            self._offsets.append(self._offsets[-1] + n)
        # rotate: the +-1 diagonal D over the whole flat vector, from ``seed`` (the same on every
        # worker; every chunk gets its own signs, so chunks of similar content do not share their
        # quantization errors), and the Hadamard blocks grouped by length: {n: [(start, count)]},
        # ``count`` consecutive blocks of n elements from flat offset ``start``
        self._diag = torch.zeros(0)
        self._blocks: dict[int, list[tuple[int, int]]] = {}
        if self.rotate:
            gen = torch.Generator().manual_seed(self.seed)
            self._diag = torch.randint(0, 2, (self.numel,), generator=gen).float() * 2 - 1
            for off, n, c in zip(self._offsets, numels, chunks):
                size = n if c == 1 or chunk_size is None else chunk_size
                full = n // size if n and _pow2(size) else 0
                if full:
                    self._blocks.setdefault(size, []).append((off, full))
                tail = n - full * size if full else 0
                if tail and _pow2(tail):
                    self._blocks.setdefault(tail, []).append((off + full * size, 1))

    # --- tensors <-> the flat vector in the coded basis -------------------------------------------
    def _hadamard_blocks(self, z: torch.Tensor) -> None:
        """Replace every block of ``z`` (flat, owned by the caller) by its Hadamard transform, in place."""
        for n, runs in self._blocks.items():
            rows = torch.cat([z[s : s + c * n] for s, c in runs]).view(-1, n)
            out = hadamard(rows)
            k = 0
            for s, c in runs:
                z[s : s + c * n] = out[k : k + c].reshape(-1)
                k += c

    def to_coded(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """All tensors as one flat float32 vector in the coded basis (y = H D x per block when rotating)."""
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
        if self.rotate:
            flat = flat * self._diag.to(flat.device)
            self._hadamard_blocks(flat)
        return flat

    def from_coded(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors (float32) of a flat vector in the coded basis (x = D H y per block when rotating)."""
        if self.rotate:
            flat = flat.clone()
            self._hadamard_blocks(flat)
            flat = flat * self._diag.to(flat.device)
        return [flat[a:b].view(shape) for a, b, shape in zip(self._offsets, self._offsets[1:], self.shapes)]

    # --- the flat coded vector <-> the buffer ------------------------------------------------------
    def _scales(self, t: torch.Tensor, n_chunks: int) -> torch.Tensor:
        flat = t.detach().reshape(-1).float()
        if n_chunks == 1:
            if not flat.numel():
                return flat.new_zeros(1)
            return (flat.abs().mean() if self.scale == "mean" else flat.square().mean().sqrt()).reshape(1)
        size = self.chunk_size
        assert size is not None  # a tensor has several chunks only with a chunk size
        pad = n_chunks * size - flat.numel()
        mag = flat.abs() if self.scale == "mean" else flat.square()
        padded = torch.cat([mag, flat.new_zeros(pad)]).view(n_chunks, size)
        counts = torch.full((n_chunks,), float(size), device=flat.device)
        counts[-1] = size - pad
        out = padded.sum(dim=1) / counts
        return out if self.scale == "mean" else out.sqrt()

    def _expand(self, scales: torch.Tensor, numel: int, n_chunks: int) -> torch.Tensor:
        if n_chunks == 1:
            return scales.expand(numel)
        assert self.chunk_size is not None  # a tensor has several chunks only with a chunk size
        return scales.repeat_interleave(self.chunk_size)[:numel]

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        got = [tuple(t.shape) for t in tensors]
        want = [tuple(s) for s in self.shapes]
        if got != want:
            raise ValueError(
                f"tensors have shapes {got[:4]}... but the codec was built for {want[:4]}... ({len(want)} tensors)"
            )

    def encode_coded(self, flat: torch.Tensor, tokens: int = 0) -> torch.Tensor:
        """The buffer of a flat vector already in the coded basis (see ``to_coded``)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, not {tokens}")
        if flat.numel() != self.numel:
            raise ValueError(f"flat vector has {flat.numel()} elements, the codec {self.numel}")
        dev = flat.device
        scales = [self._scales(flat[a:b], c) for a, b, c in zip(self._offsets, self._offsets[1:], self.layout.chunks)]
        parts = [
            torch.tensor([int(tokens)], dtype=torch.int64, device=dev).view(torch.uint8),
            torch.cat(scales).float().contiguous().view(torch.uint8)
            if scales
            else torch.zeros(0, dtype=torch.uint8, device=dev),
            pack_signs(flat),
        ]
        return torch.cat(parts)

    def encode(self, tensors: Sequence[torch.Tensor], tokens: int = 0) -> torch.Tensor:
        """One uint8 buffer of ``nbytes`` holding the token count, the scales and the packed signs."""
        self.check(tensors)
        return self.encode_coded(self.to_coded(tensors), tokens)

    def tokens_of(self, buf: torch.Tensor) -> int:
        """The token count stored in a buffer."""
        self._check_buf(buf)
        return int(buf[:_TOKENS_BYTES].contiguous().view(torch.int64)[0])

    def _check_buf(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.numel() != self.nbytes:
            raise ValueError(f"buffer must be {self.nbytes} uint8 bytes for this codec, got {buf.numel()} {buf.dtype}")

    def decode_coded(self, buf: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The decoded flat vector in the coded basis (``scale * +-1`` per element) and the token count."""
        self._check_buf(buf)
        buf = buf.contiguous()
        tokens = int(buf[:_TOKENS_BYTES].view(torch.int64)[0])
        off = _TOKENS_BYTES
        scales = buf[off : off + 4 * self.n_chunks].view(torch.float32)
        off += 4 * self.n_chunks
        signs = unpack_signs(buf[off:], self.numel)
        mags = []
        s_off = 0
        for n, c in zip(self.layout.numels, self.layout.chunks):
            mags.append(self._expand(scales[s_off : s_off + c], n, c))
            s_off += c
        mag = torch.cat(mags) if mags else torch.zeros(0, device=buf.device)
        return torch.where(signs, mag, -mag), tokens

    def decode(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """The decoded tensors (float32) and the token count of a buffer."""
        flat, tokens = self.decode_coded(buf)
        return self.from_coded(flat), tokens

    def decode_mean(self, bufs: Sequence[torch.Tensor], weights: Sequence[float]) -> list[torch.Tensor]:
        """sum_k weights[k] * decode(bufs[k]), summed in the coded basis (in list order, so the result
        is bit-identical on every worker) and rotated back once."""
        if len(bufs) != len(weights):
            raise ValueError(f"{len(bufs)} buffers but {len(weights)} weights")
        acc = None
        for b, w in zip(bufs, weights):
            flat, _ = self.decode_coded(b)
            acc = flat * w if acc is None else acc.add_(flat, alpha=w)
        if acc is None:
            raise ValueError("decode_mean needs at least one buffer")
        return self.from_coded(acc)


def _stats(update: torch.Tensor, target: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """Norms and cosine of one compression round (flat vectors in the coded basis: same norms)."""
    t, d = target.double(), decoded.double()
    n_t, n_d = float(t.norm()), float(d.norm())
    return {
        "update_norm": float(update.double().norm()),
        "target_norm": n_t,
        "residual_norm": float((t - d).norm()),
        "cosine": float((t * d).sum()) / (n_t * n_d) if n_t > 0 and n_d > 0 else 0.0,
    }


class SignCompressor:
    """A ``SignCodec`` with error feedback: what the sign dropped this round is added next round.

    The residual is kept in the codec's coded basis (with ``rotate``, the rotation is orthogonal, so
    it has the same norm as in the tensors' own basis); ``errors`` gives it as tensors.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size | Sequence[int]],
        chunk_size: int | None = 4096,
        error_feedback: bool = True,
        scale: str = "mean",
        ef_decay: float = 1.0,
        rotate: bool = False,
        seed: int = 0,
    ):
        if not 0.0 <= ef_decay <= 1.0:
            raise ValueError(f"ef_decay must be in [0, 1] (1 carries the whole residual), not {ef_decay!r}")
        self.codec = SignCodec(shapes, chunk_size, scale, rotate=rotate, seed=seed)
        self.error_feedback = error_feedback
        self.ef_decay = ef_decay
        self.residual = torch.zeros(self.codec.numel)  # flat, coded basis
        # diagnostics of the last ``compress``: norms of the update, of what was encoded (update +
        # carried residual) and of the new residual, and the cosine of decoded vs encoded
        self.last_stats: dict[str, float] = {}

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes

    @property
    def errors(self) -> list[torch.Tensor]:
        """The carried residual as tensors of the codec's shapes."""
        return [e.clone() for e in self.codec.from_coded(self.residual)]

    def compress(self, tensors: Sequence[torch.Tensor], tokens: int = 0) -> torch.Tensor:
        """Encode ``tensors + residual``; the new residual is what the decoded buffer misses."""
        self.codec.check(tensors)
        update = self.codec.to_coded(tensors)
        target = update + self.ef_decay * self.residual.to(update.device) if self.error_feedback else update
        buf = self.codec.encode_coded(target, tokens)
        decoded, _ = self.codec.decode_coded(buf)
        if self.error_feedback:
            self.residual = target - decoded
        self.last_stats = _stats(update, target, decoded)
        return buf

    def decode(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        return self.codec.decode(buf)

    def decode_mean(self, bufs: Sequence[torch.Tensor], weights: Sequence[float]) -> list[torch.Tensor]:
        return self.codec.decode_mean(bufs, weights)

    def state_dict(self) -> dict:
        return {
            "errors": self.errors,
            "residual": self.residual.clone(),
            "chunk_size": self.codec.chunk_size,
            "rotate": self.codec.rotate,
            "seed": self.codec.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        errors = state["errors"]
        if [tuple(e.shape) for e in errors] != [tuple(s) for s in self.codec.shapes]:
            raise ValueError("error-feedback state does not match this model's parameter shapes")
        basis = (state.get("rotate", False), state.get("seed", 0), state.get("chunk_size", self.codec.chunk_size))
        same_basis = basis == (self.codec.rotate, self.codec.seed, self.codec.chunk_size)
        if "residual" in state and same_basis:
            self.residual = state["residual"].clone().float()  # bit-exact
        else:
            self.residual = self.codec.to_coded([e.float() for e in errors])
