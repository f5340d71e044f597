"""cona: online parallelism-strategy chaining for faster time-to-perplexity."""

from .chain import Chainer, Decision, Estimate, goodput
from .dist import RankFailure, launch, select_device
from .executor import Executor, FullState, StepResult, initial_state, load_state, save_state
from .gns import GnsSnapshot, GradientNoiseScale, unbiased_estimates
from .space import ModelDims, Strategy, StrategyError, check_strategy, enumerate_strategies, memory_per_rank_bytes

__version__ = "0.1.0"

__all__ = [
    "Chainer",
    "Decision",
    "Estimate",
    "Executor",
    "FullState",
    "GnsSnapshot",
    "GradientNoiseScale",
    "RankFailure",
    "StepResult",
    "ModelDims",
    "Strategy",
    "StrategyError",
    "check_strategy",
    "enumerate_strategies",
    "goodput",
    "initial_state",
    "launch",
    "load_state",
    "memory_per_rank_bytes",
    "save_state",
    "select_device",
    "unbiased_estimates",
    "__version__",
]
