"""The conformance matrix: features x model shapes x backends, each cell compared with ``sp``.

    python -m framework.conformance BACKEND [--import MODULE] [--all] [--features a,b] [--models x,y]

See ``docs/backends.md``. Features and model shapes register themselves
(:func:`register_feature`, :func:`register_model`); backends are every registered one.
:func:`conformance` returns the rows; :func:`format_table` prints them.
"""

from framework.conformance import (  # noqa: F401
    features_evaluation,
    features_probes,
    features_resume,
    features_scaling,
    features_training,
    pipeline_rows,
    zoo,
    zoo_layouts,
)
from framework.conformance.compare import Row
from framework.conformance.matrix import KNOWN_SEAMS, all_cells, covering, quick_cells
from framework.conformance.registry import FEATURES, MODELS, Feature, register_feature, register_model
from framework.conformance.runner import conformance, format_table

CHECKS = {name: feature.run for name, feature in FEATURES.items()}
"""Deprecated: the features' run functions by name (use :data:`FEATURES`)."""

__all__ = [
    "CHECKS",
    "FEATURES",
    "KNOWN_SEAMS",
    "MODELS",
    "Feature",
    "Row",
    "all_cells",
    "conformance",
    "covering",
    "format_table",
    "quick_cells",
    "register_feature",
    "register_model",
]
