"""cona: online parallelism-strategy chaining for faster time-to-perplexity."""

from .chain import Chainer, Decision, Estimate, goodput
from .gns import GnsSnapshot, GradientNoiseScale, unbiased_estimates
from .space import ModelDims, Strategy, StrategyError, check_strategy, enumerate_strategies, memory_per_rank_bytes

__version__ = "0.1.0"

__all__ = [
    "Chainer",
    "Decision",
    "Estimate",
    "GnsSnapshot",
    "GradientNoiseScale",
    "ModelDims",
    "Strategy",
    "StrategyError",
    "check_strategy",
    "enumerate_strategies",
    "goodput",
    "memory_per_rank_bytes",
    "unbiased_estimates",
    "__version__",
]
