"""geomesh: workload-balanced, sign-compressed geo-distributed training (DiLoCo family)."""

from .balance import (
    BalanceError,
    MemoryModel,
    PhaseClock,
    Plan,
    Rebalancer,
    WorkerPlan,
    WorkerProfile,
    fit_profile,
    plan,
    profiles_from_cluster,
    token_weights,
    uniform_plan,
)
from .diloco import COMPRESSIONS, DiLoCo, GeoMeshError, SyncStats
from .launch import LaunchError, free_port, init_from_env, spawn
from .netns import WAN_MODES, NetnsError, NetnsWan, WanDecision, wan_mode
from .quorum import Quorum
from .signcompress import SignCodec, SignCompressor, contraction, pack_signs, unpack_signs
from .signreduce import SignReduceScatter
from .wan import COLLECTIVES, WanEmulator, collective_hops, ring_wire_bytes

__version__ = "0.1.0"

__all__ = [
    "COMPRESSIONS",
    "DiLoCo",
    "GeoMeshError",
    "LaunchError",
    "SyncStats",
    "free_port",
    "init_from_env",
    "spawn",
    "WanEmulator",
    "NetnsWan",
    "NetnsError",
    "WanDecision",
    "WAN_MODES",
    "wan_mode",
    "ring_wire_bytes",
    "SignReduceScatter",
    "Quorum",
    "collective_hops",
    "COLLECTIVES",
    "BalanceError",
    "MemoryModel",
    "Plan",
    "PhaseClock",
    "Rebalancer",
    "WorkerPlan",
    "WorkerProfile",
    "fit_profile",
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
