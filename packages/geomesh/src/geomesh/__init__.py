"""geomesh: workload-balanced, sign-compressed geo-distributed training (DiLoCo family)."""

from .signcompress import SignCodec, SignCompressor, contraction, pack_signs, unpack_signs

__version__ = "0.1.0"

__all__ = ["SignCodec", "SignCompressor", "contraction", "pack_signs", "unpack_signs", "__version__"]
