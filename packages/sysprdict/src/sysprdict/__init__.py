"""sysprdict: system performance prediction.

Precision-aware training-time prediction and multimodal training-memory prediction from a per-layer
decomposition of transformers models, an out-of-memory guard, and (`sysprdict.blockchain`)
permissioned-blockchain performance prediction from scaling configurations.

The names below load their module (and torch) on first use, so the command line answers bad input
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataset import DatasetError, load_rows, save_rows
    from .fit import FitResult, OutOfMemoryPredicted, check_fits, largest_batch
    from .layers import PRECISIONS, Decomposition, LayerRecord, decompose
    from .memory import MemoryPrediction, TrainSetup, accelerate_style, predict_memory
    from .timepred import AnalyticalFlops, TimePredictor, allreduce_time_s
    from .zoo import Shape, ZooModel, build, model_names

__version__ = "0.1.0"

_MODULE_OF = {
    "DatasetError": "dataset",
    "load_rows": "dataset",
    "save_rows": "dataset",
    "FitResult": "fit",
    "OutOfMemoryPredicted": "fit",
    "check_fits": "fit",
    "largest_batch": "fit",
    "PRECISIONS": "layers",
    "Decomposition": "layers",
    "LayerRecord": "layers",
    "decompose": "layers",
    "MemoryPrediction": "memory",
    "TrainSetup": "memory",
    "accelerate_style": "memory",
    "predict_memory": "memory",
    "AnalyticalFlops": "timepred",
    "TimePredictor": "timepred",
    "allreduce_time_s": "timepred",
    "Shape": "zoo",
    "ZooModel": "zoo",
    "build": "zoo",
    "model_names": "zoo",
}

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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sysprdict' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
