"""fusionlab: which lowering of a normalization kernel is fastest on your device - and why."""

from fusionlab.api import make_plan, stored_cells, sweep
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import register_variant
from fusionlab.runtime import Dispatcher

__all__ = [
    "Dispatcher",
    "Status",
    "TrialRecord",
    "make_plan",
    "register_variant",
    "stored_cells",
    "sweep",
]
