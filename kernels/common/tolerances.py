"""The gate's tolerances against the float64 reference, one per dtype, shared by every norm op
(each computes in fp32 and rounds once to its output dtype)."""

from __future__ import annotations

import torch

from fusionlab.op import Tolerance

TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}
