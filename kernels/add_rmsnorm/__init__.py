"""Fused residual add + RMSNorm: its spec, the framework lowerings and the hand-written kernels."""
