"""Jobs that may be stopped on purpose: termination models for the planner from a
hyper-parameter search (Optuna, ASHA-style schedulers) or from early stopping, and the
clean-up of stopped trials' checkpoints.

The Optuna integration is :mod:`coci_core.hpo.optuna` (``pip install 'coci[hpo]'``); the rest
needs no extra package.
"""

from coci_core.hpo.asha import asha_rungs
from coci_core.hpo.cleanup import delete_checkpoints
from coci_core.hpo.early_stopping import (
    improvement_probability,
    patience_stops,
    threshold_stops,
)
from coci_core.hpo.survival import StoppedRun, combine_terminations, kaplan_meier

__all__ = [
    "StoppedRun",
    "asha_rungs",
    "combine_terminations",
    "delete_checkpoints",
    "improvement_probability",
    "kaplan_meier",
    "patience_stops",
    "threshold_stops",
]
