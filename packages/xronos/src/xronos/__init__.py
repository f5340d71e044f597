"""xronos: heterogeneity-aware tensor parallelism for LLM fine-tuning on CPU devices."""

from .partition import (
    ModelShape,
    Partition,
    PartitionError,
    RankCost,
    costs_from_speeds,
    even_partition,
    partition,
)

__version__ = "0.1.0"

__all__ = [
    "ModelShape",
    "Partition",
    "PartitionError",
    "RankCost",
    "costs_from_speeds",
    "even_partition",
    "partition",
    "__version__",
]
