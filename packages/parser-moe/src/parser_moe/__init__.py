"""parser-moe: compress MoE experts into a shared base plus residuals kept by output importance."""

from .base import BASE_METHODS, Decomposition, aligned_barycenter, decompose, mean_base
from .calibrate import CalibrationData, CalibrationError, LayerCalibration, Reservoir, calibrate
from .compressed import (
    CompressedExpertList,
    CompressedExperts,
    compressed_modules,
    load_compressed,
    save_compressed,
)
from .importance import (
    check_keep_ratio,
    element_scores_from_units,
    layer_output_importance,
    select_elements,
    select_units,
    unit_output_importance,
)
from .models import ExpertWeights, MoELayer, NoMoEError, find_moe_layers, module_bytes
from .pipeline import METHODS, Plan, compress_model, prepare

__version__ = "0.1.0"

__all__ = [
    "BASE_METHODS",
    "METHODS",
    "CalibrationData",
    "CalibrationError",
    "CompressedExpertList",
    "CompressedExperts",
    "Decomposition",
    "ExpertWeights",
    "LayerCalibration",
    "MoELayer",
    "NoMoEError",
    "Plan",
    "Reservoir",
    "aligned_barycenter",
    "calibrate",
    "check_keep_ratio",
    "compress_model",
    "compressed_modules",
    "decompose",
    "element_scores_from_units",
    "find_moe_layers",
    "layer_output_importance",
    "load_compressed",
    "mean_base",
    "module_bytes",
    "prepare",
    "save_compressed",
    "select_elements",
    "select_units",
    "unit_output_importance",
    "__version__",
]
