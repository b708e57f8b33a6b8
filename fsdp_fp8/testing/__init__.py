"""Helpers for tests and benchmarks: Super-scale sparse checkpoints for dry runs."""
