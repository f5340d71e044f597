"""sysprdict: system performance prediction.

Precision-aware training-time prediction and multimodal training-memory prediction from a per-layer
decomposition of transformers models, an out-of-memory guard, and (`sysprdict.blockchain`)
permissioned-blockchain performance prediction from scaling configurations.
"""

from .dataset import DatasetError, load_rows, save_rows
from .fit import FitResult, OutOfMemoryPredicted, check_fits, largest_batch
from .layers import PRECISIONS, Decomposition, LayerRecord, decompose
from .memory import MemoryPrediction, TrainSetup, accelerate_style, predict_memory
from .timepred import AnalyticalFlops, TimePredictor, allreduce_time_s
from .zoo import Shape, ZooModel, build, model_names

__version__ = "0.1.0"

__all__ = [
    "PRECISIONS",
    "AnalyticalFlops",
    "DatasetError",
    "Decomposition",
    "FitResult",
    "LayerRecord",
    "MemoryPrediction",
    "OutOfMemoryPredicted",
    "Shape",
    "TimePredictor",
    "TrainSetup",
    "ZooModel",
    "accelerate_style",
    "allreduce_time_s",
    "build",
    "check_fits",
    "decompose",
    "largest_batch",
    "load_rows",
    "model_names",
    "predict_memory",
    "save_rows",
    "__version__",
]
