"""The C++ headers the CPU ops share (kernels/common/csrc): those of the forwards, and those of
the fused backwards with the forward headers they include. cpp_build puts each header's folder on
the include path."""

from __future__ import annotations

from pathlib import Path

_CSRC = Path(__file__).parent / "csrc"
_KERNELS = Path(__file__).parents[1]
WELFORD_MOMENTS = _KERNELS / "layernorm" / "csrc" / "welford_moments.h"
OP_KERNELS = _CSRC / "op_kernels.h"
"""What every C++ op file includes: op handles, the Autograd kernels' body, registration."""
NORM_ARGS = _CSRC / "norm_args.h"
FORWARD_HEADERS = (OP_KERNELS, NORM_ARGS, _CSRC / "static_flags.h")
"""What every forward also includes: the argument checks, and flags made template arguments."""
NORM_BACKWARD = (_KERNELS / "rmsnorm" / "csrc" / "cpu_norm_common.h", OP_KERNELS, NORM_ARGS,
                 _CSRC / "norm_backward_partials.h",
                 _CSRC / "norm_backward_rows.h", WELFORD_MOMENTS)
"""What every fused backward includes: the CPU helpers, the argument checks, the fixed-order
partial sums and the per-row gradients (with the rows of welford_moments.h)."""
ADD_NORM_BACKWARD = (*NORM_BACKWARD, _CSRC / "add_norm_backward.h")
"""The add kernels' backwards: also their inputs' checks."""
