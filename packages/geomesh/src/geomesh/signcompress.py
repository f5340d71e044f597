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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["pack_signs", "unpack_signs", "SignCodec", "SignCompressor", "contraction"]

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
    """Encodes a fixed list of tensor shapes into one uint8 buffer and back (see module doc)."""

    def __init__(
        self, shapes: Sequence[torch.Size | Sequence[int]], chunk_size: int | None = 4096, scale: str = "mean"
    ):
        if scale not in ("mean", "rms"):
            raise ValueError(f"scale must be 'mean' (L2-optimal, mean |x|) or 'rms' (norm-preserving), not {scale!r}")
        self.scale = scale
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(
                f"chunk_size must be a positive integer or None (one scale per tensor), not {chunk_size!r}"
            )
        self.shapes = [torch.Size(s) for s in shapes]
        self.chunk_size = chunk_size
        numels = tuple(int(math.prod(s)) for s in self.shapes)
        chunks = tuple(1 if (chunk_size is None or n == 0) else math.ceil(n / chunk_size) for n in numels)
        self.layout = _Layout(numels, chunks)
        self.numel = sum(numels)
        self.n_chunks = sum(chunks)
        self.sign_bytes = math.ceil(self.numel / 8)
        self.nbytes = _TOKENS_BYTES + 4 * self.n_chunks + self.sign_bytes

    def _scales(self, t: torch.Tensor, n_chunks: int) -> torch.Tensor:
        flat = t.detach().reshape(-1).float()
        if n_chunks == 1:
            if not flat.numel():
                return flat.new_zeros(1)
            return (flat.abs().mean() if self.scale == "mean" else flat.square().mean().sqrt()).reshape(1)
        size = self.chunk_size
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
        return scales.repeat_interleave(self.chunk_size)[:numel]

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        got = [tuple(t.shape) for t in tensors]
        want = [tuple(s) for s in self.shapes]
        if got != want:
            raise ValueError(
                f"tensors have shapes {got[:4]}... but the codec was built for {want[:4]}... ({len(want)} tensors)"
            )

    def encode(self, tensors: Sequence[torch.Tensor], tokens: int = 0) -> torch.Tensor:
        """One uint8 buffer of ``nbytes`` holding the token count, the scales and the packed signs."""
        self.check(tensors)
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, not {tokens}")
        scales = [self._scales(t, c) for t, c in zip(tensors, self.layout.chunks)]
        dev = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
        parts = [
            torch.tensor([int(tokens)], dtype=torch.int64, device=dev).view(torch.uint8),
            torch.cat(scales).float().contiguous().view(torch.uint8)
            if scales
            else torch.zeros(0, dtype=torch.uint8, device=dev),
            pack_signs(flat),
        ]
        return torch.cat(parts)

    def decode(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """The decoded tensors (float32, ``scale * +-1``) and the token count of a buffer."""
        if buf.dtype != torch.uint8 or buf.numel() != self.nbytes:
            raise ValueError(f"buffer must be {self.nbytes} uint8 bytes for this codec, got {buf.numel()} {buf.dtype}")
        buf = buf.contiguous()
        tokens = int(buf[:_TOKENS_BYTES].view(torch.int64)[0])
        off = _TOKENS_BYTES
        scales = buf[off : off + 4 * self.n_chunks].view(torch.float32)
        off += 4 * self.n_chunks
        signs = unpack_signs(buf[off:], self.numel)
        out = []
        s_off = e_off = 0
        for shape, n, c in zip(self.shapes, self.layout.numels, self.layout.chunks):
            mag = self._expand(scales[s_off : s_off + c], n, c)
            sgn = signs[e_off : e_off + n]
            out.append(torch.where(sgn, mag, -mag).reshape(shape))
            s_off += c
            e_off += n
        return out, tokens


class SignCompressor:
    """A ``SignCodec`` with error feedback: what the sign dropped this round is added next round."""

    def __init__(
        self,
        shapes: Sequence[torch.Size | Sequence[int]],
        chunk_size: int | None = 4096,
        error_feedback: bool = True,
        scale: str = "mean",
        ef_decay: float = 1.0,
    ):
        if not 0.0 <= ef_decay <= 1.0:
            raise ValueError(f"ef_decay must be in [0, 1] (1 carries the whole residual), not {ef_decay!r}")
        self.codec = SignCodec(shapes, chunk_size, scale)
        self.error_feedback = error_feedback
        self.ef_decay = ef_decay
        self.errors = [torch.zeros(s) for s in self.codec.shapes]

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes

    def compress(self, tensors: Sequence[torch.Tensor], tokens: int = 0) -> torch.Tensor:
        """Encode ``tensors + residual``; the new residual is what the decoded buffer misses."""
        self.codec.check(tensors)
        if self.error_feedback:
            target = [t.detach().float() + self.ef_decay * e.to(t.device) for t, e in zip(tensors, self.errors)]
        else:
            target = [t.detach().float() for t in tensors]
        buf = self.codec.encode(target, tokens)
        if self.error_feedback:
            decoded, _ = self.codec.decode(buf)
            self.errors = [x - d for x, d in zip(target, decoded)]
        return buf

    def decode(self, buf: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        return self.codec.decode(buf)

    def state_dict(self) -> dict:
        return {"errors": [e.clone() for e in self.errors], "chunk_size": self.codec.chunk_size}

    def load_state_dict(self, state: dict) -> None:
        errors = state["errors"]
        if [tuple(e.shape) for e in errors] != [tuple(s) for s in self.codec.shapes]:
            raise ValueError("error-feedback state does not match this model's parameter shapes")
        self.errors = [e.clone().float() for e in errors]
