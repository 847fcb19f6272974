"""Fused residual add + LayerNorm: its spec, framework lowerings and hand-written kernels."""

from fusionlab.kernels.add_layernorm import framework, handwritten, spec  # noqa: F401
