"""xronos: heterogeneity-aware tensor parallelism for LLM fine-tuning on CPU devices.

The core is :mod:`xronos.partition` (uneven shard sizes from a per-rank cost model); the layers,
model sharding, profiling, training loops and launcher are the plumbing around it.
"""

from .baselines import DTensorTPTrainer, PipeliningTrainer
from .emulation import check_speeds, measure_kernel
from .launch import WorkerError, spawn
from .layers import ColumnParallelLinear, RowParallelLinear, clip_grad_norm, copy_to_tp, reduce_from_tp
from .partition import (
    ModelShape,
    Partition,
    PartitionError,
    RankCost,
    costs_from_speeds,
    even_partition,
    partition,
)
from .pretrained import PretrainedError, finetune_pretrained, inspect_checkpoint, load_sharded, save_merged
from .profile import costs_from_cluster, profile_group
from .rebalance import Rebalancer, repartition
from .shard import build_model, enable_lora, gather_state_dict, save_full, shard_model, tiny_config
from .train import PPTrainer, TPTrainer, TrainConfig

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "DTensorTPTrainer",
    "ModelShape",
    "PPTrainer",
    "PipeliningTrainer",
    "Partition",
    "PartitionError",
    "PretrainedError",
    "RankCost",
    "Rebalancer",
    "RowParallelLinear",
    "TPTrainer",
    "TrainConfig",
    "WorkerError",
    "build_model",
    "check_speeds",
    "clip_grad_norm",
    "copy_to_tp",
    "costs_from_cluster",
    "costs_from_speeds",
    "enable_lora",
    "even_partition",
    "finetune_pretrained",
    "gather_state_dict",
    "inspect_checkpoint",
    "load_sharded",
    "measure_kernel",
    "partition",
    "profile_group",
    "reduce_from_tp",
    "repartition",
    "save_full",
    "save_merged",
    "shard_model",
    "spawn",
    "tiny_config",
    "__version__",
]
