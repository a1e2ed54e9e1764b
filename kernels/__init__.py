"""Attention kernels for JAX: reference, chunked, Pallas flash, ring and decode attention.

Imports jax only. Backends are chosen at call time, never at import.
"""
