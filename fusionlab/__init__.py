"""fusionlab: which lowering of a normalization kernel is fastest on your device - and why."""

from fusionlab import _checkout  # noqa: F401  (first: it finds kernels/ and search/)
from fusionlab.api import stored_cells, sweep
from fusionlab.model import (
    Capture,
    PatchHandle,
    backend,
    capture,
    causal_lm_steps,
    patch,
    tiny_model,
)
from fusionlab.op import OpSpec, Tolerance
from fusionlab.plan import make_plan
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import register_op, register_variant
from fusionlab.runtime import Dispatcher

__all__ = [
    "Capture",
    "Dispatcher",
    "OpSpec",
    "PatchHandle",
    "Status",
    "Tolerance",
    "TrialRecord",
    "backend",
    "capture",
    "causal_lm_steps",
    "make_plan",
    "patch",
    "register_op",
    "register_variant",
    "stored_cells",
    "sweep",
    "tiny_model",
]
