"""sysprdict: system performance prediction.

Precision-aware training-time prediction and training-memory prediction (the tensors plus what the
runtime adds, checked against the process's real peak) from a per-layer decomposition of any
transformers model (a model, a config built on the meta device, or a local directory), an
out-of-memory guard, and (`sysprdict.blockchain`) permissioned-blockchain performance prediction
from scaling configurations.

The names below load their module (and torch) on first use, so the command line answers bad input
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:  # the names as type checkers see them; at run time each loads on first use
    from .api import UnsupportedModelError, load_model, predict_memory, predict_time  # noqa: F401
    from .dataset import DatasetError, load_rows, save_rows  # noqa: F401
    from .fit import FitResult, OutOfMemoryPredicted, check_fits, largest_batch  # noqa: F401
    from .groundtruth import GroundTruthError, Measurement  # noqa: F401
    from .layers import PRECISIONS, Decomposition, LayerRecord, decompose  # noqa: F401
    from .memory import MemoryPrediction, TrainSetup, accelerate_style  # noqa: F401
    from .overhead import RuntimeOverhead, fit_overhead  # noqa: F401
    from .split import strict_split  # noqa: F401
    from .timepred import AnalyticalFlops, TimePredictor, allreduce_time_s  # noqa: F401
    from .zoo import Shape, ZooModel, build, model_names  # noqa: F401

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "api": ["UnsupportedModelError", "load_model", "predict_memory", "predict_time"],
        "dataset": ["DatasetError", "load_rows", "save_rows"],
        "fit": ["FitResult", "OutOfMemoryPredicted", "check_fits", "largest_batch"],
        "layers": ["PRECISIONS", "Decomposition", "LayerRecord", "decompose"],
        "groundtruth": ["GroundTruthError", "Measurement"],
        "memory": ["MemoryPrediction", "TrainSetup", "accelerate_style"],
        "overhead": ["RuntimeOverhead", "fit_overhead"],
        "split": ["strict_split"],
        "timepred": ["AnalyticalFlops", "TimePredictor", "allreduce_time_s"],
        "zoo": ["Shape", "ZooModel", "build", "model_names"],
    },
)
__all__ += ["__version__"]
