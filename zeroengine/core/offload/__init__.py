"""Optimizer state and stage-3 parameters in host memory or on NVMe."""
