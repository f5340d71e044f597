"""parser-moe: compress MoE experts into a shared base plus residuals kept by output importance.

The names below load their module (and torch) on first use, so the command line answers bad input
without importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import BASE_METHODS, Decomposition, aligned_barycenter, decompose, mean_base
    from .calibrate import CalibrationData, CalibrationError, LayerCalibration, Reservoir, calibrate
    from .compressed import (
        CompressedExpertList,
        CompressedExperts,
        compressed_modules,
        load_compressed,
        save_compressed,
    )
    from .hf import ParserMoeConfig, ParserMoeForCausalLM
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
    from .scoring import REFERENCE, VARIANTS, Scoring
    from .tasks import build_tasks, run_tasks
    from .verify import literal_unit_scores, reference_matches_formula
    from .zoo import load_seed

__version__ = "0.1.0"

_MODULE_OF = {
    "BASE_METHODS": "base",
    "Decomposition": "base",
    "aligned_barycenter": "base",
    "decompose": "base",
    "mean_base": "base",
    "CalibrationData": "calibrate",
    "CalibrationError": "calibrate",
    "LayerCalibration": "calibrate",
    "Reservoir": "calibrate",
    "calibrate": "calibrate",
    "CompressedExpertList": "compressed",
    "CompressedExperts": "compressed",
    "compressed_modules": "compressed",
    "load_compressed": "compressed",
    "save_compressed": "compressed",
    "check_keep_ratio": "importance",
    "element_scores_from_units": "importance",
    "layer_output_importance": "importance",
    "select_elements": "importance",
    "select_units": "importance",
    "unit_output_importance": "importance",
    "ExpertWeights": "models",
    "MoELayer": "models",
    "NoMoEError": "models",
    "find_moe_layers": "models",
    "module_bytes": "models",
    "METHODS": "pipeline",
    "Plan": "pipeline",
    "compress_model": "pipeline",
    "prepare": "pipeline",
    "ParserMoeConfig": "hf",
    "ParserMoeForCausalLM": "hf",
    "REFERENCE": "scoring",
    "VARIANTS": "scoring",
    "Scoring": "scoring",
    "build_tasks": "tasks",
    "run_tasks": "tasks",
    "literal_unit_scores": "verify",
    "reference_matches_formula": "verify",
    "load_seed": "zoo",
}

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
    "ParserMoeConfig",
    "ParserMoeForCausalLM",
    "Plan",
    "REFERENCE",
    "Reservoir",
    "Scoring",
    "VARIANTS",
    "aligned_barycenter",
    "build_tasks",
    "calibrate",
    "check_keep_ratio",
    "compress_model",
    "compressed_modules",
    "decompose",
    "element_scores_from_units",
    "find_moe_layers",
    "layer_output_importance",
    "literal_unit_scores",
    "load_compressed",
    "load_seed",
    "mean_base",
    "module_bytes",
    "prepare",
    "reference_matches_formula",
    "run_tasks",
    "save_compressed",
    "select_elements",
    "select_units",
    "unit_output_importance",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'parser_moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


class _Package(types.ModuleType):
    """Keeps ``parser_moe.calibrate`` the function: importing a submodule binds it on its package,
    which would hide the public function of the same name (the eager imports rebound it at once)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _MODULE_OF:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
