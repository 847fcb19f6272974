"""LayerNorm: its spec, the framework lowerings and the hand-written kernels."""

from fusionlab.kernels.layernorm import framework, handwritten, spec  # noqa: F401
