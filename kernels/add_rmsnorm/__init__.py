"""Fused residual add + RMSNorm: its spec, the framework lowerings and the hand-written kernels."""

from fusionlab.kernels.add_rmsnorm import framework, handwritten, spec  # noqa: F401
