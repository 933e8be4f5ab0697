"""Helpers for tests and benchmarks: multi-rank runner, tolerance rule."""
