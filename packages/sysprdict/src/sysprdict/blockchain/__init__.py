"""Permissioned-blockchain (Hyperledger Fabric) performance prediction from scaling configurations.

Real data: Caliper reports (`load_caliper`) or the CSV schema (`read_csv`).  Without Fabric, the
documented discrete-event model (`fabricsim`) generates benchmark-shaped data labelled "simulated".
"""

from .caliper import CaliperError, load_caliper, parse_caliper_html, parse_caliper_json
from .fabricsim import FabricConfig, SimParams, simulate, simulate_dataset
from .models import FEATURES, PerfModel, featurize, grouped_cv, grouped_folds, mape, smape
from .recommend import Costs, Recommendation, recommend
from .schema import SchemaError, read_csv, validate_row, write_csv

__all__ = [
    "FEATURES",
    "CaliperError",
    "Costs",
    "FabricConfig",
    "PerfModel",
    "Recommendation",
    "SchemaError",
    "SimParams",
    "featurize",
    "grouped_cv",
    "grouped_folds",
    "load_caliper",
    "mape",
    "parse_caliper_html",
    "parse_caliper_json",
    "read_csv",
    "recommend",
    "simulate",
    "simulate_dataset",
    "smape",
    "validate_row",
    "write_csv",
]
