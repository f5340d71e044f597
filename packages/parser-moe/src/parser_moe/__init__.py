"""parser-moe: compress MoE experts into a shared base plus residuals kept by output importance.

The names below load their module (and torch) on first use, so the command line answers bad input
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:  # the names as type checkers see them; at run time each loads on first use
    from .base import BASE_METHODS, Decomposition, aligned_barycenter, decompose, mean_base  # noqa: F401
    from .calibrate import CalibrationData, CalibrationError, LayerCalibration, Reservoir, calibrate  # noqa: F401
    from .compressed import (  # noqa: F401
        CompressedExpertList,
        CompressedExperts,
        compressed_modules,
        load_compressed,
        save_compressed,
    )
    from .hf import ParserMoeConfig, ParserMoeForCausalLM  # noqa: F401
    from .importance import (  # noqa: F401
        check_keep_ratio,
        element_scores_from_units,
        layer_output_importance,
        select_elements,
        select_units,
        unit_output_importance,
    )
    from .models import ExpertWeights, MoELayer, NoMoEError, find_moe_layers, module_bytes  # noqa: F401
    from .pipeline import METHODS, Plan, compress_model, prepare  # noqa: F401
    from .scoring import REFERENCE, VARIANTS, Scoring  # noqa: F401
    from .tasks import build_tasks, run_tasks  # noqa: F401
    from .verify import literal_unit_scores, reference_matches_formula  # noqa: F401
    from .zoo import load_seed  # noqa: F401

__version__ = "0.1.0"

# lazy_loader keeps ``parser_moe.calibrate`` the function after ``import parser_moe.calibrate``
# (the import machinery would bind the submodule of the same name over it)
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "base": ["BASE_METHODS", "Decomposition", "aligned_barycenter", "decompose", "mean_base"],
        "calibrate": ["CalibrationData", "CalibrationError", "LayerCalibration", "Reservoir", "calibrate"],
        "compressed": [
            "CompressedExpertList",
            "CompressedExperts",
            "compressed_modules",
            "load_compressed",
            "save_compressed",
        ],
        "hf": ["ParserMoeConfig", "ParserMoeForCausalLM"],
        "importance": [
            "check_keep_ratio",
            "element_scores_from_units",
            "layer_output_importance",
            "select_elements",
            "select_units",
            "unit_output_importance",
        ],
        "models": ["ExpertWeights", "MoELayer", "NoMoEError", "find_moe_layers", "module_bytes"],
        "pipeline": ["METHODS", "Plan", "compress_model", "prepare"],
        "scoring": ["REFERENCE", "VARIANTS", "Scoring"],
        "tasks": ["build_tasks", "run_tasks"],
        "verify": ["literal_unit_scores", "reference_matches_formula"],
        "zoo": ["load_seed"],
    },
)
__all__ += ["__version__"]
