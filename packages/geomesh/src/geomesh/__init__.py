"""geomesh: workload-balanced, sign-compressed geo-distributed training (DiLoCo family)."""

from .balance import (
    BalanceError,
    MemoryModel,
    Plan,
    Rebalancer,
    WorkerPlan,
    WorkerProfile,
    plan,
    profiles_from_cluster,
    token_weights,
    uniform_plan,
)
from .signcompress import SignCodec, SignCompressor, contraction, pack_signs, unpack_signs

__version__ = "0.1.0"

__all__ = [
    "BalanceError",
    "MemoryModel",
    "Plan",
    "Rebalancer",
    "WorkerPlan",
    "WorkerProfile",
    "plan",
    "profiles_from_cluster",
    "token_weights",
    "uniform_plan",
    "SignCodec",
    "SignCompressor",
    "contraction",
    "pack_signs",
    "unpack_signs",
    "__version__",
]
