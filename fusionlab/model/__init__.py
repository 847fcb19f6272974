"""fusionlab in a model: capture its norm calls, patch in the winners, prove the gain end to end."""

from fusionlab.model.capture import Capture, capture
from fusionlab.model.fusion_pass import backend
from fusionlab.model.models import causal_lm_steps, tiny_model
from fusionlab.model.patch import PatchHandle, patch

__all__ = ["Capture", "PatchHandle", "backend", "capture", "causal_lm_steps", "patch", "tiny_model"]
