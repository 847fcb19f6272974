"""LayerNorm: its spec, the framework lowerings and the hand-written kernels."""

from fusionlab.kernels.layernorm import framework, spec  # noqa: F401
