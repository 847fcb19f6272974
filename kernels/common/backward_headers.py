"""The C++ headers of the fused CPU backwards: those they share (kernels/common/csrc) and the
forward headers they include. cpp_build puts each header's folder on the include path."""

from __future__ import annotations

from pathlib import Path

_CSRC = Path(__file__).parent / "csrc"
_KERNELS = Path(__file__).parents[1]
WELFORD_MOMENTS = _KERNELS / "layernorm" / "csrc" / "welford_moments.h"
NORM_BACKWARD = (_KERNELS / "rmsnorm" / "csrc" / "cpu_norm_common.h",
                 _CSRC / "norm_backward_partials.h")
"""What every fused backward includes: the CPU helpers and the fixed-order partial sums."""
ADD_NORM_BACKWARD = (*NORM_BACKWARD, _CSRC / "add_norm_backward.h",
                     _CSRC / "norm_backward_rows.h", WELFORD_MOMENTS)
"""The add kernels' backwards: also the per-row gradients and the add's rows."""
