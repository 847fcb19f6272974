"""Measuring one configuration: inputs, timing, the correctness gate, profiling, isolation."""
