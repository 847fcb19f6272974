"""Fused residual-add + RMSNorm kernels."""
