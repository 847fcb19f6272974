"""LayerNorm kernels."""
